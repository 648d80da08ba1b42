"""``tlm serve``'s own argument checks, in-process and before any model is loaded (``test_serve.py``, the server
itself, is in the slow tier)."""

import pytest

pytest.importorskip("fastapi", reason="tlm serve needs the serve extra (fastapi, uvicorn)")
pytest.importorskip("uvicorn", reason="tlm serve needs the serve extra (fastapi, uvicorn)")


@pytest.mark.parametrize(("argv", "message"), [
    (["--drain-timeout", "-1"], "--drain-timeout must be >= 0 seconds, got -1.0"),
    (["--drain-timeout", "nan"], "--drain-timeout must be >= 0 seconds, got nan"),
    (["--port", "65536"], "--port must be in [0, 65535], got 65536"),
    (["--host", ""], "--host is empty; give an address (0.0.0.0: every interface)"),
    (["--model-name", " "], "--model-name is empty; give a name"),
    (["--model-name", "a\udcffb"], "--model-name must be UTF-8 text"),  # every answer names it: all would be 500s
])  # fmt: skip
def test_a_bad_setting_is_one_line_before_the_checkpoint_is_read(tmp_path, fails, argv, message):
    fails(["serve", "--checkpoint", str(tmp_path / "none"), *argv], message)


def test_the_model_id_is_the_flag_else_the_checkpoint_folders_name(tmp_path):
    from tlm_command.serve import model_id

    (tmp_path / "runs" / "tiny").mkdir(parents=True)
    (tmp_path / "latest").symlink_to(tmp_path / "runs" / "tiny")
    assert model_id(str(tmp_path / "runs" / "tiny" / "."), None) == "tiny"
    assert model_id(str(tmp_path / "latest"), None) == "tiny"  # the folder a link names, not the link
    assert model_id(str(tmp_path / "latest"), "mine") == "mine"
    odd = tmp_path / "run\udcff"  # a folder whose name is the byte 0xff: the id shows it escaped, as JSON can carry
    odd.mkdir()
    assert model_id(str(odd), None) == "run\\xff"


def test_a_max_batch_whose_cache_cannot_be_allocated_is_one_line(tmp_path, fails):
    from tlm_model import ModelConfig, TransformerLM, save_model_file
    from tlm_tokenizer import Tokenizer

    model = TransformerLM(ModelConfig(257, 16, 16, 1, 2, 24))
    save_model_file(model, tmp_path / "m")
    Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"]).save(tmp_path / "m" / "tokenizer")
    rows = 10**11  # 10^11 rows x 16 positions x 16 floats x 2: petabytes, refused by the allocator at once
    argv = ["serve", "--checkpoint", str(tmp_path / "m"), "--no-compile", "--port", "0", "--device", "cpu"]
    fails([*argv, "--max-batch", str(rows)], f"--max-batch {rows}: the KV cache of that many rows of 16 tokens")
