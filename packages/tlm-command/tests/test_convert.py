"""``tlm convert --from-hf`` / ``--to-hf`` against HF transformers' LlamaForCausalLM."""

import json

import pytest
import torch

from tlm_command.main import main
from tlm_model import load_model_file

transformers = pytest.importorskip("transformers")


def random_hf(tie):
    torch.manual_seed(0)
    # Two layers with grouped-query heads; transformers' defaults for the rest (RoPE θ = 10,000).
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tie,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("tie", [False, True])
def test_round_trip_through_the_command_keeps_hf_logits(tie, tmp_path, capsys):
    hf = random_hf(tie)
    hf.save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "tlm"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["num_kv_heads"] == 2 and report["config"]["tie_word_embeddings"] is tie
    model = load_model_file(tmp_path / "tlm")
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        ref = hf(ids).logits
        torch.testing.assert_close(model(ids), ref, rtol=1e-5, atol=1e-5)
    assert main(["convert", "--to-hf", str(tmp_path / "tlm"), "--out", str(tmp_path / "back")]) == 0
    assert "-> HF Llama folder" in capsys.readouterr().out
    assert json.loads((tmp_path / "back" / "generation_config.json").read_text())["do_sample"] is False
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref, rtol=0, atol=0)


def test_unsupported_config_is_one_line_naming_the_key(tmp_path, capsys):
    random_hf(False).save_pretrained(tmp_path / "hf")
    capsys.readouterr()  # transformers' own progress bars
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["sliding_window"] = 32
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("tlm: error:") and "sliding_window=32" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["convert", "--from-hf", "NOPE", "--out", "x"],
        ["convert", "--to-hf", "NOPE", "--out", "x"],
        ["convert", "--out", "x"],
        ["convert", "--from-hf", "a", "--to-hf", "b", "--out", "x"],
    ],
)
def test_user_errors_exit_2_without_traceback(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("tlm: error:")


def test_a_run_exports_with_its_tokenizer_and_an_end_of_text_eos(run, tmp_path, capsys):
    assert main(["convert", "--to-hf", str(run), "--out", str(tmp_path / "hf"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokenizer"] is True
    from tlm_train import RunDir

    tokenizer = RunDir(run).tokenizer()
    (eot,) = tokenizer.encode("<|endoftext|>")
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "hf")
    assert generation.eos_token_id == eot
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert auto("Hello, world")["input_ids"] == tokenizer.encode("Hello, world")
    assert auto.eos_token == "<|endoftext|>"
    # And back: the HF folder's tokenizer becomes the tlm model folder's own, OUT/tokenizer.
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "tlm"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokenizer"] is True
    from tlm_tokenizer import Tokenizer

    assert Tokenizer.load(tmp_path / "tlm" / "tokenizer").encode("Hello, world") == tokenizer.encode("Hello, world")


@pytest.mark.parametrize("where", ["same", "inside", "around"])
def test_an_output_equal_to_or_around_the_input_is_refused_and_the_input_survives(run, tmp_path, fails, where):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    out = {"same": copy, "inside": copy / "hf", "around": tmp_path}[where]
    before = sorted(p.relative_to(copy) for p in copy.rglob("*"))
    fails(["convert", "--to-hf", str(copy), "--out", str(out)], "would overwrite the input")
    assert sorted(p.relative_to(copy) for p in copy.rglob("*")) == before


@pytest.mark.parametrize("where", ["same", "inside"])
def test_an_output_over_the_tokenizer_given_is_refused_and_the_tokenizer_survives(run, tmp_path, fails, where):
    import shutil

    tokenizer = tmp_path / "tok"
    shutil.copytree(run / "tokenizer", tokenizer)
    out = {"same": tokenizer, "inside": tokenizer / "hf"}[where]
    before = {p: p.read_bytes() for p in tokenizer.rglob("*") if p.is_file()}
    fails(["convert", "--to-hf", str(run), "--tokenizer", str(tokenizer), "--out", str(out)],
          f"--out {out} would overwrite the input {tokenizer}")  # fmt: skip
    assert {p: p.read_bytes() for p in tokenizer.rglob("*") if p.is_file()} == before


def test_from_hf_writes_a_model_folder_every_command_reads(tmp_path, capsys):
    random_hf(False).save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "tlm")]) == 0
    assert "(no tokenizer)" in capsys.readouterr().out
    assert main(["generate", "--checkpoint", str(tmp_path / "tlm"), "--prompt-ids", "1 2", "--max-new-tokens", "3",
                 "--temperature", "0"]) == 0  # fmt: skip
    assert len(capsys.readouterr().out.split()) == 3
    assert main(["generate", "--checkpoint", str(tmp_path / "hf"), "--prompt-ids", "1 2", "--max-new-tokens", "3",
                 "--temperature", "0"]) == 0  # an HF folder works directly too  # fmt: skip


def test_the_directions_are_checked(run, tmp_path, fails, capsys):
    random_hf(False).save_pretrained(tmp_path / "hf")
    capsys.readouterr()  # transformers' own progress bars
    fails(["convert", "--to-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "x")], "is already an HF folder")
    fails(["convert", "--from-hf", str(run), "--out", str(tmp_path / "x")], "is a tlm run folder, not an HF folder")


def test_from_hf_replaces_the_model_and_its_tokenizer_as_one_unit(tmp_path, capsys, monkeypatch, fails):
    from tlm_tokenizer import Tokenizer

    def tiny_hf(seed, folder):
        torch.manual_seed(seed)
        config = transformers.LlamaConfig(vocab_size=260, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
        transformers.LlamaForCausalLM(config).save_pretrained(folder)

    tiny_hf(0, tmp_path / "hf0")
    tiny_hf(1, tmp_path / "hf1")
    Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"]).save(tmp_path / "tok")
    out = tmp_path / "out"
    argv = ["convert", "--tokenizer", str(tmp_path / "tok"), "--out", str(out)]
    assert main(["convert", "--from-hf", str(tmp_path / "hf0"), *argv[1:]]) == 0
    old = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert sorted(map(str, old)) == [
        "model.safetensors",
        "tokenizer/tlm_sha256.json",
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
    ]

    def fail(self, directory):
        raise RuntimeError("disk full")  # after the new model file was written

    monkeypatch.setattr(Tokenizer, "save", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        main(["convert", "--from-hf", str(tmp_path / "hf1"), *argv[1:]])
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == old  # the old unit, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf0", "hf1", "out", "tok"]  # no temporary left
    (out / "notes.txt").write_text("mine")
    capsys.readouterr()
    fails(["convert", "--from-hf", str(tmp_path / "hf0"), *argv[1:]], f"--out {out} holds other files (notes.txt)")
    fails(["convert", "--from-hf", str(tmp_path / "hf0"), *argv[1:3], "--out", str(tmp_path / "m.safetensors")],
          "names one model file: the tokenizer needs a folder")  # fmt: skip
