"""A few rows of the benchmarks without the rest, each a ratio against its reference in one process:

- ``fwd_course``: bench/run.py's eager forward at the course shape (4 x 256, float32), tlm vs HF Llama;
- ``decode``: its eager greedy decoding at batch 1 (16-token prompt, 240 new tokens) and, with
  --compiled, through compile_for_inference;
- ``train_tiny``: bench/train.py's training step on the ``tiny`` preset (the default `tlm train` model)
  at batch 16, tlm's recipe step vs HF Llama + torch AdamW(foreach);
- ``rmsnorm``: tlm_norm.RMSNorm forward + backward vs ``torch.nn.functional.rms_norm`` at the course
  activation shape (4, 256, 512), float32.

    python bench/rows.py [--threads N] [--compiled] [--only ROW ...]   # prints one JSON line per row
"""

import argparse
import json
from collections.abc import Callable

import run
import torch
import train
from _common import alternate_times, gemm_rate, load_average, ratio_spread

from tlm_norm import RMSNorm

ROWS = ["fwd_course", "decode", "decode_compiled", "train_tiny", "rmsnorm"]


def rmsnorm(repeats: int = 1000, shape: tuple[int, ...] = (4, 256, 512)) -> dict:
    """Forward + backward of tlm's RMSNorm and of F.rms_norm on the same input, gain and upstream gradient."""
    torch.manual_seed(0)
    norm = RMSNorm(shape[-1])
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    weight = norm.weight.detach().clone().requires_grad_()
    x = torch.randn(shape, requires_grad=True)
    grad = torch.randn(shape)

    def ours() -> None:
        norm(x).backward(grad)

    def reference() -> None:
        torch.nn.functional.rms_norm(x, (shape[-1],), weight, norm.eps).backward(grad)

    with torch.no_grad():
        torch.testing.assert_close(norm(x), torch.nn.functional.rms_norm(x, (shape[-1],), weight, norm.eps))
    t = alternate_times({"tlm": ours, "ref": reference}, repeats, warmup=10)
    time_ratio, low, high = ratio_spread(t["tlm"], t["ref"])
    return {"tlm_time_over_f_rms_norm": time_ratio, "range": [low, high], "load": load_average()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--compiled", action="store_true", help="also the compile_for_inference decode row")
    parser.add_argument("--only", nargs="+", choices=ROWS, help="run only these rows")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the decode rows (train_tiny: 3 x this)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rate = gemm_rate()
    print(json.dumps({"threads": torch.get_num_threads(), "gemm_gflops": round(rate / 1e9)}), flush=True)
    jobs: dict[str, Callable[[], dict]] = {
        "fwd_course": lambda: run.forward(run.COURSE, 4, 256, 9, rate),
        "decode": lambda: run.decode(run.COURSE, 16, 240, args.repeats),
        "decode_compiled": lambda: run.decode(run.COURSE, 16, 240, args.repeats, compiled=True),
        "train_tiny": lambda: _train_tiny(3 * args.repeats, rate),
        "rmsnorm": rmsnorm,
    }
    chosen = args.only or [r for r in ROWS if r != "decode_compiled" or args.compiled]
    for name in chosen:
        print(json.dumps({name: jobs[name]()}), flush=True)


def _train_tiny(repeats: int, rate: float) -> dict:
    label, cfg, batch = train.SHAPES[0]
    row = train.compare(cfg, batch, repeats, rate, train.recipe_step)
    # HF time / tlm time per part (above 1: tlm faster), as bench/train.py reports it.
    return {"shape": f"{label}, {batch} x {cfg.context_length}", "hf_over_tlm": row["ratio"], "load": row["load"]}


if __name__ == "__main__":
    main()
