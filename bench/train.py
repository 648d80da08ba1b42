"""Training-loop throughput: tlm-train's loop against a reference loop of HF transformers'
LlamaForCausalLM + torch.optim.AdamW(foreach=True), same weights, same batches, one process.

    python bench/train.py [--quick]        # writes its section of docs/benchmarks.md and prints it

Both loops do everything a training step does: draw the batch (tlm_train.BatchSampler from the
same token array), forward, backward, gradient clipping at 1.0, the optimizer step, the
schedule, and read the loss back to the host for logging. tlm runs ``train_step`` on
``LanguageModelLoss`` (chunked LM head + loss) with tlm-optim's AdamW; HF computes full logits
and ``F.cross_entropy``. Times are medians of alternating repeats (tlm, HF, tlm, ...) after a
warm-up. "Loop overhead" is tlm's step time minus a bare forward+backward of the same batch, as a
share of the step. MFU is the model's training FLOPs (3 × forward matmuls, causal attention)
per second over the float32 GEMM rate measured in the same run (2048³ ``torch.mm``).
"""

import argparse
import datetime
import os
import pathlib
import sys

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from _common import alternate, cpu_description, gemm_rate, write_section

from tlm_model import ModelConfig, TransformerLM
from tlm_model.interop import hf_llama_config_kwargs, to_hf_llama_state_dict
from tlm_optim import AdamW, CosineSchedule
from tlm_train import BatchSampler, LanguageModelLoss, train_step
from tlm_train.metrics import training_flops_per_token

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL = ModelConfig(vocab_size=1024, context_length=128, d_model=128, num_layers=4, num_heads=4, d_ff=384)
COURSE = ModelConfig.from_preset("course-tinystories")


def compare(cfg: ModelConfig, batch: int, repeats: int, rate: float) -> dict[str, float]:
    torch.manual_seed(0)
    ours = TransformerLM.from_config(cfg, fused=False)  # the layout tlm-train trains
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**hf_llama_config_kwargs(cfg), attn_implementation="sdpa")
    )
    hf.load_state_dict(to_hf_llama_state_dict(ours.state_dict(), cfg))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 200_000).astype(np.uint16)
    samplers = {name: BatchSampler(tokens, batch, cfg.context_length, seed=1) for name in ("tlm", "hf", "bare")}

    loss_module = LanguageModelLoss(ours)
    optimizer = AdamW(ours.parameters(), lr=1e-4, weight_decay=0.1)
    schedule = CosineSchedule(optimizer, 1e-4, 1e-5, 10, 10_000)
    hf_optimizer = torch.optim.AdamW(hf.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)
    hf_schedule = torch.optim.lr_scheduler.LambdaLR(hf_optimizer, lambda t: min(1.0, (t + 1) / 10))

    def tlm_step() -> None:
        stats = train_step(loss_module, optimizer, [next(samplers["tlm"])], scheduler=schedule, max_grad_norm=1.0)
        _ = {"loss": stats.loss, "lr": stats.lr, "grad_norm": stats.grad_norm}  # what the run logs

    def hf_step() -> None:
        inputs, targets = next(samplers["hf"])
        hf_optimizer.zero_grad(set_to_none=True)
        logits = hf(input_ids=inputs).logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        hf_optimizer.step()
        hf_schedule.step()
        _ = {"loss": loss.item(), "lr": hf_schedule.get_last_lr()[0], "grad_norm": norm.item()}

    def bare() -> None:  # forward + backward only, the same model and batch shape
        inputs, targets = next(samplers["bare"])
        ours.loss(inputs, targets).backward()
        ours.zero_grad(set_to_none=True)

    t = alternate({"tlm": tlm_step, "hf": hf_step, "bare": bare}, repeats)
    tokens_per_step = batch * cfg.context_length
    flops = training_flops_per_token(cfg, cfg.context_length) * tokens_per_step
    return {
        "tlm_s": t["tlm"],
        "hf_s": t["hf"],
        "ratio": t["hf"] / t["tlm"],
        "overhead": (t["tlm"] - t["bare"]) / t["tlm"],
        "tokens_per_s": tokens_per_step / t["tlm"],
        "mfu": flops / t["tlm"] / rate,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, no course-preset row")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    args = parser.parse_args()
    repeats = 3 if args.quick else 7
    rate = gemm_rate()
    rows = [("default `tlm train` model (1.1 M params) 16 × 128", compare(SMALL, 16, repeats, rate))]
    if not args.quick:
        rows.append(("course-tinystories preset 2 × 256", compare(COURSE, 2, repeats, rate)))
    lines = [
        "# Training loop: tlm-train vs HF Llama + torch AdamW(foreach)",
        "",
        f"{datetime.date.today()}, {cpu_description()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}.",
        f"Float32 GEMM rate (2048³ torch.mm, this run): {rate / 1e9:.0f} GFLOP/s; "
        f"load average at the end: {os.getloadavg()[0]:.1f} (a shared machine: ratios are same-run, times are not).",
        "",
        "| workload | tlm step | HF step | HF ÷ tlm (≥ 1: tlm faster) | tlm loop overhead | tlm tokens/s | MFU |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in rows:
        lines.append(
            f"| {label} | {r['tlm_s'] * 1e3:.0f} ms | {r['hf_s'] * 1e3:.0f} ms | {r['ratio']:.2f}× | "
            f"{100 * r['overhead']:.1f}% | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% |"
        )
    lines += [
        "",
        "Method: `bench/train.py` (medians of alternating repeats; loop overhead = step − bare forward+backward).",
        "",
    ]
    text = "\n".join(lines)
    write_section("train", text, pathlib.Path(args.out))
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
