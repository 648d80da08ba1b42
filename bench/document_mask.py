"""Document masking's cost in a training step: with and without ``document_ids``, same process, per backend.

Usage: ``python bench/document_mask.py [--repeats N] [--threads N] [--preset NAME] [--batch N]
[--context-lengths N ...]`` from the repository root (the workspace's ``packages/*/src`` are put on the path
when tlm is not installed). Writes its section of docs/benchmarks.md.

Method. One model per context length (a preset, ``tiny`` by default), one batch of windows packed with
documents of random lengths (mean 64 tokens) joined by an end-of-text id. Each round times one training
step's forward and backward (``model.loss(...).backward()``) without the mask, then with it (the document
ids derived from the inputs inside the timed step, as ``tlm train --document-mask`` does), back to back,
for each attention backend; the table gives the median of the per-round ratios (masked / plain) and
their range, so load on a shared machine hits both sides of a round alike.
"""

import argparse
import dataclasses
import datetime
import pathlib
import sys

import torch
from _common import alternate_times, cpu_description, load_average, ratio_spread, write_section

ROOT = pathlib.Path(__file__).resolve().parents[1]
try:
    import tlm_model  # noqa: F401
except ImportError:  # run from a checkout: use the workspace sources
    sys.path.extend(str(p) for p in sorted(ROOT.glob("packages/*/src")))

from tlm_model import ModelConfig, TransformerLM, document_ids  # noqa: E402

BACKENDS = ("torch", "reference", "blockwise")
EOT = 0


def packed_batch(batch: int, context: int, vocab: int, mean_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    stream = torch.randint(1, vocab, (batch, context + 1), generator=generator)
    ends = torch.rand(batch, context + 1, generator=generator) < 1.0 / mean_length
    stream[ends] = EOT
    return stream[:, :-1], stream[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context-lengths", type=int, nargs="+", default=[128, 1024], metavar="N")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = ModelConfig.from_preset(args.preset)
    rows = []
    for context in args.context_lengths:
        config = dataclasses.replace(base, context_length=context)
        inputs, targets = packed_batch(args.batch, context, config.vocab_size, 64)
        documents = int((inputs == EOT).sum()) + args.batch
        for backend in BACKENDS:
            torch.manual_seed(0)
            model = TransformerLM(config, attention_backend=backend)

            def plain(
                model: TransformerLM = model, inputs: torch.Tensor = inputs, targets: torch.Tensor = targets
            ) -> None:
                model.zero_grad(set_to_none=True)
                model.loss(inputs, targets).backward()

            def masked(
                model: TransformerLM = model, inputs: torch.Tensor = inputs, targets: torch.Tensor = targets
            ) -> None:
                model.zero_grad(set_to_none=True)
                model.loss(inputs, targets, document_ids=document_ids(inputs, EOT)).backward()

            times = alternate_times({"plain": plain, "masked": masked}, args.repeats)
            median, low, high = ratio_spread(times["masked"], times["plain"])
            plain_ms = sorted(times["plain"])[len(times["plain"]) // 2] * 1e3
            rows.append(
                f"| {context} | {documents} | {backend} | {plain_ms:.1f} | {median:.3f} | {low:.3f}–{high:.3f} |"
            )
            print(rows[-1], flush=True)
    text = "\n".join(
        [
            "## Document masking in a training step (`bench/document_mask.py`)",
            "",
            f"Preset `{args.preset}` ({base.num_layers} layers, d_model {base.d_model}) at each context length, "
            f"batch {args.batch}, documents of mean length 64, forward + backward of `model.loss`, "
            f"{args.repeats} rounds, {args.threads} thread(s), {cpu_description()}, load average "
            f"{load_average():.1f}, {datetime.date.today().isoformat()}. The ratio is masked / plain per round "
            "(median, range). The torch backend loses its causal fast path to an explicit mask; blockwise applies "
            "the mask block by block, still skipping future blocks.",
            "",
            "| context | documents | backend | plain step (ms, median) | masked / plain | range |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    )
    write_section("document_mask", text)


if __name__ == "__main__":
    main()
