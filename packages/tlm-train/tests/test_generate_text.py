"""`tlm generate --prompt TEXT --tokenizer DIR`: text in, text out, through tlm-tokenizer.

Lives here because tlm-train is the package that installs both tlm-model (the command) and
tlm-tokenizer (the tokenizer); tlm-model itself does not depend on the tokenizer.
"""

import pytest
import torch

from tlm_model import TransformerLM, generate, save_checkpoint
from tlm_model.cli import main
from tlm_tokenizer import Tokenizer, train_bpe

TEXT = "the cat sat on the mat. the dog sat on the log. " * 40


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    corpus = folder / "corpus.txt"
    corpus.write_text(TEXT)
    vocab, merges = train_bpe(corpus, 300, ["<|endoftext|>"])
    Tokenizer(vocab, merges, ["<|endoftext|>"]).save(folder / "tokenizer")
    return folder / "tokenizer"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = TransformerLM(
        ModelConfig(vocab_size=300, context_length=64, d_model=32, num_layers=2, num_heads=4, d_ff=64)
    )
    path = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(model, path)
    return path, model.eval()


def test_text_prompt_is_encoded_and_the_continuation_decoded(tokenizer_dir, checkpoint, capsys):
    path, model = checkpoint
    tok = Tokenizer.load(tokenizer_dir)
    prompt = "the cat sat"
    argv = ["generate", "--checkpoint", str(path), "--tokenizer", str(tokenizer_dir), "--prompt", prompt]
    assert main([*argv, "--max-new-tokens", "8", "--temperature", "0", "--quiet"]) == 0
    ids = tok.encode(prompt)
    expected = generate(model, torch.tensor(ids), 8, temperature=0)[len(ids) :].tolist()
    assert capsys.readouterr().out == tok.decode(expected) + "\n"


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--prompt", "hi"], "--prompt needs --tokenizer DIR"),
        (["--prompt", "", "--tokenizer", "TOK"], "--prompt is empty"),
        (["--prompt", "hi", "--tokenizer", "/nonexistent/tokenizer"], "/nonexistent/tokenizer"),
        (["--prompt", "hi", "--prompt-ids", "1"], "not allowed with argument"),
    ],
)
def test_text_prompt_errors_are_one_line(tokenizer_dir, checkpoint, capsys, extra, fragment):
    extra = [str(tokenizer_dir) if arg == "TOK" else arg for arg in extra]
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--checkpoint", str(checkpoint[0]), "--max-new-tokens", "2", *extra])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("tlm: error: ") and fragment in err and err.count("\n") == 1
