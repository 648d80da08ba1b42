"""train(config) end to end in-process (text → tokenizer → model → files → sample), its failure
modes, the TOML settings and the command line's error paths."""

import json
import math
import sys

import numpy as np
import pytest
import torch

from tlm_train import MetricsLog, NonFiniteLossError, TrainConfig, default_corpus, plot_loss_curve, train
from tlm_train.cli import main

TINY = {"context_length": 16, "d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 64, "batch_size": 4}
TINY |= {"eval_batches": 2, "peak_flops": 1e9, "warmup_steps": 1, "sample_tokens": 8}


@pytest.fixture
def tokens(tmp_path):
    path = tmp_path / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, 32, 2000).astype(np.uint16))
    return path


def test_text_data_trains_a_tokenizer_and_writes_every_file(tmp_path) -> None:
    text = tmp_path / "text.txt"
    text.write_text(default_corpus()[:30_000], encoding="utf-8")
    config = TrainConfig(out_dir=str(tmp_path / "run"), data=[str(text)], vocab_size=300, steps=4, **TINY)
    config.eval_interval = config.checkpoint_interval = 2
    result = train(config)
    run = tmp_path / "run"
    assert TrainConfig.from_toml(run / "train.toml") == config
    assert (run / "tokenizer").is_dir() and (run / "loss.png").stat().st_size > 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002.pt", "step_00000004.pt"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    fields = {"step", "tokens", "train_loss", "lr", "grad_norm", "tokens_per_s", "mfu"}
    assert all(fields <= set(r) for r in records[1:])
    assert [s for s, _ in result.val_losses] == [0, 2, 4]
    # An untrained model is close to uniform over the vocabulary.
    assert abs(result.val_losses[0][1] - math.log(300)) < 0.5
    assert isinstance(result.sample, str) and result.sample
    assert not result.interrupted and result.step == 4


def test_default_corpus_needs_no_download() -> None:
    text = default_corpus()
    assert len(text) > 300_000 and text.count("<|endoftext|>") > 50


def test_nan_loss_stops_with_a_clear_message_and_keeps_the_last_checkpoint(tmp_path, tokens) -> None:
    # lr 1e20 throws the weights to ~1e20 after one step; the next loss is not finite.
    config = TrainConfig(out_dir=str(tmp_path / "run"), data=[str(tokens)], vocab_size=32, steps=5, **TINY)
    config.lr, config.min_lr, config.warmup_steps, config.checkpoint_interval = 1e20, 0.0, 0, 1
    config.weight_decay = 0.0
    with pytest.raises(NonFiniteLossError, match=r"step 2: training loss is (nan|inf).*last good checkpoint is step 1"):
        train(config)
    state = torch.load(tmp_path / "run" / "checkpoints" / "step_00000001.pt", weights_only=True)
    assert state["step"] == 1


def test_an_existing_run_is_refused_without_resume(tmp_path, tokens) -> None:
    config = TrainConfig(out_dir=str(tmp_path / "run"), data=[str(tokens)], vocab_size=32, steps=2, **TINY)
    train(config)
    with pytest.raises(ValueError, match="already holds checkpoints: pass --resume"):
        train(config)
    assert train(config, resume=True).step == 2  # nothing left to do


def test_token_file_ids_must_fit_the_vocabulary(tmp_path, tokens) -> None:
    config = TrainConfig(out_dir=str(tmp_path / "run"), data=[str(tokens)], vocab_size=16, steps=2, **TINY)
    with pytest.raises(ValueError, match="holds token id 31, outside vocab_size=16"):
        train(config)


def test_toml_round_trip_and_bad_settings(tmp_path) -> None:
    config = TrainConfig(data=["a b.txt", 'q"uote.txt'], lr=1e-4, max_tokens=1000, compile=True)
    path = tmp_path / "c.toml"
    path.write_text(config.to_toml())
    assert TrainConfig.from_toml(path) == config
    assert TrainConfig.from_toml(path, steps=7).steps == 7
    path.write_text("stepz = 3\n")
    with pytest.raises(ValueError, match=r"unknown training settings \['stepz'\]"):
        TrainConfig.from_toml(path)
    path.write_text("steps = [\n")
    with pytest.raises(ValueError, match="is not valid TOML"):
        TrainConfig.from_toml(path)
    with pytest.raises(TypeError, match=r"TrainConfig.steps must be an int, got str \('3'\)"):
        TrainConfig(steps="3")
    with pytest.raises(ValueError, match="TrainConfig.distributed must be one of"):
        TrainConfig(distributed="zero3")
    with pytest.raises(ValueError, match=r"min_lr \(0.1\) must not exceed lr \(0.01\)"):
        TrainConfig(lr=0.01, min_lr=0.1)


def test_metrics_truncate_and_the_plot_without_matplotlib(tmp_path, monkeypatch) -> None:
    log = MetricsLog(tmp_path / "m.jsonl")
    for step in range(5):
        log.append({"step": step, "train_loss": 1.0 / (step + 1)})
    with (tmp_path / "m.jsonl").open("a") as file:
        file.write('{"step": 5, "tr')  # a line cut short by SIGKILL
    assert [r["step"] for r in log.read()] == [0, 1, 2, 3, 4]
    log.truncate(2)
    assert [r["step"] for r in log.read()] == [0, 1, 2]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert plot_loss_curve(tmp_path / "m.jsonl", tmp_path / "loss.png") is None
    assert not (tmp_path / "loss.png").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "TrainConfig.steps must be >= 1, got 0"),
        (["--resume", "/nonexistent/run"], "no train.toml there"),
        (["--config", "/nonexistent/c.toml"], "--config /nonexistent/c.toml: no such file"),
        (["--data", "/nonexistent/x.npy"], "no such token file"),
        (["--data", "/nonexistent/x.txt"], "no such text file"),
    ],
)
def test_cli_user_errors_are_one_line_exit_2(argv, message, tmp_path, capsys) -> None:
    assert main(["train", "--out-dir", str(tmp_path / "run"), "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_cli_trains_and_prints_a_sample(tmp_path, tokens, capsys) -> None:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    argv = ["train", "--data", str(tokens), "--vocab-size", "32", "--steps", "2", "--out-dir", str(tmp_path / "r")]
    assert main([*argv, *flags]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("sample: ")
    assert "step 0: validation loss" in captured.err


def test_bfloat16_autocast_trains(tmp_path, tokens) -> None:
    config = TrainConfig(out_dir=str(tmp_path / "run"), data=[str(tokens)], vocab_size=32, steps=3, **TINY)
    config.dtype = "bfloat16"
    result = train(config)
    assert all(math.isfinite(loss) for _, loss in result.val_losses)
    weights = torch.load(tmp_path / "run" / "checkpoints" / "step_00000003.pt", weights_only=True)["model"]
    assert all(t.dtype == torch.float32 for t in weights.values())  # autocast: weights stay float32


def test_warmup_longer_than_the_run_is_refused(tmp_path, tokens) -> None:
    config = TrainConfig(out_dir=str(tmp_path / "run"), data=[str(tokens)], vocab_size=32, steps=3, **TINY)
    config.warmup_steps = 5
    with pytest.raises(ValueError, match=r"warmup_steps \(5\) must not exceed the run's 3 steps"):
        train(config)


@pytest.mark.slow  # a real torch.compile of the training step (C++ kernels)
def test_compile_trains_like_eager(tmp_path, tokens) -> None:
    # --compile (torch.compile of each block, inductor on this device) must change speed, not results:
    # the same seed gives the same losses as eager to float32 rounding, and the checkpoint keeps plain keys.
    from torch._dynamo.utils import counters

    runs, graphs = {}, {}
    for compiled in (False, True):
        out = tmp_path / f"run-{compiled}"
        config = TrainConfig(out_dir=str(out), data=[str(tokens)], vocab_size=32, steps=3, compile=compiled, **TINY)
        counters.clear()
        result = train(config)
        graphs[compiled] = counters["stats"]["unique_graphs"]
        losses = [json.loads(line).get("train_loss") for line in (out / "metrics.jsonl").read_text().splitlines()]
        state = torch.load(out / "checkpoints" / "step_00000003.pt", weights_only=True)
        runs[compiled] = (losses[1:], [loss for _, loss in result.val_losses], state)
    (eager_train, eager_val, eager_state), (compiled_train, compiled_val, compiled_state) = runs[False], runs[True]
    assert compiled_train == pytest.approx(eager_train, rel=1e-5, abs=0)
    assert compiled_val == pytest.approx(eager_val, rel=1e-5, abs=0)
    assert compiled_state["model"].keys() == eager_state["model"].keys()
    assert graphs[False] == 0 and graphs[True] >= 1  # the flag really compiled something
