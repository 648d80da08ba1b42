"""The tokenizer folder (folder.py, through Tokenizer.save and Tokenizer.load): written as one unit,
read as one version, never over a user's files; real processes race and are killed mid-save."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from processes import same_code_env
from small_tokenizers import make, which

import tlm_core.atomic
from tlm_tokenizer import Tokenizer
from tlm_tokenizer.folder import read_folder


def leftovers(folder) -> list[str]:
    return sorted(name for name in os.listdir(folder.parent) if name.startswith(f".{folder.name}."))


# -- in one process -------------------------------------------------------------------------------


def test_save_writes_the_two_hf_files_and_load_reads_them(tmp_path):
    make("A").save(tmp_path / "new" / "tok")  # missing parents are made
    assert sorted(os.listdir(tmp_path / "new" / "tok")) == [
        "tlm_sha256.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert which(Tokenizer.load(tmp_path / "new" / "tok")) == "A"
    assert leftovers(tmp_path / "new" / "tok") == []


def test_save_replaces_a_tokenizer_folder(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    for name in ("vocab.json", "merges.txt", "special_tokens_map.json", "added_tokens.json"):
        (folder / name).write_text("{}")
    make("B").save(folder)
    assert sorted(os.listdir(folder)) == ["tlm_sha256.json", "tokenizer.json", "tokenizer_config.json"]
    make("A").save(folder)
    assert which(Tokenizer.load(folder)) == "A" and leftovers(folder) == []


@pytest.mark.parametrize("intruder", ["corpus.txt", "notes", ".hidden"])
def test_save_refuses_a_folder_with_other_files_and_leaves_it_alone(tmp_path, intruder):
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("old")
    if intruder == "notes":
        (folder / intruder).mkdir()
    else:
        (folder / intruder).write_text("the user's")
    with pytest.raises(
        ValueError, match=f"directory must be a new folder or a tokenizer folder, got {folder}, which holds {intruder}"
    ):
        make("A").save(folder)
    assert sorted(os.listdir(folder)) == sorted(["tokenizer.json", intruder])
    assert (folder / "tokenizer.json").read_text() == "old"


def test_save_into_the_current_folder_refuses_a_users_files(tmp_path, monkeypatch):
    # `tlm tokenizer train --out .` in a folder holding the corpus must not wipe it.
    (tmp_path / "a.txt").write_text("1")
    (tmp_path / "b.txt").write_text("2")
    (tmp_path / "c.txt").write_text("3")
    (tmp_path / "d.txt").write_text("4")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ValueError, match=r"which holds a.txt, b.txt, c.txt and 1 more; save into a new or empty folder"
    ):
        make("A").save(".")
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.txt", "c.txt", "d.txt"]


def test_the_refusal_names_three_files_whole(tmp_path):
    for name in ("a.txt", "b.txt", "c.txt"):
        (tmp_path / name).write_text("mine")
    with pytest.raises(ValueError, match=r"which holds a.txt, b.txt, c.txt; save into") as raised:
        make("A").save(tmp_path)
    assert "more" not in str(raised.value)


def test_save_refuses_a_file(tmp_path):
    (tmp_path / "tok").write_text("a file")
    with pytest.raises(ValueError, match="directory must be a folder .or not exist yet., got the file"):
        make("A").save(tmp_path / "tok")
    assert (tmp_path / "tok").read_text() == "a file"


def test_a_failed_save_leaves_the_old_folder_and_no_temporary_one(tmp_path, monkeypatch):
    make("A").save(tmp_path / "tok")

    def fail(step: str) -> None:
        if step == "filled":
            raise OSError("No space left on device")

    monkeypatch.setattr(tlm_core.atomic, "after_step", fail)
    with pytest.raises(OSError, match="No space left"):
        make("B").save(tmp_path / "tok")
    assert which(Tokenizer.load(tmp_path / "tok")) == "A"
    assert os.listdir(tmp_path) == ["tok"]


def test_load_needs_a_tokenizer_folder(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=f"directory must be a tokenizer folder, got {tmp_path / 'absent'} .no such folder."
    ):
        Tokenizer.load(tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="directory must hold tokenizer.json, got"):
        Tokenizer.load(tmp_path)
    (tmp_path / "vocab.json").write_text("{}")
    (tmp_path / "merges.txt").write_text("")
    with pytest.raises(FileNotFoundError, match="directory must hold tokenizer.json"):
        Tokenizer.load(tmp_path)  # GPT-2's files are read by from_files, not as a folder
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        Tokenizer.load(tmp_path / "file")


def test_load_passes_over_a_moved_aside_copy_that_holds_nothing(tmp_path):
    # A writer that finished deletes the copy it moved aside, files first: an empty one is not a tokenizer.
    (tmp_path / ".tok.1-0123456789abcdef.old").mkdir()
    (tmp_path / ".tok.1-0123456789abcdef.old" / "tokenizer_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="directory must be a tokenizer folder, got .* .no such folder."):
        Tokenizer.load(tmp_path / "tok")


# -- real processes -------------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, sys.argv[1])
    import tlm_core.atomic as atomic
    from small_tokenizers import make

    folder, mode, kinds, count = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    if mode.startswith("kill-after-"):  # SIGKILL at a named step of replace_dir
        step = mode.removeprefix("kill-after-")
        atomic.after_step = lambda name: name == step and os.kill(os.getpid(), signal.SIGKILL)
    if mode == "no-exchange":  # a file system without RENAME_EXCHANGE, killed between the two renames
        atomic._exchange = lambda a, b: False
        rename = os.rename
        def rename_then_die(src, dst):
            rename(src, dst)
            if str(dst).endswith(".old"):
                os.kill(os.getpid(), signal.SIGKILL)
        os.rename = rename_then_die
    tokenizers = [make(kind) for kind in kinds]
    print("ready", flush=True)
    for i in range(count):
        tokenizers[i % len(tokenizers)].save(folder)
    """
)


def child(folder, mode: str, kinds: str, count: int) -> subprocess.Popen:
    args = [sys.executable, "-c", CHILD, os.path.dirname(__file__), str(folder), mode, kinds, str(count)]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=same_code_env())
    assert process.stdout is not None and process.stdout.readline() == "ready\n", process.stderr.read()
    return process


def test_two_savers_and_a_reader_race(tmp_path):
    folder = tmp_path / "tok"
    make("A").save(folder)
    savers = [child(folder, "save", kinds, 60) for kinds in ("AB", "BA")]
    seen = {"A": 0, "B": 0}
    loads = 0
    while any(saver.poll() is None for saver in savers):
        files = read_folder(folder, ("tokenizer.json", "tokenizer_config.json"))  # one version of the folder
        config = json.loads(files["tokenizer_config.json"])
        special = json.loads(files["tokenizer.json"])["added_tokens"][0]["content"]
        assert ("eos_token" in config) == (special == "<|endoftext|>"), "tokenizer.json and its config differ"
        seen["A" if special == "<|endoftext|>" else "B"] += 1
        if sum(seen.values()) % 3 == 0:
            which(Tokenizer.load(folder))  # a complete tokenizer, A or B
            loads += 1
    for saver in savers:
        assert saver.wait() == 0, saver.stderr.read() if saver.stderr else ""
    assert which(Tokenizer.load(folder)) in "AB"
    assert sorted(os.listdir(folder)) == ["tlm_sha256.json", "tokenizer.json", "tokenizer_config.json"]
    assert leftovers(folder) == []
    assert seen["A"] + seen["B"] > 0 and loads > 0


@pytest.mark.parametrize("step", ["filled", "swapped", "cleaned"])
def test_sigkill_at_each_step_of_a_save_leaves_the_old_or_the_new_tokenizer(tmp_path, step):
    folder = tmp_path / "tok"
    make("A").save(folder)
    process = child(folder, f"kill-after-{step}", "B", 1)
    assert process.wait() == -signal.SIGKILL
    assert which(Tokenizer.load(folder)) == ("A" if step == "filled" else "B")
    make("A").save(folder)  # the next save removes what the killed one left
    assert leftovers(folder) == [] and which(Tokenizer.load(folder)) == "A"


def test_sigkill_at_random_times_leaves_a_tokenizer_that_loads(tmp_path):
    folder = tmp_path / "tok"
    make("A").save(folder)
    rng = random.Random(0)
    for _ in range(8):
        process = child(folder, "save", "BA", 10_000)
        time.sleep(rng.uniform(0, 0.2))
        process.send_signal(signal.SIGKILL)
        assert process.wait() == -signal.SIGKILL
        assert which(Tokenizer.load(folder)) in "AB"
    make("A").save(folder)
    assert leftovers(folder) == []


def test_a_kill_between_the_two_renames_of_the_fallback_loses_nothing(tmp_path):
    # Without RENAME_EXCHANGE, replace_dir moves the old folder aside, then renames the new one in. A
    # writer killed between the two left the tokenizer only under a hidden name: load reads it there.
    folder = tmp_path / "tok"
    make("A").save(folder)
    process = child(folder, "no-exchange", "B", 1)
    assert process.wait() == -signal.SIGKILL
    assert not folder.exists() and sorted(name.rsplit(".", 1)[1] for name in leftovers(folder)) == ["old", "tmp"]
    assert which(Tokenizer.load(folder)) == "A"
    make("B").save(folder)
    assert which(Tokenizer.load(folder)) == "B" and leftovers(folder) == []


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"])
def test_a_fifo_in_a_tokenizer_folder_is_one_line_not_a_hang(tmp_path, name):
    import threading

    make("A").save(tmp_path / "tok")
    (tmp_path / "tok" / name).unlink(missing_ok=True)
    os.mkfifo(tmp_path / "tok" / name)  # no writer: a blocking open would wait for ever
    readers = [Tokenizer.from_hf] if name == "chat_template.jinja" else [Tokenizer.load, Tokenizer.from_hf]
    for read in readers:
        outcome = {}

        def run(read=read, outcome=outcome):
            try:
                read(tmp_path / "tok")
            except ValueError as err:
                outcome["error"] = str(err)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(10)
        assert not thread.is_alive(), f"{read.__name__} blocked on the FIFO"
        assert outcome["error"].endswith(f"{tmp_path / 'tok' / name}: a FIFO (named pipe), expected a regular file")


def test_a_flipped_bit_in_a_saved_file_is_refused_on_load(tmp_path):
    import hashlib

    folder = tmp_path / "tok"
    make("A").save(folder)
    record = json.loads((folder / "tlm_sha256.json").read_text())["sha256"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert record[name] == hashlib.sha256((folder / name).read_bytes()).hexdigest()
    data = bytearray((folder / "tokenizer.json").read_bytes())
    data[data.index(b'"vocab"') + 20] ^= 0x01  # inside the vocabulary: the JSON may well stay valid
    (folder / "tokenizer.json").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"tokenizer\.json: its SHA-256 is not the one tlm_sha256\.json recorded"):
        Tokenizer.load(folder)
    os.unlink(folder / "tlm_sha256.json")  # a folder HF (or an earlier tlm) wrote has no record: read as it is
    read_folder(folder)
