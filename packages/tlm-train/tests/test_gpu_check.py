"""``bench/gpu.py`` (``nox -s gpu``), the one prepared GPU check, runs on the CPU with ``--dry-run``: each part that
a CUDA machine runs first (issue 42) runs here at toy sizes, so that the check itself is not what fails when a GPU
is finally lent. What only a GPU shows (sync-debug errors, CUDA graphs, MFU) is not shown here."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "bench" / "gpu.py"


@pytest.mark.slow
def test_the_gpu_checks_dry_run_passes_its_first_parts_on_the_cpu(tmp_path) -> None:
    pytest.importorskip("transformers", reason="bench/gpu.py records the transformers version it ran with")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TLM_TEST_DEVICE": "cpu"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--only", "syncs,resume,nan,decode", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu.json").read_text())
    parts = report["parts"]
    assert list(parts) == ["syncs", "resume", "nan", "decode"]
    assert all(p["ok"] and "skipped" not in p for p in parts.values()), parts
    assert parts["syncs"]["train_step"] == parts["syncs"]["decode_step"] == "no sync"
    assert all(r["bit_identical_weights"] and r["identical_metrics"] for r in parts["resume"]["rows"].values())
    assert set(parts["decode"]["rows"]) == {"bfloat16", "float32"}
    assert parts["decode"]["compiled_by"] == "dynamo, eager backend (dry run)"  # the recompile count is real here
    assert all(r["warm_up_graphs"] > 0 and r["new_graphs"] == 0 for r in parts["decode"]["rows"].values())
    assert "running" not in report  # written before each part, cleared after it
    assert report["meta"]["newer_torch_features"] == {  # torch 2.13 here has them all
        "torch.compiler.skip_guard_on_all_nn_modules_unsafe": True,
        "torch.distributed.checkpoint.staging.DefaultStager": True,
        "AsyncCheckpointerType.PROCESS": True,
        "FlexKernelOptions BACKEND": True,
    }
    assert (tmp_path / "gpu.md").read_text().startswith("## GPU check")


def _load():  # type: ignore[no-untyped-def]
    import importlib.util

    spec = importlib.util.spec_from_file_location("tlm_bench_gpu", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


def test_the_gpu_check_runs_the_unproven_parts_first_within_its_budget() -> None:
    # The order is the value order of issue 42: the CUDA test leg, host syncs, bf16 training vs HF with MFU,
    # bit-exact resume, the NaN stop, compiled decoding; and the estimates of those fit the default budget.
    module = _load()
    first = ["tests", "syncs", "bench", "resume", "nan", "decode"]
    assert module.PARTS[: len(first)] == first
    assert set(module.ESTIMATE_S) == set(module.PARTS)
    assert sum(module.ESTIMATE_S[p] for p in first) <= 480  # 8 minutes


def test_the_dry_runs_stand_in_for_the_sync_debug_error_raises_on_a_value_read() -> None:
    # On CUDA set_sync_debug_mode("error") raises at a synchronising call; the dry run's stand-in raises at a
    # read of a tensor's value, so the part's error path runs on the CPU too; what reads nothing passes.
    import torch

    module = _load()
    with module._sync_errors(torch.device("cpu")):
        total = torch.ones(3).sum() * 2  # no read
    with pytest.raises(RuntimeError, match="synchronizing"), module._sync_errors(torch.device("cpu")):
        total.item()
    with pytest.raises(RuntimeError, match="synchronizing"), module._sync_errors(torch.device("cpu")):
        bool(total > 1)


def test_at_the_deadline_the_part_in_flight_is_recorded_as_killed_and_the_check_ends(tmp_path) -> None:
    # A hung part (a compile that never ends) must not cost the lent device's time and the results before it:
    # the watchdog's handler records it, writes gpu.json and gpu.md whole, and exits with 3.
    import time

    module = _load()
    report = {"meta": {"date": "d", "device": "x", "driver": "y", "torch": "t", "transformers": "t", "python": "p",
                       "seconds": 1.0}, "parts": {"tests": {"ok": True, "part_seconds": 5.0}},
              "running": "syncs", "running_since": time.perf_counter() - 30}  # fmt: skip
    exits = []
    module.on_deadline(report, tmp_path, 470.0, exits.append)
    assert exits == [3]
    written = json.loads((tmp_path / "gpu.json").read_text())
    assert written["parts"]["syncs"]["ok"] is False
    assert written["parts"]["syncs"]["error"] == "killed at the 470 s deadline, still running"
    assert written["parts"]["syncs"]["part_seconds"] >= 30
    assert written["parts"]["tests"]["ok"] and written["meta"]["deadline_hit"] and "running" not in written
    assert "| syncs | error: killed at the 470 s deadline" in (tmp_path / "gpu.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu.json", "gpu.md"]  # no temporary file left


def test_without_cuda_the_check_says_so_in_its_json_and_exits_2(tmp_path, monkeypatch) -> None:
    # A lent machine whose torch sees no GPU (a CPU build, a driver mismatch) still leaves a gpu.json saying why.
    import torch

    module = _load()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["gpu.py", "--out", str(tmp_path)])
    assert module.main() == 2
    written = json.loads((tmp_path / "gpu.json").read_text())
    assert written["error"].startswith("no CUDA device") and written["torch"] == torch.__version__
