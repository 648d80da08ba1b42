"""save_gguf against transformers' GGUF reader (``from_pretrained(folder, gguf_file=...)``, which dequantizes
with the gguf library): the same logits as tlm's model with the same weights, for llama.cpp's ``llama`` and
``qwen2`` (q/k/v biases), tied and untied, in float32, float16 and bfloat16."""

import pytest
import torch

from tlm_model import ModelConfig, TransformerLM

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from tlm_model.gguf import GGUFVocabulary, save_gguf  # noqa: E402  (needs the gguf extra)

VOCAB = 96


def random_model(qkv_bias, tie):
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=VOCAB, context_length=32, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=96,
        qkv_bias=qkv_bias, tie_word_embeddings=tie, rope_theta=50_000.0, norm_eps=1e-6,
    )  # fmt: skip
    model = TransformerLM(config).eval()
    with torch.no_grad():  # norms and biases away from their initial 1 and 0, so a lost one shows
        for name, p in model.named_parameters():
            if name.startswith(("layers", "ln_final")) and p.ndim == 1:
                p.uniform_(0.5, 1.5) if "ln" in name else p.normal_()
    return model


def rounded(model, dtype):
    """``model`` with its matrices rounded to ``dtype`` (what the file holds; vectors stay float32)."""
    copy = TransformerLM(model.config).eval()
    copy.load_state_dict({k: v.to(dtype).float() if v.ndim >= 2 else v for k, v in model.state_dict().items()})
    return copy


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(("qkv_bias", "tie"), [(False, False), (False, True), (True, False)])
def test_transformers_reads_the_file_with_our_logits(qkv_bias, tie, dtype, tmp_path, record_error):
    model = random_model(qkv_bias, tie)
    save_gguf(model, tmp_path / "model.gguf", dtype=dtype)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="model.gguf", dtype=torch.float32)
    assert type(hf).__name__ == ("Qwen2ForCausalLM" if qkv_bias else "LlamaForCausalLM")
    assert hf.config.tie_word_embeddings == tie and hf.config.num_key_value_heads == 2
    ids = torch.randint(0, VOCAB, (2, 32))
    with torch.no_grad():
        got, ours = hf.eval()(ids).logits, rounded(model, getattr(torch, dtype))(ids)
        original = model(ids)
    family = "qwen2" if qkv_bias else "llama"
    record_error(f"GGUF ({family}, {dtype}) via transformers vs tlm with the file's weights", got, ours)
    record_error(f"GGUF ({family}, {dtype}) via transformers vs tlm float32", got, original)
    torch.testing.assert_close(got, ours, rtol=1e-5, atol=2e-5)


def test_the_tokenizer_and_its_chat_template_travel_in_the_file(tmp_path):
    # A byte-level vocabulary: the 256 bytes in GPT-2's alphabet, two merges, and a control token.
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()
    tokens = [alphabet[b] for b in range(256)]
    # Rank 0 joins " " and "h", rank 1 "h" and "i": " hi" is [" h", "i"], "hi" is ["hi"].
    merges = [f"{alphabet[ord(' ')]} {alphabet[ord('h')]}", f"{alphabet[ord('h')]} {alphabet[ord('i')]}"]
    tokens += [alphabet[ord(" ")] + "h", "hi", "<|endoftext|>"]
    template = "{% for m in messages %}{{ m['content'] }}<|endoftext|>{% endfor %}"
    vocabulary = GGUFVocabulary(tokens, merges, special=frozenset({258}), eos_token_id=258, chat_template=template)
    config = ModelConfig(vocab_size=300, context_length=16, d_model=32, num_layers=1, num_heads=2, d_ff=64)
    save_gguf(TransformerLM(config), tmp_path / "m.gguf", vocabulary=vocabulary)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    assert tokenizer.encode("hi hi<|endoftext|>", add_special_tokens=False) == [257, 256, ord("i"), 258]
    assert tokenizer.eos_token == "<|endoftext|>"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "hi<|endoftext|>"
    # The model embeds 300 ids; the 41 the tokenizer never makes are llama.cpp's unused placeholders.
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    types = reader.fields["tokenizer.ggml.token_type"]
    assert [int(types.parts[i][0]) for i in types.data][-42:] == [3] + [5] * 41


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, ValueError, "RoPE-scaled model"),
        ({"ffn": "silu", "d_ff": 64}, ValueError, "ModelConfig.ffn='silu'"),
    ],
)
def test_what_the_file_cannot_express_is_refused(change, error, match, tmp_path):
    config = ModelConfig(vocab_size=VOCAB, context_length=16, d_model=32, num_layers=1, num_heads=2, d_ff=64)
    model = TransformerLM(ModelConfig.from_dict({**config.to_dict(), **change}))
    with pytest.raises(error, match=match):
        save_gguf(model, tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary left


def test_bad_arguments_are_refused_before_writing(tmp_path):
    model = TransformerLM(ModelConfig(vocab_size=4, context_length=8, d_model=16, num_layers=1, num_heads=2, d_ff=32))
    with pytest.raises(ValueError, match="dtype must be one of"):
        save_gguf(model, tmp_path / "m.gguf", dtype="int8")
    with pytest.raises(TypeError, match="model must be a TransformerLM"):
        save_gguf(torch.nn.Linear(2, 2), tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="vocabulary has 5 tokens, more than the model's vocab_size=4"):
        save_gguf(model, tmp_path / "m.gguf", vocabulary=GGUFVocabulary(list("abcde"), []))
    with pytest.raises(TypeError, match="^vocabulary must be a GGUFVocabulary or None, got dict$"):
        save_gguf(model, tmp_path / "m.gguf", vocabulary={"tokens": list("ab")})
    (tmp_path / "folder").mkdir()
    with pytest.raises(IsADirectoryError, match=f"^path must be a file to write, got the folder {tmp_path}/folder$"):
        save_gguf(model, tmp_path / "folder")  # refused before a file is written beside it
    assert list(tmp_path.iterdir()) == [tmp_path / "folder"] and list((tmp_path / "folder").iterdir()) == []


def test_the_file_is_replaced_whole_and_a_symlink_there_is_not_followed(tmp_path, monkeypatch):
    import os

    model = random_model(False, False)
    victim, path = tmp_path / "victim", tmp_path / "m.gguf"
    victim.write_bytes(b"keep")
    path.symlink_to(victim)
    save_gguf(model, path)
    assert victim.read_bytes() == b"keep" and not path.is_symlink()
    old = path.read_bytes()
    assert old[:4] == b"GGUF"

    def fail(self, *args, **kwargs):
        raise OSError(28, "No space left on device")  # after the header and metadata went out

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", fail)
    with pytest.raises(OSError, match="No space left"):
        save_gguf(model, path, dtype="float16")
    assert path.read_bytes() == old
    assert sorted(os.listdir(tmp_path)) == ["m.gguf", "victim"]  # no temporary left
