"""``tlm eval``: tokens, loss, perplexity and bits per byte against an independent computation (F.cross_entropy
over the same windows, UTF-8 byte counts of the scored text)."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tlm_command.main import main
from tlm_model import load_model_file
from tlm_train import RunDir


def _reference(model, ids, context):
    """Non-overlapping windows of context + 1 tokens, each scored after its first: summed nats and targets."""
    starts = range(0, len(ids) - context, context)
    targets = [ids[s + 1 : s + context + 1].tolist() for s in starts]
    inputs = torch.tensor(np.stack([ids[s : s + context] for s in starts]))
    with torch.no_grad():
        logits = model(inputs).double()
    nats = F.cross_entropy(logits.flatten(0, 1), torch.tensor(np.stack(targets)).flatten(), reduction="sum").item()
    return nats, [int(t) for row in targets for t in row]


def test_a_text_file_against_an_independent_computation(run, held_out, capsys):
    assert main(["eval", "--checkpoint", str(run), "--data", str(held_out), "--json", "--quiet"]) == 0
    report = json.loads(capsys.readouterr().out)
    tokenizer, model = RunDir(run).tokenizer(), load_model_file(RunDir(run).checkpoints().path(24)).eval()
    ids = np.asarray(tokenizer.encode(held_out.read_text(encoding="utf-8")))
    nats, targets = _reference(model, ids, model.config.context_length)
    text_bytes = sum(len(tokenizer.decode_bytes([t])) for t in targets if t != tokenizer.encode("<|endoftext|>")[0])
    assert report["tokens"] == len(targets)
    assert report["loss"] == pytest.approx(nats / len(targets), rel=1e-6)
    assert report["perplexity"] == pytest.approx(math.exp(nats / len(targets)), rel=1e-6)
    assert report["bytes"] == text_bytes
    assert report["bits_per_byte"] == pytest.approx(nats / math.log(2) / text_bytes, rel=1e-6)


def test_a_token_file_and_a_shorter_window(run, held_out, tmp_path, capsys):
    tokenizer = RunDir(run).tokenizer()
    ids = np.asarray(tokenizer.encode(held_out.read_text(encoding="utf-8")), dtype=np.uint16)
    np.save(tmp_path / "ids.npy", ids)
    argv = ["eval", "--checkpoint", str(run), "--data", str(tmp_path / "ids.npy"), "--context-length", "8",
            "--max-tokens", "400", "--batch-size", "3", "--json", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    model = load_model_file(RunDir(run).checkpoints().path(24)).eval()
    nats, targets = _reference(model, ids[:400], 8)
    assert (report["tokens"], report["context_length"]) == (len(targets), 8)
    assert report["loss"] == pytest.approx(nats / len(targets), rel=1e-6)


def test_the_plain_report_is_one_line(run, held_out, capsys):
    assert main(["eval", "--checkpoint", str(run), "--data", str(held_out), "--quiet"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("tokens ") and "perplexity" in line and "bits/byte" in line


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--data", "{missing}"], "no such file"),
        (["--data", "{bad_ids}"], "holds token ids up to 5000, outside the model's vocabulary [0, 320)"),
        (["--data", "{text}", "--context-length", "64"], "--context-length 64 exceeds the model's context length 32"),
        (["--data", "{binary}"], "is not UTF-8 text"),
        (["--data", "{text}", "--batch-size", "0"], "--batch-size: must be a positive integer, got 0"),
    ],
)
def test_errors_are_one_line(run, held_out, tmp_path, fails, extra, fragment):
    np.save(tmp_path / "bad.npy", np.array([1, 2, 5000], dtype=np.uint16))
    (tmp_path / "binary.txt").write_bytes(b"ab\xff\xfe")
    places = {"missing": tmp_path / "nope.txt", "bad_ids": tmp_path / "bad.npy", "text": held_out,
              "binary": tmp_path / "binary.txt"}  # fmt: skip
    fails(["eval", "--checkpoint", str(run), *(a.format(**places) for a in extra)], fragment)
