"""A few rows of bench/run.py without the rest: the eager forward at the course shape (4 x 256, float32)
and greedy decoding (16-token prompt, 240 new tokens), eager and, with --compiled, through
compile_for_inference; tlm vs HF LlamaForCausalLM in one process, as in the full benchmark.

    python bench/rows.py [--threads N] [--compiled]      # prints one JSON line per row
"""

import argparse
import json

import run
import torch
from _common import gemm_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--compiled", action="store_true", help="also the compile_for_inference decode row")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rate = gemm_rate()
    print(json.dumps({"threads": torch.get_num_threads(), "gemm_gflops": round(rate / 1e9)}), flush=True)
    print(json.dumps({"fwd_course": run.forward(run.COURSE, 4, 256, 9, rate)}), flush=True)
    print(json.dumps({"decode": run.decode(run.COURSE, 16, 240, 3)}), flush=True)
    if args.compiled:
        print(json.dumps({"decode_compiled": run.decode(run.COURSE, 16, 240, 3, compiled=True)}), flush=True)


if __name__ == "__main__":
    main()
