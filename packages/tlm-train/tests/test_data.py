"""A run's data: the default corpus, text encoded once into RUN/data, token files checked."""

import json
import re

import numpy as np
import pytest

from tlm_train import RunDir, TrainConfig, default_corpus
from tlm_train.data import check_data_paths, prepare_data
from tlm_train.recipe import data_settings


def test_default_corpus_needs_no_download() -> None:
    text = default_corpus()
    assert len(text) > 300_000 and text.count("<|endoftext|>") > 50


def test_text_is_encoded_once_with_the_tokenizer_trained_here(tmp_path) -> None:
    text = tmp_path / "t.txt"
    text.write_text(default_corpus()[:20_000], encoding="utf-8")
    config = TrainConfig(data=[str(text)], vocab_size=300, out_dir=str(tmp_path / "run"))
    run = RunDir(tmp_path / "run")
    data = prepare_data(data_settings(config), run)
    tokens = np.concatenate([data.train, data.val])
    assert data.tokenizer.decode(tokens.tolist()) == text.read_text()
    assert len(data.val) == round(len(tokens) * 0.1) and data.vocab_size == 300
    before = (run.data_dir / "train.npy").stat().st_mtime_ns
    prepare_data(data_settings(config), run)  # a resumed run reads what is there
    assert (run.data_dir / "train.npy").stat().st_mtime_ns == before


def test_data_paths_are_checked(tmp_path) -> None:
    (tmp_path / "a.npy").write_bytes(b"")
    (tmp_path / "b.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="--data /nonexistent: no such file"):
        check_data_paths(["/nonexistent"])
    with pytest.raises(ValueError, match="text files, or one token-id file"):
        check_data_paths([str(tmp_path / "a.npy"), str(tmp_path / "b.txt")])
    check_data_paths([str(tmp_path / "b.txt"), str(tmp_path / "b.txt")])


@pytest.mark.parametrize(
    ("array", "message"),
    [
        (np.zeros((4, 4), dtype=np.uint16), "must hold a 1-D array of integer token ids"),
        (np.zeros(10, dtype=np.float32), "must hold a 1-D array of integer token ids"),
        (np.array([1, 2, 99], dtype=np.int64), r"holds token ids in \[1, 99\], outside \[0, 32\)"),
        (np.array([-1, 2, 3], dtype=np.int64), r"holds token ids in \[-1, 3\]"),
    ],
)
def test_token_files_must_hold_ids_of_the_vocabulary(tmp_path, array, message) -> None:
    np.save(tmp_path / "t.npy", array)
    config = TrainConfig(data=[str(tmp_path / "t.npy")], vocab_size=32)
    with pytest.raises(ValueError, match=message):
        prepare_data(data_settings(config), RunDir(tmp_path / "run"))


def test_a_pickled_npy_is_refused(tmp_path) -> None:
    np.save(tmp_path / "t.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="is not a readable .npy file"):
        prepare_data(data_settings(TrainConfig(data=[str(tmp_path / "t.npy")])), RunDir(tmp_path / "run"))


@pytest.mark.parametrize("raw", [b"", b"\x01\x00\x02"])
def test_a_raw_token_file_of_no_whole_ids_is_refused_naming_it(tmp_path, raw) -> None:
    path = tmp_path / "t.bin"
    path.write_bytes(raw)
    message = f"--data {path} holds {len(raw)} bytes, not a whole, non-zero number of uint16 ids"
    with pytest.raises(ValueError, match=re.escape(message)):
        prepare_data(data_settings(TrainConfig(data=[str(path)])), RunDir(tmp_path / "run"))


def test_a_token_file_changed_in_place_is_refused_on_resume(tmp_path, make_config, tokens, snapshot) -> None:
    import hashlib
    import json

    from tlm_train import train

    original = tokens.read_bytes()
    train(make_config(steps=2))
    run = tmp_path / "run"
    recorded = json.loads((run / "data" / "info.json").read_text())["token_file"]
    assert recorded == {"path": str(tokens), "bytes": len(original), "sha256": hashlib.sha256(original).hexdigest()}
    ids = np.load(tokens)
    np.save(tokens, np.roll(ids, 1))  # same path, length, dtype and id range; other tokens
    assert tokens.stat().st_size == len(original) and tokens.read_bytes() != original
    before = snapshot(run)
    with pytest.raises(ValueError, match=rf"^--data {tokens} changed since the run started \({len(original)} bytes"):
        train(make_config(steps=3), resume=True)
    assert snapshot(run) == before


@pytest.mark.parametrize("is_main", [True, False], ids=["main rank", "other rank"])
def test_only_the_main_rank_writes_the_given_tokenizer_into_the_run(tmp_path, tokens, is_main) -> None:
    # The docstring: the main rank writes into the run folder; the others read what it wrote.
    from tlm_tokenizer import Tokenizer

    tokenizer = Tokenizer({i: bytes([i]) for i in range(256)}, [])
    run = RunDir(tmp_path / "run")
    data = prepare_data(data_settings(TrainConfig(data=[str(tokens)])), run, tokenizer=tokenizer, is_main=is_main)
    assert data.tokenizer is tokenizer and data.vocab_size == 256
    assert run.has_tokenizer() == is_main


def test_without_max_data_bytes_the_corpus_may_take_half_the_free_disk(tmp_path, monkeypatch) -> None:
    import shutil
    from collections import namedtuple

    text = tmp_path / "t.txt"
    text.write_text("x" * 1000, encoding="utf-8")
    usage = namedtuple("usage", "total used free")
    seen = []

    def disk_usage(path):
        seen.append(str(path))
        return usage(10**12, 0, 1999)  # 1,999 bytes free: half, rounded down, is 999 < 1,000

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    run = RunDir(tmp_path / "run")
    with pytest.raises(ValueError, match=r"t\.txt: the corpus passed --max-data-bytes 999 "):
        prepare_data(data_settings(TrainConfig(data=[str(text)], out_dir=str(run.path))), run)
    assert seen == [str(run.path)]  # the run folder's disk, where the corpus is written
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 0, 2000))
    with pytest.raises(ValueError, match="--data holds 1 tokens"):  # 1,000 bytes fit; too few tokens is next
        prepare_data(data_settings(TrainConfig(data=[str(text)], out_dir=str(run.path), vocab_size=300)), run)


def _chat_file(tmp_path):
    path = tmp_path / "chat.jsonl"
    records = [{"prompt": f"question {i}", "completion": f"answer {i}"} for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_an_unreadable_chat_template_is_one_error_naming_it(tmp_path) -> None:
    run = RunDir(tmp_path / "run")
    config = TrainConfig(data=[str(_chat_file(tmp_path))], out_dir=str(run.path), chat_template=str(tmp_path / "no"))
    with pytest.raises(ValueError, match=rf"^--chat-template {tmp_path / 'no'}: cannot read it \("):
        prepare_data(data_settings(config), run, context_length=32)


def test_a_given_tokenizer_gains_the_chat_markers_and_keeps_the_template(tmp_path) -> None:
    from tlm_tokenizer import Tokenizer
    from tlm_tokenizer.chat import CHAT_MARKERS, CHATML_TEMPLATE

    given = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    run = RunDir(tmp_path / "run")
    config = TrainConfig(data=[str(_chat_file(tmp_path))], out_dir=str(run.path))
    prepare_data(data_settings(config), run, tokenizer=given, context_length=32)
    saved = run.tokenizer()
    assert saved.chat_template == CHATML_TEMPLATE  # what generate and serve render chats with
    assert saved.special_tokens == ["<|endoftext|>", *CHAT_MARKERS] and saved.vocab_size == 257 + len(CHAT_MARKERS)


def test_a_tokenizer_trained_on_chat_data_has_the_chat_markers_as_special_tokens(tmp_path) -> None:
    from tlm_tokenizer.chat import CHAT_MARKERS

    run = RunDir(tmp_path / "run")
    config = TrainConfig(data=[str(_chat_file(tmp_path))], out_dir=str(run.path), vocab_size=300)
    prepare_data(data_settings(config), run, context_length=32)
    assert run.tokenizer().special_tokens == ["<|endoftext|>", *CHAT_MARKERS]


def test_a_full_disk_while_the_data_is_written_is_one_error_naming_the_run_folder(tmp_path, monkeypatch) -> None:
    import errno

    import tlm_train.data as data_module

    real = data_module.create_new

    class Full:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(data_module, "create_new", lambda path: Full(real(path)))
    text = tmp_path / "t.txt"
    text.write_text("some text " * 100, encoding="utf-8")
    run = RunDir(tmp_path / "run")
    with pytest.raises(ValueError, match=rf"^--out-dir {run.path}: the disk filled while the run's data was written "):
        prepare_data(data_settings(TrainConfig(data=[str(text)], out_dir=str(run.path))), run)
    assert [p.name for p in run.path.iterdir()] == []  # the partial corpus is removed


def test_validation_text_and_chat_data_are_bounded_by_max_data_bytes_too(tmp_path) -> None:
    text, held_out = tmp_path / "t.txt", tmp_path / "v.txt"
    text.write_text(default_corpus()[:20_000], encoding="utf-8")
    held_out.write_text("x" * 30_000, encoding="utf-8")
    run = RunDir(tmp_path / "run")
    config = TrainConfig(data=[str(text)], val_data=[str(held_out)], out_dir=str(run.path), vocab_size=300,
                         max_data_bytes=25_000)  # fmt: skip
    with pytest.raises(ValueError, match=rf"^--val-data {held_out}: the corpus passed --max-data-bytes 25,000 "):
        prepare_data(data_settings(config), run)
    run = RunDir(tmp_path / "chat-run")
    chat = _chat_file(tmp_path)
    with pytest.raises(ValueError, match=rf"^--data {chat}: the corpus passed --max-data-bytes 100 "):
        config = TrainConfig(data=[str(chat)], out_dir=str(run.path), max_data_bytes=100)
        prepare_data(data_settings(config), run, context_length=32)
    assert not (run.path / "data").exists() and not (run.path / "tokenizer").exists()


def test_chat_data_holds_out_its_last_conversations_and_trains_on_every_other_one(tmp_path) -> None:
    from tlm_tokenizer import Tokenizer
    from tlm_tokenizer.chat import CHAT_MARKERS, ChatTemplate

    given = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>", *CHAT_MARKERS])
    run = RunDir(tmp_path / "run")
    config = TrainConfig(
        data=[str(_chat_file(tmp_path))], out_dir=str(run.path), val_fraction=0.34, chat_layout="padded"
    )
    prepare_data(data_settings(config), run, tokenizer=given, context_length=63)
    template = ChatTemplate(run.tokenizer())
    # round(6 x 0.34) = 2 held out, the last two; one conversation per 64-token row, in the file's order.
    rows = [np.load(run.data_dir / name).reshape(-1, 64) for name in ("train.npy", "val.npy")]
    assert [len(r) for r in rows] == [4, 2]
    for i, row in enumerate(np.concatenate(rows)):
        ids = template.encode(
            [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
        ).ids
        assert np.where(row < 0, -1 - row, row)[: len(ids)].tolist() == ids
    assert json.loads((run.data_dir / "info.json").read_text())["chat"]["examples"] == 6


def test_the_data_layer_depends_on_its_own_settings_only():
    """tlm_train.data reads the dozen settings of DataSettings, never the whole TrainConfig (issue 43)."""
    import ast
    import dataclasses
    import pathlib

    import tlm_train.data
    from tlm_train.data import DataSettings

    tree = ast.parse(pathlib.Path(tlm_train.data.__file__).read_text(encoding="utf-8"))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not imported & {"tlm_train.config", "tlm_train.recipe", "tlm_train.run_dir", "tlm_train"}
    config = TrainConfig(data=["a.txt"], vocab_size=300, chat_layout="padded", max_data_bytes=5)
    settings = data_settings(config)
    names = {f.name for f in dataclasses.fields(DataSettings)}
    assert names < {f.name for f in dataclasses.fields(TrainConfig)}
    assert all(getattr(settings, name) == getattr(config, name) for name in names)


def test_the_runs_token_files_are_verified_against_their_record_before_a_restart_trains_on_them(tmp_path) -> None:
    import hashlib

    text = tmp_path / "t.txt"
    text.write_text(default_corpus()[:3_000], encoding="utf-8")
    config = TrainConfig(data=[str(text)], vocab_size=260, out_dir=str(tmp_path / "run"))
    run = RunDir(tmp_path / "run")
    prepare_data(data_settings(config), run)
    files = json.loads((run.data_dir / "info.json").read_text())["files"]
    for name in ("train.npy", "val.npy"):
        data = (run.data_dir / name).read_bytes()
        assert files[name] == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    flipped = bytearray((run.data_dir / "train.npy").read_bytes())
    flipped[-1] ^= 0x04  # one bit of the last token id
    (run.data_dir / "train.npy").write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match=r"train\.npy: .* but info\.json recorded .*the run's tokens are damaged"):
        prepare_data(data_settings(config), run)
    (run.data_dir / "train.npy").write_bytes(bytes(flipped[:-2]))  # cut short
    with pytest.raises(ValueError, match=rf"{len(flipped) - 2} bytes, SHA-256 .* recorded {len(flipped)} bytes"):
        prepare_data(data_settings(config), run)
