"""`tlm serve` under load: 1, 4 and 16 concurrent clients against the same requests one at a time, and against
HF transformers' batched ``generate`` on the HF export of the same model.

Run through ``nox -s bench -- serve`` to write its section of docs/benchmarks.md; ``python bench/serve.py
--quick`` is a short smoke run that prints the table.

Method. The course model's shape (``course-tinystories``) with random weights and a BPE tokenizer trained on
the text that ships with Python, saved as a model folder; ``tlm serve`` runs it in its own process on
127.0.0.1 (eager, the scheduler's one thread plus torch's intra-op threads). Each client sends the same
``--requests`` streamed greedy completions (prompts of different lengths, ``--max-tokens`` each), one after
another; with C clients C·R requests are in flight at most C at a time. "One at a time" sends all C·R
requests of the 16-client run from one client, in order. Measured per run: generated tokens (the answers'
``usage``) per second of wall time, and each request's time to its first streamed token and to its last (p50
and p99 over the run's requests). HF's row is ``LlamaForCausalLM.generate`` (greedy, left-padded batches of
16 prompts, the same new-token count) in this process on the export of the same weights. Everything is on
loopback and bounded: a few hundred requests at most and a timeout per request.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from _common import cpu_description, load_average, write_section

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMPTS = [
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog, and then",
    "def main(argv):\n    parser = argparse.ArgumentParser()\n",
    "In the beginning",
    "A list of the standard library modules that deal with files and folders:",
    "x",
    "Python is a programming language that lets you work quickly and integrate systems more effectively. It",
    "import os",
]


def _model_folder(out: pathlib.Path, context: int | None = None) -> pathlib.Path:
    import dataclasses

    import torch

    from tlm_model import ModelConfig, TransformerLM, save_model_file
    from tlm_tokenizer import Tokenizer, train_bpe
    from tlm_train import default_corpus

    cfg = ModelConfig.from_preset("course-tinystories")
    if context is not None:  # the same weights (RoPE has none); only the server's KV caches are this long
        cfg = dataclasses.replace(cfg, context_length=context)
    text = out / "corpus.txt"
    text.write_text(default_corpus(), encoding="utf-8")
    vocab, merges = train_bpe(text, cfg.vocab_size, ["<|endoftext|>"], num_workers=1)
    torch.manual_seed(0)
    folder = out / "course"
    save_model_file(TransformerLM(cfg).eval(), folder)
    Tokenizer(vocab, merges, ["<|endoftext|>"]).save(folder / "tokenizer")
    return folder


class _Server:
    def __init__(
        self,
        folder: pathlib.Path,
        max_batch: int,
        *extra: str,
        threads: int | None = None,
        python: str | None = None,
        wait_compiled: bool = True,
    ) -> None:
        # The first stderr line comes once the server listens.
        start = time.perf_counter()
        env = dict(os.environ) | ({"OMP_NUM_THREADS": str(threads)} if threads else {})
        self.process = subprocess.Popen(
            [python or sys.executable, "-m", "tlm", "serve", "--checkpoint", str(folder), "--port", "0", "--max-batch",
             str(max_batch), "--max-queue", "256", "--model-name", "course", *extra],
            stderr=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        # Warnings (a compiler's, say) may come first: the line that names the address is the one.
        line = ""
        while "127.0.0.1:" not in line:
            line = self.process.stderr.readline()
            if not line:
                raise RuntimeError(f"the server exited with {self.process.wait()} before it listened")
            print(line, end="", file=sys.stderr)
        self.port = int(line.split("127.0.0.1:")[1].split("/")[0])
        threading.Thread(target=self.process.stderr.read, daemon=True).start()  # the access log: never a full pipe
        self.texts: dict[str, tuple[str, str | None, int]] = {}
        self.listen_s: float | None = None
        deadline = time.monotonic() + 3600
        while time.monotonic() < deadline:
            try:
                health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5).read())
            except OSError:
                time.sleep(0.1)
                continue
            if self.listen_s is None:
                self.listen_s = time.perf_counter() - start  # loading: the server answers from here on
            # A server that compiles serves with its eager engine until the compiled one has warmed up (issue
            # 41; an older one answers once warmed up, with no "engine"): the rounds time the compiled one.
            if not wait_compiled or health.get("engine", "compiled") == "compiled" or "--no-compile" in extra:
                self.startup_s = time.perf_counter() - start  # loading, compiling and warming up
                return
            time.sleep(1.0)
        raise RuntimeError("the server's compiled engine never took over")

    def cpu_s(self) -> float:
        """CPU seconds the server process has used so far (every thread: the scheduler's, the event loop's)."""
        fields = pathlib.Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stream(self, prompt: str, max_tokens: int) -> tuple[float, float, int]:
        """(seconds to the first streamed token, to the last, tokens generated) of one greedy completion; its text
        and finish reason are left in ``self.texts[prompt]``."""
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                           "stop": []}).encode()  # fmt: skip
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        start = time.perf_counter()
        first, tokens, text, reason = None, 0, [], None
        with urllib.request.urlopen(request, timeout=600) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if first is None:
                    first = time.perf_counter() - start
                for choice in chunk.get("choices", []):
                    text.append(choice.get("text", ""))
                    reason = choice.get("finish_reason") or reason
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        self.texts[prompt] = ("".join(text), reason, tokens)
        return first if first is not None else float("nan"), time.perf_counter() - start, tokens

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


def _clients(server: _Server, clients: int, requests: list[str], max_tokens: int) -> dict:
    results: list[tuple[float, float, int]] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        # Each client starts at another of the same requests, so the rows in flight have different lengths.
        for prompt in requests[k % len(requests) :] + requests[: k % len(requests)]:
            outcome = server.stream(prompt, max_tokens)
            with lock:
                results.append(outcome)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    return _summary(results, wall, f"{clients} client{'s' if clients > 1 else ''}")


def _health_under_big_requests(server: _Server, context: int, longest_token: int) -> dict:
    """The worst and median time /health takes while big requests are parsed, tokenized or refused, one kind at a
    time: a text prompt of the most characters the context can hold (tokenized, then refused if too long), a body
    of token ids just under --max-body (parsed, refused for the context), and a body over it (refused unread)."""
    from tlm_command.openai_api import MAX_BODY

    text = "word " * (context * longest_token // 5)
    ids_under = json.dumps({"prompt": [7] * ((MAX_BODY - 100) // 3), "max_tokens": 1}).encode()
    ids_over = json.dumps({"prompt": [7] * 2_500_000, "max_tokens": 1}).encode()
    bodies = {"maximal text prompt": json.dumps({"prompt": text, "max_tokens": 1}).encode(),
              "token ids under --max-body": ids_under, "token ids over --max-body": ids_over}  # fmt: skip
    rows = {}
    for label, body in bodies.items():
        latencies: list[float] = []
        done = threading.Event()

        def poll(done: threading.Event = done, latencies: list[float] = latencies) -> None:
            while not done.is_set():
                start = time.perf_counter()
                urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=60).read()
                latencies.append(time.perf_counter() - start)
                time.sleep(0.002)

        poller = threading.Thread(target=poll)
        poller.start()
        statuses = []
        for _ in range(10):
            request = urllib.request.Request(f"http://127.0.0.1:{server.port}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})  # fmt: skip
            try:
                with urllib.request.urlopen(request, timeout=600) as response:
                    statuses.append(response.status)
            except urllib.error.HTTPError as err:
                statuses.append(err.code)
            except OSError:
                statuses.append(-1)  # the server answered 413 and closed before the body was all sent
        done.set()
        poller.join()
        rows[label] = {"bytes": len(body), "statuses": sorted(set(statuses)), "health_max_ms": 1000 * max(latencies),
                       "health_p50_ms": 1000 * _percentile(latencies, 0.5), "polls": len(latencies)}  # fmt: skip
    return rows


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def _summary(results: list[tuple[float, float, int]], wall: float, label: str) -> dict:
    firsts, lasts = [r[0] for r in results], [r[1] for r in results]
    tokens = sum(r[2] for r in results)
    return {"label": label, "requests": len(results), "tokens": tokens, "wall": wall, "tok_s": tokens / wall,
            "ttft_p50": _percentile(firsts, 0.5), "ttft_p99": _percentile(firsts, 0.99),
            "last_p50": _percentile(lasts, 0.5), "last_p99": _percentile(lasts, 0.99)}  # fmt: skip


class _HF:
    """transformers' batched greedy generate on the HF export of the same weights, ``batch`` prompts at a time."""

    def __init__(self, folder: pathlib.Path, out: pathlib.Path) -> None:
        import transformers

        from tlm_model import load_model_file, save_hf
        from tlm_tokenizer import Tokenizer

        self.tokenizer = Tokenizer.load(folder / "tokenizer")
        save_hf(load_model_file(folder), out / "hf")
        self.model = transformers.LlamaForCausalLM.from_pretrained(out / "hf", attn_implementation="sdpa").eval()

    def run(self, requests: list[str], max_tokens: int, batch: int) -> tuple[dict, dict[str, list[int]]]:
        """(the row of the table, each prompt's generated ids)."""
        import torch

        encoded = [self.tokenizer.encode(p) for p in requests]
        tokens, generated = 0, {}
        start, cpu = time.perf_counter(), time.process_time()
        with torch.no_grad():
            for i in range(0, len(encoded), batch):
                group = encoded[i : i + batch]
                width = max(map(len, group))
                ids = torch.tensor([[0] * (width - len(g)) + g for g in group])
                mask = torch.tensor([[0] * (width - len(g)) + [1] * len(g) for g in group])
                new = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                          min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)  # fmt: skip
                tokens += (new.shape[1] - width) * len(group)
                for prompt, row in zip(requests[i : i + batch], new[:, width:].tolist(), strict=True):
                    generated[prompt] = row
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        return {"label": f"HF generate, batches of {batch}", "requests": len(encoded), "tokens": tokens, "wall": wall,
                "tok_s": tokens / wall, "cpu": cpu}, generated  # fmt: skip

    def same_texts(self, texts: dict[str, tuple[str, str | None, int]], generated: dict[str, list[int]]) -> bool:
        """Whether each streamed greedy text is HF's: its first ``tokens`` ids decoded (one fewer where the server
        stopped at an end-of-text token, which HF's ``min_new_tokens`` rules out)."""
        for prompt, (text, reason, tokens) in texts.items():
            ids = generated[prompt][: tokens - 1 if reason == "stop" else tokens]
            # The model's vocabulary may be larger than the tokenizer's: the server sends no text for such an id.
            if text != self.tokenizer.decode([i for i in ids if i < self.tokenizer.vocab_size]):
                return False
        return True


def render(rows: list[dict], meta: dict) -> str:
    v = meta["versus"]
    alone = next(r for r in rows if r["label"] == "one at a time")
    lines = [
        "## Serving: `tlm serve` under concurrent clients",
        "",
        "<!-- Generated by bench/serve.py (`nox -s bench -- serve`); do not edit by hand. -->",
        "",
        f"Machine: {meta['cpu']}; torch {meta['torch']}, {meta['threads']} thread(s) per side; 1-minute load average "
        f"{meta['load_before']:.1f} before and {meta['load_after']:.1f} after (the machine is shared with other "
        "jobs, whose load moves between the rows, so each figure is rough: compare the 1-client row with the "
        "one-at-a-time row, the same work).",
        f"Model: `course-tinystories` shape with random weights; each request a streamed greedy completion of "
        f"{meta['max_tokens']} tokens from one of {len(PROMPTS)} prompts of different lengths; each client sends "
        f"{meta['requests']} requests one after another. `tlm serve --max-batch {meta['max_batch']}"
        f"{'' if meta.get('compiled', False) else ' --no-compile'}`, on 127.0.0.1.",
        "",
        "| run | requests | tokens | tokens/s | × one at a time | TTFT p50 / p99 (s) | last token p50 / p99 (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ttft = f"{r['ttft_p50']:.2f} / {r['ttft_p99']:.2f}" if "ttft_p50" in r else "–"
        last = f"{r['last_p50']:.2f} / {r['last_p99']:.2f}" if "last_p50" in r else "–"
        lines.append(
            f"| {r['label']} | {r['requests']} | {r['tokens']} | {r['tok_s']:.0f} | "
            f"{r['tok_s'] / alone['tok_s']:.2f} | {ttft} | {last} |"
        )
    lines += [
        "",
        '"One at a time" is the 16-client run\'s requests sent by one client in order: the server decodes one row '
        "a step. With C clients the scheduler runs one batched forward a step for up to C rows, so the throughput "
        "gained is what batching the matmuls gains on this CPU; time to first token grows with the queue and the "
        "prefills that share its steps. HF's row has no HTTP, no streaming and no scheduler: whole batches, each "
        "finished before the next starts.",
        "",
        f"Against HF, {meta['rounds']} rounds of {v['clients']} clients alternating with HF's batched generate on "
        f"the same requests: **{v['wall'][0]:.2f}x** HF's tokens/s (range {v['wall'][1]:.2f}-{v['wall'][2]:.2f}), "
        f"{v['cpu'][0]:.2f}x ({v['cpu'][1]:.2f}-{v['cpu'][2]:.2f}) in CPU time per token (the server process's, "
        f"its HTTP included, against HF's); greedy texts equal to HF's: {v['same_texts']}. The server answered "
        f"{meta.get('listen_s') or 0:.0f} s after it started (loading) and its compiled engine served "
        f"{meta['startup_s']:.0f} s after it started (compiling every batch size's step in the background); the "
        "rounds ran once it served.",
    ]
    return "\n".join(lines) + "\n"


def _against_hf(servers: dict[str, _Server], hf: _HF, clients: int, requests: int, max_tokens: int,
                rounds: int) -> dict:  # fmt: skip
    """Rounds of the ``clients``-client run on each server alternating with HF's batched generate on the same
    requests: per server, each round's ratio of tokens/s (wall time) and of CPU time per token (the server
    process's against this process's while HF runs: what the machine's other jobs take from either side counts
    in neither), and whether its texts agree with HF's."""
    per_client = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    everything = [PROMPTS[i % len(PROMPTS)] for i in range(requests * clients)]
    results = {name: {"clients": clients, "wall": [], "cpu": [], "same_texts": True} for name in servers}
    for _ in range(rounds):
        runs = {}
        for name, server in servers.items():
            server.texts.clear()
            cpu = server.cpu_s()
            runs[name] = _clients(server, clients, per_client, max_tokens), server.cpu_s() - cpu
        theirs, generated = hf.run(everything, max_tokens, batch=clients)
        for name, (ours, ours_cpu) in runs.items():
            result = results[name]
            result["same_texts"] = result["same_texts"] and hf.same_texts(servers[name].texts, generated)
            result["wall"].append(ours["tok_s"] / theirs["tok_s"])
            result["cpu"].append((theirs["cpu"] / theirs["tokens"]) / (ours_cpu / ours["tokens"]))
            result["ours"], result["hf"] = ours, theirs
            print(f"round, {name}: {ours['tok_s']:.0f} vs HF {theirs['tok_s']:.0f} tok/s ({result['wall'][-1]:.2f}x "
                  f"wall, {result['cpu'][-1]:.2f}x CPU time), load {load_average():.1f}", file=sys.stderr)  # fmt: skip
    for result in results.values():
        result["wall"], result["cpu"] = _spread(result["wall"]), _spread(result["cpu"])
    return results


def _first_bursts(folder: pathlib.Path, out: pathlib.Path, extra: list[str], threads: int, requests: int,
                  max_tokens: int, rounds: int) -> dict:  # fmt: skip
    """Rounds of HF's batched generate followed by a fresh server's first burst (16 clients sent the moment it
    answers, while it may still compile in the background): per round the ratio of tokens/s (wall time) and of
    CPU time per token (the server process's over the burst, a background compiler's included, against HF's),
    whether the greedy texts agree, and the load; their median and range."""
    per_client = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    hf = _HF(folder, out)
    result: dict = {"rounds": [], "same_texts": True}
    for _ in range(rounds):
        theirs, generated = hf.run([p for _ in range(16) for p in per_client], max_tokens, 16)
        server = _Server(folder, 16, *extra, threads=threads, wait_compiled=False)
        try:
            cpu = server.cpu_s()
            ours = _clients(server, 16, per_client, max_tokens)
            ours_cpu = server.cpu_s() - cpu
        finally:
            server.stop()
        result["same_texts"] = result["same_texts"] and hf.same_texts(server.texts, generated)
        result["rounds"].append({"answered_s": round(server.listen_s or 0, 1), "burst_tok_s": round(ours["tok_s"]),
                                 "hf_tok_s": round(theirs["tok_s"]),
                                 "wall": round(ours["tok_s"] / theirs["tok_s"], 2),
                                 "cpu": round((theirs["cpu"] / theirs["tokens"]) / (ours_cpu / ours["tokens"]), 2),
                                 "load": round(load_average(), 1)})  # fmt: skip
        print(result["rounds"][-1], file=sys.stderr)
    for key in ("wall", "cpu"):
        result[key] = _spread([r[key] for r in result["rounds"]])
    return result


def _spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2, help="requests each client sends")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="1 and 4 clients, 16 tokens, no doc written")
    parser.add_argument("--clients", type=int, nargs="+", help="these client counts only (no doc written)")
    parser.add_argument("--no-compile", action="store_true", help="tlm serve --no-compile (eager decoding)")
    parser.add_argument("--health", action="store_true", help="only /health's latency under big requests")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the most clients against HF, alternating")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server and of HF's side")
    parser.add_argument(
        "--before",
        metavar="PYTHON",
        help="also a server run by this interpreter (another "
        "checkout's environment), alternating in the rounds against HF (no doc written)",
    )
    parser.add_argument(
        "--context",
        type=int,
        help="the model's context (default the preset's, 256): the server's "
        "caches hold this many positions, and its compiled step attends over all of them",
    )
    parser.add_argument("--against-hf-only", action="store_true", help="only the rounds against HF (no doc written)")
    parser.add_argument(
        "--first-burst",
        action="store_true",
        help="only --rounds of HF's batched generate, each followed by a fresh server and 16 clients sent the "
        "moment it answers (no doc written)",
    )
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    max_tokens = 16 if args.quick else args.max_tokens
    counts = args.clients or ([1, 4] if args.quick else [1, 4, 16])
    load_before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp)
        folder = _model_folder(out, args.context)
        extra = ["--no-compile"] if args.no_compile else []
        if args.before:  # both start (and compile) together
            before = threading.Thread(target=lambda: servers.update(before=_Server(
                folder, max(counts), *extra, threads=args.threads, python=args.before)))  # fmt: skip
            servers: dict[str, _Server] = {}
            before.start()
        if args.first_burst:
            print(json.dumps(_first_bursts(folder, out, extra, args.threads, args.requests, max_tokens,
                                           args.rounds)))  # fmt: skip
            return
        server = _Server(folder, max(counts), *extra, threads=args.threads)
        print(f"the server answered {server.listen_s:.0f} s after it started, its compiled engine "
              f"{server.startup_s:.0f} s after", file=sys.stderr)  # fmt: skip
        if args.before:
            before.join()
            print(f"the server before listened {servers['before'].startup_s:.0f} s after it started", file=sys.stderr)
        if args.health:
            from tlm_model import ModelConfig
            from tlm_tokenizer import Tokenizer

            longest = max(map(len, Tokenizer.load(folder / "tokenizer").vocab.values()))
            try:
                print(json.dumps(_health_under_big_requests(server, ModelConfig.from_preset("course-tinystories")
                                                            .context_length, longest), indent=1))  # fmt: skip
            finally:
                server.stop()
            return
        rows = []
        try:
            server.stream(PROMPTS[0], 4)  # warm-up
            hf = _HF(folder, out)
            everyone = ({"before": servers["before"]} if args.before else {}) | {"this": server}
            compared = _against_hf(everyone, hf, max(counts), args.requests, max_tokens, args.rounds)
            versus = compared["this"]
            if not args.against_hf_only:
                per_client = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
                for clients in counts:
                    rows.append(_clients(server, clients, per_client, max_tokens))
                    print(rows[-1], file=sys.stderr)
                everything = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests * max(counts))]
                alone = _clients(server, 1, everything, max_tokens)
                alone["label"] = "one at a time"
                rows.insert(0, alone)
                print(alone, file=sys.stderr)
                rows.append(versus["hf"])
        finally:
            server.stop()
            if args.before:
                servers["before"].stop()
    for name, result in compared.items():
        startup = (servers["before"] if name == "before" else server).startup_s
        print(name, json.dumps({"startup_s": startup} | {k: v for k, v in result.items() if k not in ("ours", "hf")}),
              file=sys.stderr)  # fmt: skip
    if args.against_hf_only or args.before:
        return
    meta = {"cpu": cpu_description(), "torch": torch.__version__, "threads": args.threads,
            "load_before": load_before, "load_after": load_average(), "max_tokens": max_tokens,
            "requests": args.requests, "max_batch": max(counts), "compiled": not args.no_compile,
            "startup_s": server.startup_s, "listen_s": server.listen_s, "versus": versus,
            "rounds": args.rounds}  # fmt: skip
    text = render(rows, meta)
    print(text)
    if not args.quick and not args.clients:
        write_section("serve", text)
        print(f"wrote {os.path.relpath(ROOT / 'docs' / 'benchmarks.md')}", file=sys.stderr)


if __name__ == "__main__":
    main()
