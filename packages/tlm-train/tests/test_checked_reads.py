"""Every file tlm-train reads goes through tlm_core's checked open: a FIFO (which a plain ``open`` waits on for
ever) or a folder in place of a config, a metrics log, a chat template, a data file or a run's own data files is
one ValueError naming what it is and the path."""

import json
import os

import numpy as np
import pytest

from tlm_train import MetricsLog, RunDir, TrainConfig
from tlm_train.data import file_identity, prepare_data
from tlm_train.recipe import _check_chat_template, data_settings

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_training_config_that_is_not_a_file_is_refused(tmp_path, kind, not_a_file):
    path = not_a_file.plant(tmp_path / "train.toml", kind)
    not_a_file.refused(lambda: TrainConfig.from_toml(path), "training config", path, kind)
    not_a_file.refused(lambda: RunDir(tmp_path).read_config(), "training config", path, kind)


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_metrics_log_that_is_not_a_file_is_refused(tmp_path, kind, not_a_file):
    path = not_a_file.plant(tmp_path / "metrics.jsonl", kind)
    not_a_file.refused(lambda: MetricsLog(path).read(), "metrics log", path, kind)


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_chat_template_that_is_not_a_file_is_refused_by_the_check_and_by_the_encoder(tmp_path, kind, not_a_file):
    path = not_a_file.plant(tmp_path / "template.jinja", kind)
    not_a_file.refused(lambda: _check_chat_template(str(path)), "--chat-template", path, kind)
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"prompt": "q", "completion": "a"}) + "\n", encoding="utf-8")
    run = RunDir(tmp_path / "run")
    config = TrainConfig(data=[str(chat)], out_dir=str(run.path), chat_template=str(path))
    not_a_file.refused(lambda: prepare_data(data_settings(config), run, context_length=32), "--chat-template",
                       path, kind)  # fmt: skip
    assert not (run.path / "data").exists()


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_token_file_is_identified_through_the_checked_open(tmp_path, kind, not_a_file):
    path = not_a_file.plant(tmp_path / "val.npy", kind)
    not_a_file.refused(lambda: file_identity(path, "--val-data"), "--val-data", path, kind)
    np.save(tmp_path / "t.npy", np.arange(5, dtype=np.uint16))
    import hashlib

    data = (tmp_path / "t.npy").read_bytes()
    assert file_identity(tmp_path / "t.npy") == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@pytest.mark.parametrize("kind", ["fifo", "folder"])
@pytest.mark.parametrize("name", ["train.npy", "val.npy"])
def test_a_runs_own_token_files_planted_as_not_files_are_refused(tmp_path, kind, name, not_a_file):
    from tlm_tokenizer import Tokenizer

    text = tmp_path / "t.txt"
    text.write_text("some text\n", encoding="utf-8")
    run = RunDir(tmp_path / "run")
    Tokenizer({i: bytes([i]) for i in range(256)}, []).save(run.tokenizer_dir)
    run.data_dir.mkdir(parents=True)
    for each in ("train.npy", "val.npy"):
        if each != name:
            np.save(run.data_dir / each, np.arange(8, dtype=np.uint16))
    path = not_a_file.plant(run.data_dir / name, kind)
    config = TrainConfig(data=[str(text)], out_dir=str(run.path))
    # Another rank reads what the main rank wrote: nothing is rebuilt, the files are opened as they are.
    not_a_file.refused(lambda: prepare_data(data_settings(config), run, is_main=False), "run token file", path, kind)
