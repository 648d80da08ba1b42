"""``tlm convert --to-gguf``: a trained run as one GGUF file, read back by transformers' GGUF reader."""

import json

import pytest
import torch

from tlm_command.main import main

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_run_exports_to_gguf_and_transformers_reads_its_logits_and_tokenizer(dtype, run, tmp_path, capsys,
                                                                                record_error):  # fmt: skip
    import tlm_artifacts

    out = tmp_path / "run.gguf"
    assert main(["convert", "--to-gguf", str(run), "--out", str(out), "--dtype", dtype, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["architecture"] == "llama" and report["dtype"] == dtype and report["tokenizer"] is True
    artifact = tlm_artifacts.resolve(str(run))
    model, _ = tlm_artifacts.load_model(artifact)
    tokenizer = tlm_artifacts.load_tokenizer(artifact)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name, dtype=torch.float32).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=out.name)
    text = "def f(x):\n    return x  # tokens<|endoftext|>"
    ids = tokenizer.encode(text)
    assert hf_tokenizer.encode(text, add_special_tokens=False) == ids
    assert hf_tokenizer.decode(ids) == text
    assert hf_tokenizer.eos_token == "<|endoftext|>"
    batch = torch.tensor([ids[: model.config.context_length]])
    with torch.no_grad():
        if dtype == "bfloat16":  # the file's matrices are rounded; norms stay float32
            state = {k: v.to(torch.bfloat16).float() if v.ndim >= 2 else v for k, v in model.state_dict().items()}
            model.load_state_dict(state)
        ours, theirs = model(batch), hf(batch).logits
    record_error(f"tlm convert --to-gguf ({dtype}) via transformers vs tlm", theirs, ours)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=2e-5)


def test_gguf_refusals_are_one_line(run, tmp_path, fails):
    fails(["convert", "--to-gguf", str(run), "--out", str(tmp_path / "m.gguf"), "--dtype", "float64"],
          "--dtype float64: a GGUF export takes one of float32, float16, bfloat16")  # fmt: skip
    fails(["convert", "--to-gguf", str(run), "--out", str(run / "m.gguf")], "would overwrite the input")
    fails(["convert", "--to-gguf", str(run), "--merge", "--out", str(tmp_path / "m.gguf")], "no LoRA adapters to merge")
    assert not (tmp_path / "m.gguf").exists()
