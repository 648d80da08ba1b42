"""Context extension: held-out perplexity at 1x, 2x and 4x the context a tiny model was trained at, with RoPE
as trained (extrapolation), with each scaling rule applied zero-shot, and after a short fine-tune at 4x
(``tlm train --init-from RUN --context-length N --rope-scaling RULE``).

    python bench/context_extension.py [--quick]   # writes its docs/benchmarks.md section

The text is the corpus ``tlm train`` uses by default (Python's pydoc topics, shipped with tlm-train): the first
360,000 characters train, those from 380,000 on (about 86,000) are held out. Perplexity is exp of the mean next-token
cross-entropy over every position of non-overlapping windows of the length named, over the same held-out tokens
at every length (so a longer window scores the same tokens with more context before most of them).
"""

import argparse
import math
import os
import pathlib
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import cpu_description, load_average, write_section

BASE_CONTEXT = 64
LENGTHS = (64, 128, 256)
ZERO_SHOT = ("linear", "dynamic", "yarn")
TUNED = ("none", "linear", "yarn")


def perplexity(model: torch.nn.Module, tokens: torch.Tensor, length: int) -> float:
    count = (len(tokens) - 1) // length
    inputs, targets = tokens[: count * length].view(count, length), tokens[1 : count * length + 1].view(count, length)
    total = 0.0
    with torch.no_grad():
        for x, y in zip(inputs.split(16), targets.split(16), strict=True):
            total += torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum").item()
    return math.exp(total / targets.numel())


def at_context(model, length: int, rule: str | None):
    from tlm_model import TransformerLM
    from tlm_rope import extension_scaling

    config = model.config
    scaling = None if rule is None or length == config.context_length else extension_scaling(
        rule, config.context_length, length
    )  # fmt: skip
    fields = {**config.to_dict(), "context_length": max(length, config.context_length), "rope_scaling": scaling}
    wider = TransformerLM(type(config).from_dict(fields)).eval()
    wider.load_state_dict(model.state_dict())
    return wider


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and tokens (a smoke run; no doc section)")
    args = parser.parse_args()
    import tlm_artifacts
    from tlm_command.main import main as tlm
    from tlm_train import default_corpus

    steps, tune_steps, held_tokens = (20, 5, 2048) if args.quick else (600, 150, 24_576)
    text = default_corpus()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        (root / "train.txt").write_text(text[:360_000], encoding="utf-8")
        held = text[380_000:]
        common = ["--data", str(root / "train.txt"), "--batch-size", "16", "--eval-batches", "2", "--sample-tokens",
                  "0", "--peak-flops", "1e9", "--quiet"]  # fmt: skip
        base = root / "base"
        tlm(["train", *common, "--out-dir", str(base), "--context-length", str(BASE_CONTEXT), "--steps", str(steps),
             "--vocab-size", "1024", "--checkpoint-interval", str(steps)])  # fmt: skip
        model, _ = tlm_artifacts.load_model(tlm_artifacts.resolve(str(base)))
        tokenizer = tlm_artifacts.load_tokenizer(tlm_artifacts.resolve(str(base)))
        tokens = torch.tensor(list(tokenizer.encode(held)[: held_tokens + 1]), dtype=torch.long)
        rows: dict[str, list[float]] = {"as trained (extrapolation)": [
            perplexity(at_context(model, n, None), tokens, n) for n in LENGTHS]}  # fmt: skip
        for rule in ZERO_SHOT:
            rows[f"{rule}, zero-shot"] = [perplexity(at_context(model, n, rule), tokens, n) for n in LENGTHS]
        for rule in TUNED:
            out = root / f"tuned-{rule}"
            scaling = [] if rule == "none" else ["--rope-scaling", rule]
            argv = ["train", *common, "--init-from", str(base), "--out-dir", str(out), "--context-length",
                    str(LENGTHS[-1]), *scaling, "--steps", str(tune_steps), "--batch-size", "4", "--lr", "1e-3",
                    "--warmup-steps", "10", "--checkpoint-interval", str(tune_steps)]  # fmt: skip
            tlm(argv)
            tuned, _ = tlm_artifacts.load_model(tlm_artifacts.resolve(str(out)))
            label = "no scaling" if rule == "none" else rule
            rows[f"{label}, fine-tuned {tune_steps} steps at {LENGTHS[-1]}"] = [
                perplexity(tuned.eval(), tokens, n) for n in LENGTHS
            ]
    minutes = (time.perf_counter() - started) / 60
    head = " | ".join(f"{n} ({n // BASE_CONTEXT}x)" for n in LENGTHS)
    lines = [
        "## Context extension: held-out perplexity at 1x, 2x and 4x the trained context (`bench/context_extension.py`)",
        "",
        f"Machine: {cpu_description()}; load average {load_average():.1f}; {minutes:.1f} minutes in all.",
        "",
        f"The tiny preset (~1 M parameters, 1,024-token BPE) trained {steps} steps (batch 16) at a "
        f"{BASE_CONTEXT}-token context on the first 360,000 characters of the default corpus; perplexity over "
        f"the same {held_tokens:,} held-out tokens in windows of each length. Zero-shot rows change only the "
        f"RoPE tables (the factor is the window over {BASE_CONTEXT}); fine-tuned rows train {tune_steps} more "
        f"steps (batch 4, lr 1e-3) at {LENGTHS[-1]} tokens with `tlm train --init-from --context-length "
        f"{LENGTHS[-1]} --rope-scaling RULE` (no scaling: `--context-length` alone).",
        "",
        f"| RoPE | {head} |",
        "| --- |" + " ---: |" * len(LENGTHS),
        *(f"| {name} | " + " | ".join(f"{p:.2f}" for p in values) + " |" for name, values in rows.items()),
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    if not args.quick:
        write_section("context", report)


if __name__ == "__main__":
    main()
