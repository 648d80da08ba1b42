"""The one prepared GPU check (issue 33): what a CUDA machine must show before tlm claims anything there.

    python bench/gpu.py [--out DIR] [--skip tests,bench,...] [--dry-run]
    nox -s gpu                       # the same, on the system python (venv_backend="none")
    tools/gpu_check.sh               # the same, one shell command, no nox needed

Parts, most valuable first, each timed and reported even when another fails (a part that cannot run says why;
one not begun when ``--budget`` seconds have passed is reported as skipped, so the whole check ends within 8 min):

- ``tests``: the CUDA test leg: every test not marked slow that takes the ``device`` fixture, run with
  TLM_TEST_DEVICE=cuda (test modules that import a package this python lacks are reported as not collected).
- ``syncs``: ``torch.cuda.set_sync_debug_mode("error")`` around a bf16 ``train_step`` (after the first, which
  builds the optimizer's state) and around ``DecodeBatch.step``: any host synchronisation raises.
- ``bench``: a bf16 training step, tlm (``train_step``, blocks compiled, fused AdamW) against HF Llama
  (``torch.compile``d, full logits + F.cross_entropy, torch's fused AdamW), same weights, same batches,
  alternating rounds; tokens/s and MFU against the device's published dense bf16 peak.
- ``resume``: ``tlm train`` on CUDA (bfloat16 and float32), stopped and resumed from a checkpoint: the
  final weights and metrics bit-identical to the uninterrupted run (deterministic=True, warn_only=False).
- ``nan``: a NaN injected into the loss mid-run on CUDA: the run stops with the ``diverged`` record
  naming that step, the process and its CUDA context still work, the weights and optimizer state equal
  the newest checkpoint's.
- ``decode``: ``DecodeBatch`` on ``compile_for_inference`` (the step under CUDA graphs) in bfloat16 and float32:
  after ``warm_up``, a workload of joins, steps and removals with zero new dynamo frames and zero cudagraph
  skips; steps per second.
- then, as time allows: ``census`` (the dtype of every GEMM and attention call of a bf16 step), ``chunk`` (the
  chunked head's chunk size), ``stall`` (bench/checkpoint_stall.py), ``decode_hf`` (greedy decode tokens/s, tlm
  ``generate`` against HF's static-cache ``generate``, float32).

Results go to ``DIR/gpu.json`` and ``DIR/gpu.md`` (DIR: --out, else $OUT, else bench/out), rewritten whole before
and after each part (``running`` names the part in flight, so a killed check still says where it stopped), and
the GPU section of docs/benchmarks.md is rewritten at the end. At ``--deadline`` seconds (470 on CUDA) a watchdog
records the part still running as killed, writes the results and ends the check. Runs from a checkout with
``packages/*/src`` on PYTHONPATH (no install needed; torch, transformers, pytest and numpy must be there).
``--dry-run`` runs every part on the CPU at toy sizes (to check this script itself on a machine without a GPU;
writes nothing to docs/): the sync check raises on a value read there (its stand-in for CUDA's sync-debug
error), and the decode part compiles with dynamo's eager backend, so its zero-recompile count is real there too.
"""

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
for src in sorted((ROOT / "packages").glob("*/src")):
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))
sys.path.insert(0, str(ROOT / "bench"))

# What `tlm train` (deterministic=True, the default) sets before CUDA is touched; here before torch is imported,
# so every part (the resume's bit-exactness above all) runs as a training run does.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

#: What each part takes on one H100, in seconds (an estimate, generous): a part that would end past --budget is
#: skipped, not begun (the test leg stops itself at TESTS_TIMEOUT_S).
ESTIMATE_S = {"tests": 175, "syncs": 15, "bench": 110, "resume": 40, "nan": 20, "decode": 90, "census": 10,
              "chunk": 15, "stall": 90, "decode_hf": 120}  # fmt: skip

# Most valuable first (issue 42): what has never run on a GPU before what measures it again.
PARTS = ["tests", "syncs", "bench", "resume", "nan", "decode", "census", "chunk", "stall", "decode_hf"]


def _pythonpath() -> str:
    paths = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))] + [str(ROOT / "tools")]
    return os.pathsep.join(paths + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------- tests


_PLUGIN = """
def pytest_collection_modifyitems(config, items):
    keep = [item for item in items if "device" in getattr(item, "fixturenames", ())]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep
"""


TESTS_TIMEOUT_S = 160


def part_tests(device: torch.device, dry: bool, out: pathlib.Path) -> dict[str, Any]:
    """Every test not marked slow that takes the ``device`` fixture, on CUDA, 8 xdist workers when xdist is
    there."""
    plugin_dir = pathlib.Path(tempfile.mkdtemp(prefix="tlm-gpu-plugin-"))
    (plugin_dir / "tlm_device_only.py").write_text(_PLUGIN)
    report = out / "gpu-tests.xml"
    dirs = [str(p) for p in sorted((ROOT / "packages").glob("*/tests"))]
    try:
        import xdist  # noqa: F401

        workers = ["-n", "4" if dry else "8"]
    except ImportError:
        workers = []
    env = {**os.environ, "TLM_TEST_DEVICE": "cpu" if dry else "cuda", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(plugin_dir), _pythonpath()])}  # fmt: skip
    cmd = [sys.executable, "-m", "pytest", *dirs, "-p", "tlm_device_only", "-p", "no:cacheprovider", "-q",
           "-m", "not slow", "--continue-on-collection-errors", f"--junitxml={report}",
           "-o", "addopts=--import-mode=importlib -ra", *workers]  # fmt: skip
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TESTS_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:  # the parts after this one matter too: say so and go on

        def text(b: Any) -> str:
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")

        return {"ok": False, "error": f"the test leg passed its {TESTS_TIMEOUT_S} s", "seconds": TESTS_TIMEOUT_S,
                "tail": text(err.stdout)[-4000:] + text(err.stderr)[-2000:]}  # fmt: skip
    seconds = time.perf_counter() - start
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    failures, not_collected = [], []
    if report.exists():
        import xml.etree.ElementTree as ET

        for case in ET.parse(report).getroot().iter("testcase"):
            kinds = {child.tag for child in case}
            name = f"{case.get('classname')}::{case.get('name')}"
            if "failure" in kinds or "error" in kinds:
                message = next(iter(c.get("message", "") for c in case if c.tag in ("failure", "error")), "")
                if case.get("name", "").startswith("test_") or case.get("name") is None:
                    counts["failed"] += 1
                    failures.append(f"{name}: {message[:300]}")
                else:  # a module that could not be collected
                    counts["errors"] += 1
                    not_collected.append(f"{case.get('classname')}: {message[:200]}")
            elif "skipped" in kinds:
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
    shutil.rmtree(plugin_dir, ignore_errors=True)
    return {"ok": counts["failed"] == 0 and counts["passed"] > 0, "seconds": seconds, "returncode": done.returncode,
            **counts, "failures": failures, "not_collected": not_collected,
            "tail": done.stdout[-4000:] + done.stderr[-2000:]}  # fmt: skip


# --------------------------------------------------------------------------------------- host syncs


@contextlib.contextmanager
def _sync_errors(device: torch.device) -> Any:
    """On CUDA, any synchronising call (a device read, a copy from pageable host memory) raises inside. On a CPU
    (the dry run) the nearest stand-in: reading a tensor's value (``aten._local_scalar_dense``: ``.item()``,
    ``bool(t)``, ``int(t)``) raises the same way, so the dry run takes the same paths as a CUDA run that finds one
    (a CPU has no copies to catch, and ``tolist`` reads CPU memory without dispatching)."""
    if device.type != "cuda":
        from torch.utils._python_dispatch import TorchDispatchMode

        class Reads(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if func is torch.ops.aten._local_scalar_dense.default:
                    raise RuntimeError(f"called a synchronizing operation (dry run: {func} reads a value)")
                return func(*args, **(kwargs or {}))

        with Reads():
            yield
        return
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def part_syncs(device: torch.device, dry: bool, out: pathlib.Path) -> dict[str, Any]:
    """``set_sync_debug_mode("error")`` around train_step (bf16 autocast, gradient accumulation, clipping, the
    schedule, the guard) and around DecodeBatch.step on an eager model (the compiled step is ``decode``'s)."""
    from tlm_model import ModelConfig, TransformerLM
    from tlm_model.batching import DecodeBatch
    from tlm_optim import AdamW, CosineSchedule
    from tlm_train import LanguageModelLoss, NonFiniteGuard, train_step

    cfg = ModelConfig(512, 64, 64, 2, 4, 128)
    torch.manual_seed(0)
    model = TransformerLM(cfg).to(device)
    optimizer = AdamW(model.parameters(), lr=1e-3)
    scheduler = CosineSchedule(optimizer, max_learning_rate=1e-3, min_learning_rate=1e-4, warmup_iters=1,
                               cosine_cycle_iters=10)  # fmt: skip
    guard, loss_module = NonFiniteGuard(device), LanguageModelLoss(model)
    data = torch.randint(0, cfg.vocab_size, (4, 4, cfg.context_length + 1), device=device)
    micro = [[(d[:2, :-1], d[:2, 1:]), (d[2:, :-1], d[2:, 1:])] for d in data]

    def step(i: int) -> Any:
        return train_step(loss_module, optimizer, micro[i], scheduler=scheduler, max_grad_norm=1.0,
                          autocast_dtype=torch.bfloat16, guard=guard)  # fmt: skip

    result: dict[str, Any] = {}
    stats = step(0)  # builds the optimizer's state
    try:
        with _sync_errors(device):
            for i in (1, 2, 3):
                stats = step(i)
        result["train_step"] = "no sync"
    except RuntimeError as err:
        result["train_step"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
    loss, norm = guard.check(optimizer, scheduler, also=(stats.loss, stats.grad_norm))  # a logging step's read
    result["losses_finite"] = bool(np.isfinite([loss, norm]).all())
    model.eval()
    batch = DecodeBatch(model, 4, prefill_chunk=16)
    logits = batch.add_many([torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor(list(range(5, 20)))])
    try:
        with _sync_errors(device), torch.no_grad():
            for _ in range(4):
                logits = batch.step(logits.argmax(-1))
        result["decode_step"] = "no sync"
    except RuntimeError as err:
        result["decode_step"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
    result["ok"] = result["train_step"] == result["decode_step"] == "no sync" and result["losses_finite"]
    return result


# --------------------------------------------------------------------------------------- census


def part_census(device: torch.device, dry: bool, out: pathlib.Path) -> dict[str, Any]:
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from tlm_model import ModelConfig, TransformerLM

    gemms = {"mm", "addmm", "addmm_", "bmm", "baddbmm"}

    class Census(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.rows: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = func.overloadpacket.__name__
            if name in gemms or "scaled_dot_product" in name:
                # Attention's operands are (batch, heads, seq, head_dim); its float32 softmax statistics (3-D, or
                # cuDNN's (batch, heads, seq, 1)) are none.
                rank = 4 if "scaled_dot_product" in name else 2
                leaves = [
                    t
                    for t in tree_leaves((args, kwargs))
                    if isinstance(t, torch.Tensor) and t.ndim >= rank and (rank == 2 or t.shape[-1] > 1)
                ]
                dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in leaves if t.is_floating_point()})
                key = f"{name} {'/'.join(dtypes)}"
                self.rows[key] = self.rows.get(key, 0) + 1
            return func(*args, **(kwargs or {}))

    cfg = ModelConfig(vocab_size=50_257, context_length=256, d_model=256, num_layers=2, num_heads=4, d_ff=704)
    model = TransformerLM(cfg, fused=False).to(device)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.context_length + 1), device=device)
    with Census() as census, torch.autocast(device.type, dtype=torch.bfloat16):
        loss = model.loss(ids[:, :-1], ids[:, 1:])
        loss.backward()
    stray = {k: v for k, v in census.rows.items() if not k.endswith(" bfloat16")}
    return {"ok": not stray and loss.dtype == torch.float32, "calls": census.rows, "not_bf16": stray,
            "loss_dtype": str(loss.dtype)}  # fmt: skip


# --------------------------------------------------------------------------------------- chunk size


def part_chunk(device: torch.device, dry: bool, out: pathlib.Path) -> dict[str, Any]:
    from tlm_model.loss import chunked_cross_entropy, default_chunk_size

    vocab, d_model, tokens = (50_257, 768, 8 * 1024) if not dry else (1000, 64, 512)
    hidden = torch.randn(tokens, d_model, device=device, requires_grad=True)
    weight = (torch.randn(vocab, d_model, device=device) * 0.02).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device=device)
    rows = {}
    sizes = [256, 1024, 2048, 4096, 8192] if not dry else [64, 256]
    for size in sizes:

        def run(size: int = size) -> None:
            hidden.grad = weight.grad = None
            with torch.autocast(device.type, dtype=torch.bfloat16):
                chunked_cross_entropy(hidden, weight, targets, size).backward()

        run()
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(5 if not dry else 2):
            start = time.perf_counter()
            run()
            _sync(device)
            times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")
        rows[size] = {"ms": 1e3 * statistics.median(times), "peak_mib": peak}
    best = min(rows, key=lambda s: rows[s]["ms"])
    chosen = default_chunk_size(device, vocab)
    return {"ok": True, "tokens": tokens, "vocab": vocab, "d_model": d_model, "rows": rows, "fastest": best,
            "default": chosen}  # fmt: skip


# --------------------------------------------------------------------------------------- benchmark


def part_bench(device: torch.device, dry: bool, out: pathlib.Path) -> dict[str, Any]:
    from tlm_model import ModelConfig
    from tlm_train.metrics import peak_flops

    # One shape (the course-tinystories one was dropped to keep the check within 8 minutes).
    shapes = [("GPT-2-small-like (124 M), 16 x 1024", ModelConfig(50_257, 1024, 768, 12, 12, 2048), 16)]
    if dry:
        shapes = [("toy", ModelConfig(512, 64, 64, 2, 4, 128), 4)]
    peak, source = peak_flops(device, "bfloat16")
    rows = []
    for label, cfg, batch in shapes:
        rows.append(_bench_shape(device, dry, label, cfg, batch, peak))
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"ok": True, "peak_flops": peak, "peak_source": source, "rows": rows}


def _bench_shape(device: torch.device, dry: bool, label: str, cfg: Any, batch: int, peak: float) -> dict[str, Any]:
    import transformers

    from tlm_model import TransformerLM
    from tlm_model.interop import hf_llama_config_kwargs, to_hf_llama_state_dict
    from tlm_optim import AdamW
    from tlm_train import NonFiniteGuard, train_step, wrap_model
    from tlm_train.metrics import training_flops_per_token

    rounds, per_round = (7, 5) if not dry else (2, 1)
    torch.manual_seed(0)
    ours = TransformerLM(cfg, fused=False).to(device)
    hf_error = None
    try:
        hf_config = transformers.LlamaConfig(**hf_llama_config_kwargs(cfg), attn_implementation="sdpa")
        hf = transformers.LlamaForCausalLM(hf_config).to(device)
        hf.load_state_dict(to_hf_llama_state_dict(ours.state_dict(), cfg))
    except Exception as err:  # tlm's own figures still count
        hf_error, hf = f"{type(err).__name__}: {err}", torch.nn.Linear(1, 1).to(device)
    loss_module = wrap_model(ours, "none", compile=not dry)  # the recipe's --compile: each block, in place
    hf_run = torch.compile(hf) if not dry else hf
    optimizer = AdamW(ours.parameters(), lr=1e-4, weight_decay=0.1)
    hf_optimizer = torch.optim.AdamW(hf.parameters(), lr=1e-4, weight_decay=0.1, fused=device.type == "cuda")
    guard = NonFiniteGuard(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    data = [torch.randint(0, cfg.vocab_size, (batch, cfg.context_length + 1), generator=gen).to(device)
            for _ in range(4)]  # fmt: skip
    batches = [(d[:, :-1], d[:, 1:]) for d in data]

    def tlm_step(i: int) -> torch.Tensor:
        stats = train_step(loss_module, optimizer, [batches[i % 4]], max_grad_norm=1.0,
                           autocast_dtype=torch.bfloat16, guard=guard)  # fmt: skip
        return stats.loss

    def hf_step(i: int) -> torch.Tensor:
        inputs, targets = batches[i % 4]
        hf_optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = hf_run(input_ids=inputs).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0, foreach=True)
        hf_optimizer.step()
        return loss.detach()

    sides = (("tlm", tlm_step), ("hf", hf_step)) if hf_error is None else (("tlm", tlm_step),)
    compile_s = {}
    for name, fn in sides:
        start = time.perf_counter()
        for i in range(3):
            fn(i)
        _sync(device)
        compile_s[name] = time.perf_counter() - start
    first = {name: float(fn(0)) for name, fn in sides}
    times: dict[str, list[float]] = {name: [] for name, _ in sides}
    memory = {}
    for r in range(rounds):
        for name, fn in sides:
            if device.type == "cuda" and r == 0:
                torch.cuda.reset_peak_memory_stats(device)
            _sync(device)
            start = time.perf_counter()
            for i in range(per_round):
                fn(i)
            float(fn(per_round))  # a logging step's read
            _sync(device)
            times[name].append((time.perf_counter() - start) / (per_round + 1))
            if device.type == "cuda" and r == 0:
                memory[name] = torch.cuda.max_memory_allocated(device) / 2**30
    guard.check(optimizer)  # a NaN would have skipped tlm's updates: say so rather than time them
    tokens = batch * cfg.context_length
    flops = training_flops_per_token(cfg, cfg.context_length) * tokens
    row: dict[str, Any] = {"label": label, "tokens_per_step": tokens, "compile_and_warmup_s": compile_s,
                           "first_losses": first, "memory_gib": memory, "hf_error": hf_error}  # fmt: skip
    for name, _ in sides:
        med = statistics.median(times[name])
        row[name] = {"step_ms": 1e3 * med, "step_ms_range": [1e3 * min(times[name]), 1e3 * max(times[name])],
                     "tokens_per_s": tokens / med, "mfu": flops / med / peak}  # fmt: skip
    if hf_error is None:
        ratios = sorted(h / t for t, h in zip(times["tlm"], times["hf"], strict=True))
        row["speedup_vs_hf"] = [statistics.median(ratios), ratios[0], ratios[-1]]
    else:
        row["speedup_vs_hf"] = None
    return row


# --------------------------------------------------------------------------------------- decode


def _compile_counts() -> dict[str, int]:
    """dynamo's graphs and frames and inductor's cudagraph skips so far (this process). ``unique_graphs`` counts
    every graph dynamo compiles, a recompile included; ``frames`` only frames compiled without ``fullgraph``
    (torch 2.13's ``ConvertFrame``; the decode steps are fullgraph, so it stays 0 there)."""
    from torch._dynamo.utils import counters

    return {"frames": int(counters["frames"]["total"]), "unique_graphs": int(counters["stats"]["unique_graphs"]),
            "cudagraph_skips": int(sum(counters["inductor"].get(k, 0) for k in counters["inductor"]
                                       if "cudagraph" in k and "skip" in k))}  # fmt: skip


def part_decode(device: torch.device, dry: bool, out: pathlib.Path) -> dict[str, Any]:
    """``DecodeBatch`` on ``compile_for_inference`` (on CUDA the step runs under CUDA graphs) in bfloat16 and
    float32: ``warm_up``, then rows join (prompts of several lengths), decode, leave and join again; after the
    warm-up no new dynamo frame and no cudagraph skip. Steps per second of the busy batch."""
    from tlm_model import ModelConfig, compile_for_inference

    # The dry run: one layer, as dynamo's tracing (all of this part's time on a CPU) grows with the layers.
    cfg = ModelConfig.from_preset("course-tinystories") if not dry else ModelConfig(512, 64, 64, 1, 4, 128)
    rows: dict[str, Any] = {}
    with _dry_compile(dry):
        for dtype in (torch.bfloat16, torch.float32):
            rows[str(dtype).removeprefix("torch.")] = _decode_rows(device, cfg, dtype, compile_for_inference)
    torch._dynamo.reset()
    # warm_up_graphs > 0: the counters do see this torch's compiles (else "no new graph" would prove nothing).
    ok = all(r["warm_up_graphs"] > 0 and r["new_frames"] == r["new_graphs"] == r["new_cudagraph_skips"] == 0
             for r in rows.values())  # fmt: skip
    return {"ok": ok, "rows": rows, "compiled_by": "dynamo, eager backend (dry run)" if dry else "inductor"}


@contextlib.contextmanager
def _dry_compile(dry: bool) -> Any:
    """In a dry run, ``compile_for_inference``'s steps compile with dynamo's ``eager`` backend (inductor takes
    minutes on a small CPU): the same dynamo frames, guards and recompiles as on CUDA, without CUDA graphs."""
    if not dry:
        yield
        return
    from tlm_model import inference

    saved = (dict(inference.DECODE_COMPILE_KWARGS), inference.PREFILL_COMPILE_KWARGS)
    inference.DECODE_COMPILE_KWARGS["cpu"] = {"backend": "eager", "fullgraph": True, "dynamic": False}
    inference.PREFILL_COMPILE_KWARGS = {"backend": "eager", "fullgraph": True, "dynamic": None}
    try:
        yield
    finally:
        inference.DECODE_COMPILE_KWARGS.clear()
        inference.DECODE_COMPILE_KWARGS.update(saved[0])
        inference.PREFILL_COMPILE_KWARGS = saved[1]


def _decode_rows(device: torch.device, cfg: Any, dtype: torch.dtype, compile_for_inference: Any) -> dict[str, Any]:
    from tlm_model import TransformerLM
    from tlm_model.batching import DecodeBatch

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TransformerLM(cfg).eval().to(device=device, dtype=dtype)
    fast = compile_for_inference(model)
    batch = DecodeBatch(fast, 2, prefill_chunk=32)
    start, initial = time.perf_counter(), _compile_counts()
    batch.warm_up()
    _sync(device)
    warm_s = time.perf_counter() - start
    before = _compile_counts()
    gen = torch.Generator().manual_seed(1)
    steps, start = 0, time.perf_counter()
    with torch.no_grad():
        for length in (3, 29, 1, 17, 60):
            while len(batch) >= 2:
                batch.remove(0)
            batch.add(torch.randint(1, cfg.vocab_size, (length,), generator=gen))
            tokens = torch.zeros(len(batch), dtype=torch.int64, device=device)
            for _ in range(min(24, batch.capacity - max(batch.lengths) - 1)):
                tokens = batch.step(tokens).argmax(-1)
                steps += 1
    _sync(device)
    seconds = time.perf_counter() - start
    after = _compile_counts()
    return {
        "warm_up_s": warm_s, "steps": steps, "steps_per_s": steps / seconds,
        "warm_up_graphs": before["unique_graphs"] - initial["unique_graphs"],
        "new_frames": after["frames"] - before["frames"],
        "new_graphs": after["unique_graphs"] - before["unique_graphs"],
        "new_cudagraph_skips": after["cudagraph_skips"] - before["cudagraph_skips"],
    }  # fmt: skip


def part_decode_hf(device: torch.device, dry: bool, out: pathlib.Path) -> dict[str, Any]:
    """Greedy decode tokens/s at batch 1 and 64 (issue 34, item 7): tlm's ``generate`` on
    ``compile_for_inference`` (static caches, the decode step under CUDA graphs) against HF's ``generate`` with
    ``cache_implementation="static"`` and ``forward`` compiled with ``mode="reduce-overhead"`` (transformers'
    documented fast path), the same float32 weights (course-tinystories), prompts of 16 tokens, 64 new ones;
    rounds alternate; how many rows' tokens are equal is reported (float32: rounding alone may flip a near tie)."""
    import transformers

    from tlm_model import ModelConfig, TransformerLM, compile_for_inference, generate
    from tlm_model.interop import hf_llama_config_kwargs, to_hf_llama_state_dict

    cfg = ModelConfig.from_preset("course-tinystories") if not dry else ModelConfig(512, 128, 64, 2, 4, 128)
    new, rounds = (64, 5) if not dry else (8, 2)
    torch.manual_seed(0)
    ours = TransformerLM(cfg).eval().to(device)
    hf_config = transformers.LlamaConfig(**hf_llama_config_kwargs(cfg), attn_implementation="sdpa")
    hf = transformers.LlamaForCausalLM(hf_config).to(device).eval()
    hf.load_state_dict(to_hf_llama_state_dict(ours.state_dict(), cfg))
    hf.generation_config.pad_token_id = 0
    # The dry run checks this script on a CPU, where compiling would take minutes: eager on both sides there.
    fast = compile_for_inference(ours) if not dry else ours
    if not dry:
        hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
    rows = []
    for batch in (1, 64):
        gen = torch.Generator().manual_seed(batch)
        prompts = torch.randint(1, cfg.vocab_size, (batch, 16), generator=gen).to(device)

        def tlm(prompts: torch.Tensor = prompts) -> torch.Tensor:
            return generate(fast, prompts, new, temperature=0)[:, 16:]

        def reference(prompts: torch.Tensor = prompts) -> torch.Tensor:
            kwargs = {"cache_implementation": "static"} if not dry else {}
            with torch.no_grad():
                out = hf.generate(prompts, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kwargs)
            return out[:, 16:]

        compile_s = {}
        for name, fn in (("tlm", tlm), ("hf", reference)):
            start = time.perf_counter()
            fn(), fn()  # compiles (and records CUDA graphs) outside the timings
            _sync(device)
            compile_s[name] = time.perf_counter() - start
        equal_rows = int((tlm() == reference()).all(dim=1).sum())
        times: dict[str, list[float]] = {"tlm": [], "hf": []}
        for _ in range(rounds):
            for name, fn in (("tlm", tlm), ("hf", reference)):
                _sync(device)
                start = time.perf_counter()
                fn()
                _sync(device)
                times[name].append(time.perf_counter() - start)
        ratios = sorted(h / t for t, h in zip(times["tlm"], times["hf"], strict=True))
        rows.append({
            "batch": batch, "new_tokens": new, "compile_and_warmup_s": compile_s, "equal_rows": equal_rows,
            "tlm_tokens_per_s": batch * new / statistics.median(times["tlm"]),
            "hf_tokens_per_s": batch * new / statistics.median(times["hf"]),
            "speedup_vs_hf": [statistics.median(ratios), ratios[0], ratios[-1]],
        })  # fmt: skip
        torch._dynamo.reset()
    return {"ok": True, "rows": rows}


# --------------------------------------------------------------------------------------- resume, nan


def _tokens(folder: pathlib.Path, vocab: int) -> pathlib.Path:
    path = folder / "tokens.npy"
    rng = np.random.default_rng(0)
    np.save(path, np.tile(rng.integers(0, vocab, 997), 60).astype(np.uint16))
    return path


def _settings(device: torch.device, tokens: pathlib.Path, out: pathlib.Path, **changes: Any) -> dict[str, Any]:
    model = {"context_length": 128, "d_model": 256, "num_layers": 4, "num_heads": 8, "d_ff": 704}
    if device.type == "cpu":  # the dry run: the same steps on a model a slow CPU trains in seconds
        model = {"context_length": 32, "d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 64}
        changes = {"batch_size": 4, **changes}
    return {"out_dir": str(out), "data": [str(tokens)], "vocab_size": 512, "batch_size": 16, "steps": 12,
            "warmup_steps": 2, "eval_interval": 6, "eval_batches": 2, "log_interval": 3, "checkpoint_interval": 6,
            "keep_checkpoints": 5, "sample_tokens": 0, "device": str(device), "model": model,
            **changes}  # fmt: skip


def part_resume(device: torch.device, dry: bool, out: pathlib.Path) -> dict[str, Any]:
    from tlm_artifacts.steps import read_model_state
    from tlm_train import RunDir, TrainConfig, train
    from tlm_train.metrics import TIMING_FIELDS

    rows = {}
    for dtype in ("bfloat16", "float32"):
        with tempfile.TemporaryDirectory(prefix="tlm-gpu-resume-") as tmp:
            folder = pathlib.Path(tmp)
            tokens = _tokens(folder, 512)
            whole, again = folder / "whole", folder / "again"
            start = time.perf_counter()
            train(TrainConfig(**_settings(device, tokens, whole, dtype=dtype)))
            # The same run as if killed after its step-6 checkpoint, resumed from there to step 12.
            shutil.copytree(whole, again)
            train(TrainConfig(**_settings(device, tokens, again, dtype=dtype)), resume_from=6)
            a = read_model_state(RunDir(whole).checkpoints().path(12))[1]
            b = read_model_state(RunDir(again).checkpoints().path(12))[1]
            differ = [k for k in a if not torch.equal(a[k], b[k])]

            def metrics(run: pathlib.Path) -> list[dict]:
                lines = (run / "metrics.jsonl").read_text().splitlines()
                return [{k: v for k, v in json.loads(x).items() if k not in TIMING_FIELDS} for x in lines]

            rows[dtype] = {"bit_identical_weights": not differ, "differing_tensors": differ[:5],
                           "identical_metrics": metrics(whole) == metrics(again),
                           "seconds": time.perf_counter() - start}  # fmt: skip
    return {"ok": all(r["bit_identical_weights"] and r["identical_metrics"] for r in rows.values()), "rows": rows}


def part_nan(device: torch.device, dry: bool, out: pathlib.Path) -> dict[str, Any]:
    import tlm_train.step as step_module
    from tlm_train import NonFiniteLossError, RunDir, TrainConfig, init_distributed
    from tlm_train.checkpoint import capture_state
    from tlm_train.recipe import Recipe

    original, calls = step_module.LanguageModelLoss.forward, []

    def forward(self, inputs, targets):  # type: ignore[no-untyped-def]
        loss = original(self, inputs, targets)
        if torch.is_grad_enabled():
            calls.append(1)
            if len(calls) == 8:
                return loss * float("nan")
        return loss

    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tlm-gpu-nan-") as tmp:
        folder = pathlib.Path(tmp)
        tokens = _tokens(folder, 512)
        settings = _settings(device, tokens, folder / "run", dtype="bfloat16", log_interval=5, eval_interval=100,
                             checkpoint_interval=7)  # fmt: skip
        step_module.LanguageModelLoss.forward = forward  # type: ignore[method-assign]
        try:
            with Recipe(TrainConfig(**settings), init_distributed(str(device))) as recipe:
                try:
                    recipe.run()
                    result["raised"] = None
                except NonFiniteLossError as err:
                    result["raised"] = str(err)
                now = capture_state(recipe.model, recipe.optimizer, step=7, scheduler=recipe.scheduler)
        finally:
            step_module.LanguageModelLoss.forward = original  # type: ignore[method-assign]
        manager = RunDir(folder / "run").checkpoints()
        saved = manager.load(7).state

        def same(x: Any, y: Any) -> bool:
            if isinstance(x, dict):
                return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
            if isinstance(x, (list, tuple)):
                return len(x) == len(y) and all(same(p, q) for p, q in zip(x, y, strict=True))
            if isinstance(x, torch.Tensor):
                return torch.equal(x.cpu(), y.cpu())
            return x == y

        records = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
        alive = float((torch.ones(4, device=device) * 2).sum())  # the CUDA context still works
        result.update({
            "steps_run": len(calls), "checkpoints": manager.steps(), "last_record": records[-1],
            "state_equals_step_7_checkpoint": all(same(now[p], saved[p]) for p in ("model", "optimizer", "scheduler")),
            "cuda_alive": alive == 8.0,
        })  # fmt: skip
    result["ok"] = bool(
        result["raised"] and result["raised"].startswith("step 8: training loss is nan")
        and result["steps_run"] == 10 and result["last_record"].get("event") == "diverged"
        and result["state_equals_step_7_checkpoint"] and result["cuda_alive"]
    )  # fmt: skip
    return result


def part_stall(device: torch.device, dry: bool, out: pathlib.Path) -> dict[str, Any]:
    """bench/checkpoint_stall.py on this device: the step after a save, inline vs the background writer."""
    target = out / "stall.json"
    preset = "tiny" if dry else "gpt2-small"
    cmd = [sys.executable, str(ROOT / "bench" / "checkpoint_stall.py"), "--device", str(device), "--preset", preset,
           "--print-only", "--json", str(target)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": _pythonpath()}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400, check=False)
    if done.returncode or not target.exists():
        return {"ok": False, "error": done.stderr[-1500:]}
    result = json.loads(target.read_text())
    return {"ok": True, "preset": preset, **result}


# --------------------------------------------------------------------------------------- report


def render(report: dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [
        "## GPU check (`bench/gpu.py`, `nox -s gpu`)",
        "",
        f"Measured {meta['date']} on {meta['device']} ({meta['driver']}); torch {meta['torch']}, "
        f"transformers {meta['transformers']}, python {meta['python']}. Total {meta['seconds']:.0f} s. What each "
        "GPU claim rests on, and what has not run here: [gpu.md](gpu.md).",
        "",
    ]
    parts = report["parts"]
    lines += ["| part | result | seconds |", "| --- | --- | ---: |"]
    for name in PARTS:
        if name in parts:
            p = parts[name]
            verdict = "pass" if p.get("ok") else ("error: " + p["error"][:120] if "error" in p else "FAIL")
            if "skipped" in p:
                verdict = "skipped: " + p["skipped"]
            lines.append(f"| {name} | {verdict} | {p.get('part_seconds', 0):.0f} |")
    bench = parts.get("bench", {})
    if bench.get("rows"):
        lines += [
            "",
            f"bf16 training step, both compiled, MFU against {bench['peak_flops'] / 1e12:,.1f} TFLOP/s "
            f"({bench['peak_source']}). tlm: `train_step` (blocks compiled in place, chunked head, fused AdamW); "
            "HF: `torch.compile(LlamaForCausalLM)`, full logits, torch fused AdamW. Each step ends as a logging "
            "step does (a loss read every 6th step); rounds alternate.",
            "",
            "| shape | tlm ms/step | HF ms/step | tlm ÷ HF speed (median, range) | tlm tokens/s | tlm MFU | HF MFU |"
            " tlm / HF peak GiB |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for row in bench["rows"]:
            s = row["speedup_vs_hf"]
            mem = row.get("memory_gib", {})
            if s is None:
                lines.append(
                    f"| {row['label']} | {row['tlm']['step_ms']:.1f} | HF failed: {row['hf_error'][:80]} | "
                    f"| {row['tlm']['tokens_per_s']:,.0f} | {100 * row['tlm']['mfu']:.1f}% | | |"
                )
                continue
            lines.append(
                f"| {row['label']} | {row['tlm']['step_ms']:.1f} | {row['hf']['step_ms']:.1f} | "
                f"**{s[0]:.2f}×** ({s[1]:.2f}–{s[2]:.2f}) | {row['tlm']['tokens_per_s']:,.0f} | "
                f"{100 * row['tlm']['mfu']:.1f}% | {100 * row['hf']['mfu']:.1f}% | "
                f"{mem.get('tlm', float('nan')):.1f} / {mem.get('hf', float('nan')):.1f} |"
            )
    chunk = parts.get("chunk", {})
    if chunk.get("rows"):
        lines += ["", f"Chunked head + loss, forward and backward under bf16 autocast, {chunk['tokens']:,} tokens, "
                  f"vocab {chunk['vocab']:,}, d_model {chunk['d_model']} (default chunk here: {chunk['default']}):", "",
                  "| chunk | ms | peak MiB |", "| ---: | ---: | ---: |"]  # fmt: skip
        for size, r in chunk["rows"].items():
            lines.append(f"| {size} | {r['ms']:.2f} | {r['peak_mib']:,.0f} |")
    resume = parts.get("resume", {})
    if resume.get("rows"):
        lines += [""] + [
            f"- resume on CUDA, {dtype}: weights bit-identical {r['bit_identical_weights']}, metrics identical "
            f"{r['identical_metrics']}" for dtype, r in resume["rows"].items()
        ]  # fmt: skip
    nan = parts.get("nan", {})
    if "raised" in nan:
        lines.append(
            f"- NaN injected at step 8 on CUDA: stopped with `{(nan['raised'] or 'nothing')[:90]}...` after "
            f"{nan['steps_run']} steps; state equals the step-7 checkpoint: {nan['state_equals_step_7_checkpoint']}; "
            f"CUDA context alive: {nan['cuda_alive']}"
        )
    stall = parts.get("stall", {})
    if stall.get("rows"):
        lines.append(
            f"- checkpoint stall on this device ({stall['preset']} preset, batch 2): "
            + "; ".join(
                f"{mode}: step {r['step_s']:.3f} s, after a save {', '.join(f'{t:.3f}' for t in r['after_save_s'])} s"
                for mode, r in stall["rows"].items()
            )
        )
    syncs = parts.get("syncs", {})
    if "train_step" in syncs:
        lines.append(
            '- `torch.cuda.set_sync_debug_mode("error")`: bf16 `train_step` (after the first): '
            f"{syncs['train_step']}; `DecodeBatch.step`: {syncs['decode_step']}"
        )
    compiled = parts.get("decode", {})
    if compiled.get("rows"):
        lines.append(
            "- `DecodeBatch` on `compile_for_inference` after `warm_up` (rows joining, decoding, leaving): "
            + "; ".join(
                f"{dtype}: {r['steps_per_s']:,.0f} steps/s, {r['new_graphs']} new graphs and {r['new_frames']} new "
                f"frames, {r['new_cudagraph_skips']} cudagraph skips (warm-up {r['warm_up_s']:.0f} s, "
                f"{r.get('warm_up_graphs', '?')} graphs)"
                for dtype, r in compiled["rows"].items()
            )
        )
    decode = parts.get("decode_hf", {})
    if decode.get("rows"):
        lines.append(
            "- greedy decoding, float32, tlm `generate` on `compile_for_inference` (CUDA graphs) vs HF `generate` "
            "(static cache, `forward` compiled with reduce-overhead): "
            + "; ".join(
                f"batch {r['batch']}: {r['tlm_tokens_per_s']:,.0f} vs {r['hf_tokens_per_s']:,.0f} tokens/s, "
                f"**{r['speedup_vs_hf'][0]:.2f}×** ({r['speedup_vs_hf'][1]:.2f}–{r['speedup_vs_hf'][2]:.2f}), "
                f"{r['equal_rows']}/{r['batch']} rows' tokens equal"
                for r in decode["rows"]
            )
        )
    tests = parts.get("tests", {})
    if "passed" in tests:
        lines.append(
            f"- CUDA test leg (tests taking the `device` fixture): {tests['passed']} passed, {tests['failed']} "
            f"failed, {tests['skipped']} skipped; {len(tests['not_collected'])} modules not collected (a package "
            "this python lacks)"
        )
    census = parts.get("census", {})
    if "calls" in census:
        lines.append(f"- dtype census of a bf16 step on this device: {census['calls']}")
    return "\n".join(lines) + "\n"


def _features() -> dict[str, bool]:
    """Which of the newer torch APIs tlm detects this torch has (each has a fallback; see ARCHITECTURE.md)."""
    import importlib.util

    from tlm_attention.documents import flex_kernel_options

    staging = importlib.util.find_spec("torch.distributed.checkpoint.staging")
    try:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        process = hasattr(AsyncCheckpointerType, "PROCESS")
    except ImportError:
        process = False
    return {
        "torch.compiler.skip_guard_on_all_nn_modules_unsafe": hasattr(torch.compiler,
                                                                      "skip_guard_on_all_nn_modules_unsafe"),
        "torch.distributed.checkpoint.staging.DefaultStager": staging is not None and hasattr(
            importlib.import_module("torch.distributed.checkpoint.staging"), "DefaultStager"),
        "AsyncCheckpointerType.PROCESS": process,
        "FlexKernelOptions BACKEND": bool(flex_kernel_options()),
    }  # fmt: skip


def _write(out: pathlib.Path, report: dict[str, Any]) -> None:
    """``gpu.json`` and ``gpu.md`` as they stand, each replaced whole (a kill mid-write leaves the previous one)."""
    for name, text in (("gpu.json", json.dumps(report, indent=1, default=str)), ("gpu.md", render(report))):
        temporary = out / f".{name}.tmp"
        temporary.write_text(text)
        os.replace(temporary, out / name)


def on_deadline(report: dict[str, Any], out: pathlib.Path, deadline: float, exit: Callable[[int], Any]) -> None:
    """The watchdog's end (a timer thread calls it at ``deadline`` seconds): the part still running is recorded
    as killed there (a hang, or a part far past its estimate), the results so far are written, and ``exit(3)``
    (``os._exit``: the hung part's thread cannot be interrupted) ends the check within its 8 minutes."""
    name = report.get("running")
    try:
        if name is not None:
            since = report.pop("running_since", 0.0)
            error = f"killed at the {deadline:.0f} s deadline, still running"
            report["parts"][name] = {"ok": False, "error": error, "part_seconds": time.perf_counter() - since}
            report.pop("running", None)
        report["meta"]["deadline_hit"] = True
        _write(out, report)
        print(f"bench/gpu.py: the {deadline:.0f} s deadline passed during {name}; results so far in "
              f"{out / 'gpu.json'}", flush=True)  # fmt: skip
    finally:
        exit(3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--skip", default="", help="comma-separated parts to leave out: " + ",".join(PARTS))
    parser.add_argument("--only", default="", help="comma-separated parts to run (default: all)")
    parser.add_argument("--dry-run", action="store_true", help="every part on the CPU at toy sizes")
    parser.add_argument(
        "--budget",
        type=float,
        default=450.0,
        help="a part that would end (by its estimate) after this many seconds is skipped (default 450: within 8 min)",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="at this many seconds the part still running is recorded as killed and the check ends "
        "(default 470 on CUDA: within 8 min; none in a dry run)",
    )
    args = parser.parse_args()
    out = args.out or pathlib.Path(os.environ.get("OUT") or ROOT / "bench" / "out")
    out.mkdir(parents=True, exist_ok=True)
    if not args.dry_run and not torch.cuda.is_available():
        message = "no CUDA device (torch.cuda.is_available() is False); --dry-run checks the script"
        (out / "gpu.json").write_text(json.dumps({"error": message, "torch": torch.__version__,
                                                  "cuda_build": torch.version.cuda}, indent=1))  # fmt: skip
        print(f"bench/gpu.py: {message}")
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    chosen = [p for p in (args.only.split(",") if args.only else PARTS) if p and p not in args.skip.split(",")]
    try:  # the parts that compare with HF need it (and fail alone without it); the rest do not
        import transformers

        hf_version = transformers.__version__
    except ImportError:
        hf_version = "not installed"
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "CPU (dry run)",
        "driver": f"CUDA {torch.version.cuda}" if device.type == "cuda" else "no CUDA",
        "torch": torch.__version__, "transformers": hf_version,
        "python": sys.version.split()[0], "newer_torch_features": _features(),
    }  # fmt: skip
    report: dict[str, Any] = {"meta": {**meta, "seconds": 0.0}, "parts": {}}
    meta = report["meta"]
    began = time.perf_counter()
    functions: dict[str, Callable[..., dict[str, Any]]] = {
        "tests": part_tests, "syncs": part_syncs, "census": part_census, "chunk": part_chunk, "bench": part_bench,
        "resume": part_resume, "nan": part_nan, "stall": part_stall, "decode": part_decode,
        "decode_hf": part_decode_hf,
    }  # fmt: skip
    deadline = args.deadline if args.deadline is not None else (None if args.dry_run else 470.0)
    if deadline is not None:
        import threading

        watchdog = threading.Timer(deadline - (time.perf_counter() - began), on_deadline,
                                   (report, out, deadline, os._exit))  # fmt: skip
        watchdog.daemon = True
        watchdog.start()
    for name in chosen:
        start = time.perf_counter()
        if start - began + (0 if args.dry_run else ESTIMATE_S[name]) > args.budget:
            report["parts"][name] = {"ok": True, "skipped": f"not begun: {start - began:.0f} s had passed and it takes "
                                     f"about {ESTIMATE_S[name]} s (--budget {args.budget:.0f})"}  # fmt: skip
            continue
        print(f"== {name} ...", flush=True)
        report["running"], report["running_since"] = name, start  # what a kill or the deadline interrupted
        _write(out, report)
        try:
            result = functions[name](device, args.dry_run, out)
        except Exception as err:
            result = {"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
        result["part_seconds"] = time.perf_counter() - start
        report.pop("running", None)
        report.pop("running_since", None)
        report["parts"][name] = result
        print(json.dumps({name: result}, default=str)[:3000], flush=True)
        meta["seconds"] = time.perf_counter() - began
        _write(out, report)
    meta["seconds"] = time.perf_counter() - began
    _write(out, report)
    text = render(report)
    if not args.dry_run:
        from _common import write_section

        write_section("gpu", text)
    print(text)
    return 0 if all(p.get("ok") for p in report["parts"].values()) else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
