"""Every file tlm-experiments reads goes through tlm_core's checked open: a FIFO (which a plain ``open`` waits
on for ever) or a folder in place of ``--runs``, ``--config``, a sweep manifest, a metrics log, a run's data
file or its token file is one error naming it and the path."""

import os

import numpy as np
import pytest

from tlm_experiments import compare, manifest, sweep

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform"),
    pytest.mark.parametrize("kind", ["fifo", "folder"]),
]


def test_the_runs_file_and_the_base_config(tmp_path, kind, not_a_file):
    path = not_a_file.plant(tmp_path / "runs.toml", kind)
    not_a_file.refused(lambda: sweep._read_runs_file(str(path)), "--runs", path, kind)
    not_a_file.refused(lambda: sweep._base_config(str(path)), "--config", path, kind)


def test_a_sweep_manifest(tmp_path, kind, not_a_file):
    path = not_a_file.plant(tmp_path / manifest.MANIFEST, kind)
    not_a_file.refused(lambda: manifest.read_manifest(tmp_path), "sweep manifest", path, kind)
    not_a_file.refused(lambda: manifest.update_entry(tmp_path, "a", {"status": "done"}), "sweep manifest", path, kind)


def test_a_metrics_log(tmp_path, kind, not_a_file):
    path = not_a_file.plant(tmp_path / "metrics.jsonl", kind)
    not_a_file.refused(lambda: compare.read_metrics(path), "metrics log", path, kind)


def test_a_runs_data_file_and_validation_tokens(tmp_path, kind, not_a_file):
    from tlm_tokenizer import Tokenizer
    from tlm_train import RunDir, TrainConfig

    data = tmp_path / "data.txt"
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.write_config(TrainConfig(data=[str(data)], out_dir=str(run.path)))
    path = not_a_file.plant(data, kind)
    not_a_file.refused(lambda: compare.run_data(run.path, records=[]), "data file", path, kind)
    data.rmdir() if kind == "folder" else data.unlink()
    data.write_text("text\n", encoding="utf-8")
    Tokenizer({i: bytes([i]) for i in range(256)}, []).save(run.tokenizer_dir)
    val = not_a_file.plant(run.data_dir / "val.npy", kind)
    not_a_file.refused(lambda: compare.run_data(run.path, records=[]), "run token file", val, kind)
    val.rmdir() if kind == "folder" else val.unlink()
    np.save(val, np.array([104, 105], dtype=np.uint16))  # "hi": two tokens of one byte each
    found = compare.run_data(run.path, records=[])
    assert found.data is not None and found.tokenizer is not None
    assert found.bpb_per_nat == pytest.approx(2 / (np.log(2) * 2))  # tokens / (ln 2 x bytes)
