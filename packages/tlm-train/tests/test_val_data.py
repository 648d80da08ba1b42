"""``--val-data``: validation from files of their own, of any --data kind; all of --data then trains."""

import json

import numpy as np
import pytest

from tlm_train import RunDir, default_corpus, train


def test_text_validation_files_are_encoded_with_the_runs_tokenizer(tmp_path, make_config):
    text, held = tmp_path / "train.txt", tmp_path / "held.jsonl"
    text.write_text(default_corpus()[:20_000], encoding="utf-8")
    documents = [default_corpus()[30_000:31_000], default_corpus()[40_000:40_500]]
    held.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents), encoding="utf-8")
    train(make_config(data=[str(text)], val_data=[str(held)], vocab_size=300, steps=1))
    run = RunDir(tmp_path / "run")
    tokenizer = run.tokenizer()
    train_ids, val_ids = np.load(run.data_dir / "train.npy"), np.load(run.data_dir / "val.npy")
    assert train_ids.tolist() == tokenizer.encode(text.read_text(encoding="utf-8"))  # every --data token trains
    assert val_ids.tolist() == tokenizer.encode("<|endoftext|>".join(documents))
    info = json.loads((run.data_dir / "info.json").read_text())
    assert (info["train"], info["val"], info["val_sources"]) == (len(train_ids), len(val_ids), [str(held)])


def test_a_token_file_validates_on_a_token_file(tmp_path, make_config, tokens):
    from tlm_model import ModelConfig
    from tlm_train import EvalBatches, TrainConfig, build_model, evaluate

    held = tmp_path / "held.npy"
    np.save(held, np.arange(200, dtype=np.uint16) % 32)
    config = make_config(val_data=[str(held)], steps=1)
    result = train(config)
    # Step 0's validation loss is the initial model's on the held-out file's windows.
    saved = TrainConfig.from_toml(tmp_path / "run" / "train.toml")
    model = build_model(ModelConfig.from_dict(saved.model), "cpu", seed=config.seed)
    batches = EvalBatches(np.load(held), config.batch_size, 16, windows=config.eval_batches * config.batch_size)
    assert result.val_losses[0][1] == pytest.approx(evaluate(model, batches).loss, rel=1e-6)


def test_chat_validation_conversations(tmp_path, make_config):
    def conversations(path, n, word):
        records = [{"prompt": f"{word} {i}", "completion": f"reply {i}"} for i in range(n)]
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")

    conversations(tmp_path / "chat.jsonl", 12, "ask")
    conversations(tmp_path / "held.jsonl", 3, "held")
    train(make_config(data=[str(tmp_path / "chat.jsonl")], val_data=[str(tmp_path / "held.jsonl")], vocab_size=300,
                      steps=1, chat_layout="padded"))  # fmt: skip
    run = RunDir(tmp_path / "run")
    info = json.loads((run.data_dir / "info.json").read_text())
    assert info["chat"]["examples"] == 15 and len(np.load(run.data_dir / "val.npy")) == 3 * 17  # rows of context + 1
    val = np.load(run.data_dir / "val.npy")
    assert "held 0" in run.tokenizer().decode(np.where(val < 0, -1 - val, val)[:17].tolist())


@pytest.mark.parametrize(
    ("val", "message"),
    [("missing.txt", "--val-data .*missing.txt: no such file"), ("held.txt", "--val-data must be one token file")],
)
def test_bad_validation_files_are_refused(tmp_path, make_config, val, message):
    (tmp_path / "held.txt").write_text("text", encoding="utf-8")
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        train(make_config(val_data=[str(tmp_path / val)]))


def test_a_validation_token_file_changed_before_a_resume_is_refused(tmp_path, make_config):
    held = tmp_path / "held.npy"
    np.save(held, np.arange(200, dtype=np.uint16) % 32)
    config = make_config(val_data=[str(held)], steps=1)
    train(config)
    np.save(held, np.arange(200, dtype=np.uint16) % 31)
    with pytest.raises(ValueError, match=r"--val-data .*held.npy changed since the run started"):
        train(config.replace(steps=2), resume=True)


@pytest.mark.parametrize("kind", ["token file", "text"])
def test_a_validation_file_added_on_resume_is_refused_and_the_run_left_as_it_was(tmp_path, make_config, kind):
    """--val-data is one of FIXED_ON_RESUME: a run validates on what it started with, so a file given only when
    it resumes is refused in one line naming the flag, before the run's data or checkpoints change (the token
    file's identity check, which takes a validation file only once recorded, is never reached)."""
    from tlm_train.recipe import ResumeError

    if kind == "token file":
        held = tmp_path / "held.npy"
        np.save(held, np.arange(200, dtype=np.uint16) % 32)
        config = make_config(steps=1)
    else:
        text, held = tmp_path / "train.txt", tmp_path / "held.txt"
        text.write_text(default_corpus()[:20_000], encoding="utf-8")
        held.write_text(default_corpus()[30_000:31_000], encoding="utf-8")
        config = make_config(data=[str(text)], vocab_size=300, steps=1)
    train(config)
    run = RunDir(tmp_path / "run")
    before = {p.relative_to(run.path): p.read_bytes() for p in run.path.rglob("*") if p.is_file()}
    with pytest.raises(ResumeError) as info:
        train(config.replace(val_data=[str(held)], steps=2), resume=True)
    assert str(info.value) == (
        f"--resume {run.path}: --val-data {[str(held)]!r} differs from the run's []; a run keeps its model, data, "
        "tokenizer and seed (start a new run with --init-from to fine-tune it)"
    )
    after = {p.relative_to(run.path): p.read_bytes() for p in run.path.rglob("*") if p.is_file()}
    assert after == before
    assert "val_token_file" not in json.loads((run.data_dir / "info.json").read_text())
