"""The run folder's layout and the vocabulary growth of a fine-tune, tested here where they are defined (they were
exercised only through tlm-train's tests): names, what makes a run folder and a complete step, the ``latest``
pointer at its boundaries, and ``grown`` against transformers' mean resizing written out by hand."""

import os

import pytest
import torch

from tlm_artifacts.layout import RunFolder, step_name
from tlm_artifacts.lora import grown
from tlm_artifacts.steps import StepFolders, is_complete, step_of


def test_the_run_folder_names_are_the_documented_ones(tmp_path):
    run = RunFolder(tmp_path / "run")
    assert (run.config_path, run.tokenizer_dir, run.data_dir, run.checkpoints_dir, run.metrics_path) == (
        tmp_path / "run" / "train.toml", tmp_path / "run" / "tokenizer", tmp_path / "run" / "data",
        tmp_path / "run" / "checkpoints", tmp_path / "run" / "metrics.jsonl")  # fmt: skip
    assert repr(run) == f"RunFolder({str(tmp_path / 'run')!r})"
    assert not RunFolder.is_run(tmp_path / "run")  # missing
    (tmp_path / "run").mkdir()
    assert not RunFolder.is_run(tmp_path / "run")  # an empty folder is no run
    (tmp_path / "run" / "train.toml").mkdir()
    assert not RunFolder.is_run(tmp_path / "run")  # train.toml must be a file
    (tmp_path / "run" / "train.toml").rmdir()
    (tmp_path / "run" / "train.toml").write_text("")
    assert RunFolder.is_run(tmp_path / "run")
    (tmp_path / "other" / "checkpoints").mkdir(parents=True)
    assert RunFolder.is_run(tmp_path / "other")  # checkpoints/ alone is enough
    (tmp_path / "file").write_text("")
    assert not RunFolder.is_run(tmp_path / "file")
    assert not run.has_tokenizer() and run.tokenizer() is None


@pytest.mark.parametrize(("step", "name"), [(0, "step_00000000"), (1, "step_00000001"), (99_999_999, "step_99999999"),
                                            (100_000_000, "step_100000000")])  # fmt: skip
def test_a_step_folder_name_has_at_least_eight_digits_and_reads_back(tmp_path, step, name):
    assert step_name(step) == name and step_of(tmp_path / name) == step
    for other in ("step_1234567", "step_", "step_0000000x", "Step_00000001", "step_00000001.tmp"):
        assert step_of(tmp_path / other) is None, other


def test_a_step_is_complete_with_its_state_and_one_model_file(tmp_path):
    folder = tmp_path / "step_00000001"
    folder.mkdir()
    assert not is_complete(folder)
    (folder / "model.safetensors").write_bytes(b"")
    assert not is_complete(folder)  # no train_state.pt
    (folder / "train_state.pt").write_bytes(b"")
    assert is_complete(folder)
    for other in ("adapter.safetensors", "shards/.metadata"):
        (folder / "model.safetensors").unlink(missing_ok=True)
        (folder / "shards").mkdir(exist_ok=True)
        assert not is_complete(folder)
        (folder / other).write_bytes(b"")
        assert is_complete(folder)
        (folder / other).unlink()


def test_latest_joins_the_listing_and_a_stale_or_odd_pointer_is_ignored(tmp_path):
    folders = StepFolders(tmp_path)

    def complete(step):
        folders.path(step).mkdir()
        (folders.path(step) / "train_state.pt").write_bytes(b"")
        (folders.path(step) / "model.safetensors").write_bytes(b"")

    assert folders.steps() == []
    complete(1)
    complete(3)
    (tmp_path / "step_00000002").mkdir()  # incomplete: not a step
    assert folders.steps() == [1, 3]
    for pointer in ("step_00000003\n", "step_00000009", "garbage", "", "step_3", "step_00000003" + " " * 300):
        (tmp_path / "latest").write_text(pointer)
        assert folders.steps() == [1, 3], pointer
    # A listing that missed step 3 (renamed in while it was read): the pointer, read after it, brings it back.
    folders._listed = lambda: [1]  # type: ignore[method-assign]
    (tmp_path / "latest").write_text("step_00000003\n")
    assert folders.steps() == [1, 3]
    (tmp_path / "latest").write_text("step_00000002\n")  # names an incomplete folder: not a step
    assert folders.steps() == [1]
    (tmp_path / "latest").write_text("step_00000003" + " " * 300)  # over 256 bytes: no pointer, however it ends
    assert folders.steps() == [1]
    (tmp_path / "latest").write_text("step_00000003" + " " * 200)  # within the bound: read
    assert folders.steps() == [1, 3]
    for size, read in ((256, [1, 3]), (257, [1])):  # the bound itself is read; one byte more is not
        (tmp_path / "latest").write_text("step_00000003".ljust(size))
        assert folders.steps() == read, size
    (tmp_path / "latest").unlink()
    os.mkfifo(tmp_path / "latest")  # a FIFO is no pointer, and never waited on
    assert folders.steps() == [1]


@pytest.mark.parametrize("extra", [0, 1, 3])
def test_grown_adds_rows_that_are_the_mean_of_the_old_ones(extra):
    torch.manual_seed(0)
    table, head, other = torch.randn(5, 4), torch.randn(5, 4), torch.randn(2, 2)
    weights = {"token_embeddings.weight": table, "lm_head.weight": head, "layers.0.x": other}
    out = grown(weights, 5 + extra)
    assert out["layers.0.x"] is other and weights["token_embeddings.weight"] is table  # the input is not changed
    for name, old in (("token_embeddings.weight", table), ("lm_head.weight", head)):
        assert out[name].shape == (5 + extra, 4)
        assert torch.equal(out[name][:5], old)
        mean = old.double().sum(0) / 5  # transformers' resize_token_embeddings(mean_resizing=True), by hand
        for row in range(5, 5 + extra):
            torch.testing.assert_close(out[name][row].double(), mean, rtol=0, atol=1e-6)
    assert grown(weights, 4)["lm_head.weight"] is head  # never shrinks
    assert grown({"token_embeddings.weight": table}, 7)["token_embeddings.weight"].shape == (7, 4)  # tied: no head
