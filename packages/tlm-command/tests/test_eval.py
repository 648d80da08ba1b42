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
    """Non-overlapping windows of context + 1 tokens, each scored after its first, and the tail they leave scored
    from the window that ends at the last token: summed nats and targets."""
    starts = range(0, len(ids) - context, context)
    targets = [ids[s + 1 : s + context + 1].tolist() for s in starts]
    inputs = torch.tensor(np.stack([ids[s : s + context] for s in starts]))
    with torch.no_grad():
        logits = model(inputs).double()
    nats = F.cross_entropy(logits.flatten(0, 1), torch.tensor(np.stack(targets)).flatten(), reduction="sum").item()
    tail = len(ids) - 1 - (starts[-1] + context)  # the targets no window reached
    if tail:
        with torch.no_grad():
            last = model(torch.tensor(ids[len(ids) - 1 - context : len(ids) - 1])[None])[0, -tail:].double()
        nats += F.cross_entropy(last, torch.tensor(ids[len(ids) - tail :]).long(), reduction="sum").item()
        targets.append(ids[len(ids) - tail :].tolist())
    return nats, [int(t) for row in targets for t in row]


def test_a_sliding_stride_equals_scoring_each_token_alone(run, held_out, capsys):
    argv = ["eval", "--checkpoint", str(run), "--data", str(held_out), "--context-length", "8", "--stride", "3",
            "--max-tokens", "40", "--json", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    model = load_model_file(RunDir(run).checkpoints().path(24)).eval()
    ids = RunDir(run).tokenizer().encode(held_out.read_text(encoding="utf-8"))[:40]
    # By hand: token p is predicted from the window start that first reaches it (0, 3, 6, ... then the end).
    nats, scored = 0.0, set()
    starts = [*range(0, 40 - 8, 3)]
    starts += [40 - 1 - 8] if starts[-1] + 8 < 39 else []
    for start in starts:
        for p in (q for q in range(start + 1, start + 9) if q not in scored):
            with torch.no_grad():
                nats -= F.log_softmax(model(torch.tensor([ids[start:p]]))[0, -1].double(), -1)[ids[p]].item()
            scored.add(p)
    assert (report["tokens"], report["stride"]) == (39, 3)
    assert report["loss"] == pytest.approx(nats / 39, rel=1e-6)


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
        (["--data", "{text}", "--stride", "40"], "--stride 40 exceeds the context length 32"),
        ([], "the following arguments are required: --data"),
        (
            ["--data", "{text}", "--token-dtype", "int8"],
            "--token-dtype: invalid choice: 'int8' (choose from 'uint16', 'uint32')",
        ),
    ],
)
def test_errors_are_one_line(run, held_out, tmp_path, fails, extra, fragment):
    np.save(tmp_path / "bad.npy", np.array([1, 2, 5000], dtype=np.uint16))
    (tmp_path / "binary.txt").write_bytes(b"ab\xff\xfe")
    places = {"missing": tmp_path / "nope.txt", "bad_ids": tmp_path / "bad.npy", "text": held_out,
              "binary": tmp_path / "binary.txt"}  # fmt: skip
    fails(["eval", "--checkpoint", str(run), *(a.format(**places) for a in extra)], fragment)


def test_the_runs_validation_loss_and_bits_per_byte_are_tlm_evals_on_the_same_tokens(run, capsys):
    # The shared run: eval_batches 2 of batch 8, context 32 -> 16 windows, 512 tokens, spread over RUN/data/val.npy.
    final = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "val_loss" in line][-1]
    assert main(["eval", "--checkpoint", str(run), "--data", str(run / "data" / "val.npy"), "--val-tokens", "512",
                 "--json", "--quiet"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert report["tokens"] == 512
    assert report["loss"] == pytest.approx(final["val_loss"], rel=1e-6)
    assert report["bits_per_byte"] == pytest.approx(final["val_bpb"], rel=1e-6)
    assert final["val_bpb"] == pytest.approx(final["val_loss"] / math.log(2) * 512 / report["bytes"], rel=1e-9)
