"""lm-evaluation-harness's log-likelihood requests through `tlm serve`: requests per second.

Method. The course model's shape with random weights and a BPE tokenizer (``bench/serve.py``'s model folder),
exported with ``tlm convert --to-hf`` (lm-eval's ``local-completions`` needs an HF tokenizer) and served by
``tlm serve --no-compile`` (the eager engine: no minutes of warm-up) on 127.0.0.1. lm-eval runs a local JSON Lines
multiple-choice task of ``--items`` questions with 4 choices each (``--items`` x 4 log-likelihood requests, each a
completion with ``echo``, ``logprobs`` and ``max_tokens`` 0 or 1), ``batch_size=16`` prompts a request; the
figure is log-likelihood requests per second of lm-eval's whole second run (the first, which reads the
data and warms the server up, is not timed), and the server process's CPU seconds during that run (user + system,
from /proc: steadier than wall time on a shared machine). ``--python`` runs the server with another
interpreter (another checkout's environment: the "before" of a change); both servers answer the same requests,
and the per-request log-likelihoods must agree to 1e-4.

    python bench/lm_eval_serve.py [--items 50] [--python /path/to/other/python]
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from _common import cpu_description, load_average
from serve import _model_folder, _Server

WORDS = ["the", "module", "file", "def", "import", "os", "value", "list", "return", "class", "object", "name"]


def _task(folder: pathlib.Path, items: int) -> str:
    rows = []
    for i in range(items):
        question = " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(3 + i % 9))
        words = [[WORDS[(i + c * 5 + k) % len(WORDS)] for k in range(1 + (i + c) % 4)] for c in range(4)]
        choices = [" " + " ".join(choice) for choice in words]
        rows.append({"question": question, "choices": choices, "answer": i % 4})
    (folder / "mc.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "tlm_bench_mc.yaml").write_text(
        f"task: tlm_bench_mc\ndataset_path: json\ntest_split: test\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'mc.jsonl'}\noutput_type: multiple_choice\ndoc_to_text: '{{{{question}}}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n"
    )
    return "tlm_bench_mc"


def _run(server: _Server, export: pathlib.Path, task: str, folder: pathlib.Path) -> tuple[float, list[float]]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    start = time.perf_counter()
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model=course,base_url=http://127.0.0.1:{server.port}/v1/completions,tokenizer={export},"
        "tokenizer_backend=huggingface,max_length=256,batch_size=16",
        tasks=[task], log_samples=True, bootstrap_iters=0,
        task_manager=TaskManager(include_path=str(folder), include_defaults=False),
    )  # fmt: skip
    seconds = time.perf_counter() - start
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return seconds, [resp[0][0] for sample in samples for resp in sample["resps"]]


def _cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far (Linux /proc; fields 14 and 15 of its stat line)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=50)
    parser.add_argument("--python", help="also a server run by this interpreter (the 'before'), alternating")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    load_before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp)
        folder = _model_folder(out)
        export = out / "hf"
        subprocess.run([sys.executable, "-m", "tlm", "convert", "--to-hf", str(folder), "--out", str(export)],
                       check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        task = _task(out, args.items)
        pythons = {"after": sys.executable, **({"before": args.python} if args.python else {})}
        rates: dict[str, list[float]] = {name: [] for name in pythons}
        cpu: dict[str, list[float]] = {name: [] for name in pythons}
        scores: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for name, python in pythons.items():
                server = _Server(export, 16, "--no-compile", "--dtype", "float32", threads=1, python=python)
                try:
                    _run(server, export, task, out)  # lm-eval's first run reads the data and warms the server up
                    used = _cpu_seconds(server.process.pid)
                    seconds, lls = _run(server, export, task, out)
                    used = _cpu_seconds(server.process.pid) - used
                finally:
                    server.process.terminate()
                    server.process.wait(timeout=30)
                rates[name].append(len(lls) / seconds)
                cpu[name].append(1000 * used / len(lls))
                scores[name] = lls
        if args.python:
            worst = max(abs(a - b) for a, b in zip(scores["after"], scores["before"], strict=True))
            assert worst < 1e-4, worst
    print(json.dumps({"requests": args.items * 4, "requests_per_s": rates, "server_cpu_ms_per_request": cpu,
                      "cpu": cpu_description(),
                      "load": [load_before, load_average()]}))  # fmt: skip


if __name__ == "__main__":
    main()
