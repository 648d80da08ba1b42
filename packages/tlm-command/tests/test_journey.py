"""The whole journey as a user types it, each command a process of its own (``python -m tlm``'s module, forked
from a warm interpreter: conftest's ``tlm_forked``):

text -> ``tlm tokenizer train`` -> ``tlm train`` -> ``tlm generate`` -> ``tlm eval`` -> ``tlm convert --to-hf``
-> transformers' ``AutoTokenizer``, ``AutoModelForCausalLM`` and ``pipeline("text-generation")`` with the same ids,
logits and greedy text; and an HF Llama folder -> ``tlm train --init-from`` -> ``tlm generate`` ->
``tlm convert --to-hf`` -> transformers loads it with tlm's logits.
"""

import json

import pytest
import torch

from tlm_model import load_model_file
from tlm_tokenizer import Tokenizer
from tlm_train import RunDir

transformers = pytest.importorskip("transformers", reason="the journey ends in HF transformers")
# Every command a process of its own, training and exporting real models: in `nox -s tests`, not in the quick tier.
pytestmark = pytest.mark.slow

SMALL = ["--context-length", "32", "--d-model", "32", "--num-layers", "2", "--num-heads", "4", "--d-ff", "64",
         "--batch-size", "8", "--eval-batches", "2", "--eval-interval", "10", "--checkpoint-interval", "10",
         "--peak-flops", "1e9", "--warmup-steps", "2", "--sample-tokens", "0", "--quiet"]  # fmt: skip
TEXTS = ["The quick brown fox", "  spaces  and\ttabs\n\nnew lines", "ünïcödé and emoji 🙂 ok",
         "a<|endoftext|>b", "def f(x):\n    return x ** 2  # code"]  # fmt: skip


def ok(done):
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_from_text_to_hugging_face_and_back(tmp_path, corpus, held_out, tlm_forked, record_error):
    tlm = tlm_forked
    tok, run, hf = tmp_path / "tok", tmp_path / "run", tmp_path / "hf"
    ok(tlm("tokenizer", "train", "--input", corpus, "--vocab-size", 400, "--special-token", "<|endoftext|>",
           "--out", tok, "--quiet"))  # fmt: skip
    ok(tlm("train", "--data", corpus, "--tokenizer", tok, "--out-dir", run, "--steps", 30, *SMALL))
    greedy = ok(tlm("generate", "--checkpoint", run, "--prompt", "The ", "--max-new-tokens", 24, "--temperature", 0,
                    "--quiet"))  # fmt: skip
    report = json.loads(ok(tlm("eval", "--checkpoint", run, "--data", held_out, "--json", "--quiet")))
    assert report["tokens"] > 1000 and 0 < report["bits_per_byte"] < 8
    ok(tlm("convert", "--to-hf", run, "--out", hf))

    # transformers reads the folder as it is: the tokenizer gives tlm's ids, the model tlm's logits.
    ours = Tokenizer.load(tok)
    auto = transformers.AutoTokenizer.from_pretrained(hf)
    for text in TEXTS:
        assert auto(text)["input_ids"] == ours.encode(text), text
        assert auto.decode(ours.encode(text)) == text
    model = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    tlm_model = load_model_file(RunDir(run).checkpoints().path(30)).eval()
    ids = torch.tensor([ours.encode(TEXTS[0] + " " + TEXTS[4])[:32]])  # at most the context length
    with torch.no_grad():
        record_error("journey: HF export logits vs tlm", model(ids).logits, tlm_model(ids))
        torch.testing.assert_close(model(ids).logits, tlm_model(ids), rtol=1e-5, atol=1e-5)
    # Greedy decoding through pipeline("text-generation") writes what tlm generate --temperature 0 wrote.
    pipe = transformers.pipeline("text-generation", model=str(hf), tokenizer=str(hf))
    out = pipe("The ", max_new_tokens=24, do_sample=False, return_full_text=False)[0]["generated_text"]
    assert out + "\n" == greedy


def test_an_hf_llama_folder_fine_tuned_and_exported_back(tmp_path, corpus, tlm_forked, record_error):
    tlm = tlm_forked
    tok, source, run, back = tmp_path / "tok", tmp_path / "source", tmp_path / "run", tmp_path / "back"
    ok(tlm("tokenizer", "train", "--input", corpus, "--vocab-size", 300, "--special-token", "<|endoftext|>",
           "--out", tok, "--quiet"))  # fmt: skip
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True)  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(source)  # no tokenizer in it: --tokenizer gives one
    ok(
        tlm(
            "train",
            "--init-from",
            source,
            "--tokenizer",
            tok,
            "--data",
            corpus,
            "--out-dir",
            run,
            "--steps",
            10,
            "--batch-size",
            "8",
            "--eval-batches",
            "2",
            "--peak-flops",
            "1e9",
            "--sample-tokens",
            "0",
            "--quiet",
        )
    )
    tuned = load_model_file(RunDir(run).checkpoints().path(10)).eval()
    assert (tuned.config.kv_heads, tuned.config.tie_word_embeddings, tuned.config.vocab_size) == (2, True, 320)
    assert ok(tlm("generate", "--checkpoint", run, "--prompt", "The ", "--max-new-tokens", 8, "--quiet"))
    ok(tlm("convert", "--to-hf", run, "--out", back))
    model = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
    ids = torch.tensor([Tokenizer.load(tok).encode("The quick brown fox")])
    with torch.no_grad():
        record_error("journey: fine-tuned HF export logits vs tlm", model(ids).logits, tuned(ids))
        torch.testing.assert_close(model(ids).logits, tuned(ids), rtol=1e-5, atol=1e-5)
    assert transformers.AutoTokenizer.from_pretrained(back)("The cat")["input_ids"] == Tokenizer.load(tok).encode(
        "The cat"
    )
