"""``tlm train``: flags for every setting and every model field, one-line errors before anything is written,
resume refusals that leave the run untouched."""

import gzip
import json
import sys

import numpy as np
import pytest
import torch

from tlm_command.main import main
from tlm_model import load_model_file
from tlm_train import RunDir, TrainConfig

SMALL = ["--context-length", "16", "--d-model", "32", "--num-layers", "1", "--num-heads", "4", "--d-ff", "48",
         "--batch-size", "4", "--eval-batches", "1", "--peak-flops", "1e9", "--warmup-steps", "1",
         "--sample-tokens", "4", "--steps", "2"]  # fmt: skip


@pytest.fixture
def tokens(tmp_path):
    path = tmp_path / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, 32, 2000).astype(np.uint16))
    return path


def test_gqa_and_tied_embeddings_from_flags_and_the_checkpoint_says_so(tmp_path, tokens, capsys):
    out = tmp_path / "run"
    argv = [
        "train",
        "--data",
        str(tokens),
        "--vocab-size",
        "32",
        "--out-dir",
        str(out),
        *SMALL,
        "--num-kv-heads",
        "2",
        "--tie-word-embeddings",
        "--rope-scaling",
        '{"rope_type": "linear", "factor": 2.0}',
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("sample: ") and "step 0: validation loss" in captured.err
    model = load_model_file(RunDir(out).checkpoints().path(2))
    assert (model.config.kv_heads, model.config.tie_word_embeddings) == (2, True)
    assert model.config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    saved = TrainConfig.from_toml(out / "train.toml")
    assert saved.model["num_kv_heads"] == 2 and saved.model["tie_word_embeddings"] is True


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps must be positive, got 0"),
        (["--lr", "1e30"], "--lr × weight_decay must be < 1"),
        (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
        (["--sample-temperature", "-1"], "--sample-temperature must be a finite number >= 0, got -1"),
        (["--device", "quantum"], "--device must be a torch device such as cpu, cuda or cuda:1, got 'quantum'"),
        (["--d-model", "30"], "--d-model must be divisible by num_heads"),
        (["--num-kv-heads", "3"], "--num-kv-heads must divide num_heads"),
        (["--rope-scaling", "[1]"], "--rope-scaling: must be a JSON object"),
        (["--resume", "/nonexistent/run"], "--resume /nonexistent/run: not a tlm train run folder"),
        (["--config", "/nonexistent/c.toml"], "--config /nonexistent/c.toml: no such file"),
        (["--data", "/nonexistent/x.npy"], "--data /nonexistent/x.npy: no such file"),
        (["--data", "/dev/zero"], "--data /dev/zero: a character device, expected a regular file"),
        (["--data", "{tmp}"], "--data {tmp}: a folder, expected a regular file"),
        (["--max-data-bytes", "0"], "--max-data-bytes must be positive, got 0"),
        (["--data", "{tokens}", "{tokens}"], "one token-id file"),
        (["--tokenizer", "/nonexistent/tok"], "--tokenizer /nonexistent/tok: no such folder"),
    ]
    + (
        [(["--device", "cuda"], "--device cuda: this torch has no CUDA device")]
        if not torch.cuda.is_available()
        else []
    ),
)
def test_user_errors_are_one_line_exit_2_and_write_nothing(tmp_path, tokens, fails, argv, message):
    out = tmp_path / "run"
    argv = [a.format(tokens=tokens, tmp=tmp_path) for a in argv]
    fails(["train", "--out-dir", str(out), "--quiet", *SMALL, *argv], message.format(tmp=tmp_path))
    assert not out.exists()


@pytest.mark.parametrize(("flag", "module"), [("--wandb", "wandb"), ("--tensorboard", "tensorboard")])
def test_a_logger_whose_library_is_missing_is_one_line_and_writes_nothing(tmp_path, tokens, fails, monkeypatch,
                                                                          flag, module):  # fmt: skip
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed: find_spec says None, import raises
    out = tmp_path / "run"
    argv = ["train", "--data", str(tokens), "--out-dir", str(out), "--quiet", *SMALL, flag]
    fails(argv, f"{flag} needs the {module} package: pip install 'tlm-train[{module}]'")
    assert not out.exists()


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        ("cut.txt.gz", lambda: gzip.compress(b"some text " * 500)[:-40], "truncated gzip data"),
        ("plain.zst", lambda: b"plain text, not Zstandard\n" * 20, "not Zstandard data"),
        ("gz.txt", lambda: gzip.compress(b"some text " * 500), "holds gzip-compressed data"),
        ("big.txt", lambda: b"some text " * 500, "the corpus passed --max-data-bytes 1,000 "),
    ],
)
def test_a_hostile_data_file_is_one_line_naming_it_and_the_run_keeps_no_data(tmp_path, fails, name, data, message):
    path, out = tmp_path / name, tmp_path / "run"
    path.write_bytes(data())
    fails(["train", "--data", str(path), "--out-dir", str(out), "--quiet", "--max-data-bytes", "1000", *SMALL],
          f"tlm: error: --data {path}: {message}")  # fmt: skip
    assert not (out / "data").exists() and not (out / "tokenizer").exists()


@pytest.mark.parametrize("flag", ["--init-from", "--tokenizer"])
def test_an_out_dir_that_is_its_own_input_is_refused_in_one_line(tmp_path, small_checkpoint, fails, flag):
    from tlm_tokenizer import Tokenizer

    if flag == "--init-from":
        folder = small_checkpoint[1]
    else:
        folder = tmp_path / "tok"
        Tokenizer({i: bytes([i]) for i in range(256)}, []).save(folder)
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    fails(["train", flag, str(folder), "--out-dir", str(folder), "--quiet", *SMALL], f"--out-dir {folder} is {flag}")
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before


def test_resume_with_a_changed_shape_is_refused_in_one_line_and_the_run_is_untouched(
    tmp_path, tokens, fails, monkeypatch
):
    out = tmp_path / "run"
    assert main(["train", "--data", str(tokens), "--vocab-size", "32", "--out-dir", str(out), "--quiet", *SMALL]) == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    fails(["train", "--resume", str(out), "--d-model", "64", "--quiet"], "--d-model 64 differs from the run's 32")
    fails(["train", "--resume", str(out), "--config", "x.toml"], "--config does not apply")
    other = tmp_path / "other"
    fails(["train", "--resume", str(out), "--out-dir", str(other), "--quiet"],
          f"--out-dir {other} differs from the run being resumed ({out})")  # fmt: skip
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before and not other.exists()
    # A change the run can honour: four more steps with another floor; train.toml records it. Naming the run's own
    # folder as --out-dir (here by a relative path) is no conflict.
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--resume", str(out), "--out-dir", "run", "--steps", "4", "--min-lr", "1e-4", "--quiet"]) == 0
    saved = TrainConfig.from_toml(out / "train.toml")
    assert (saved.steps, saved.min_lr) == (4, 1e-4) and RunDir(out).checkpoints().steps()[-1] == 4
    # A run moved elsewhere resumes where it now is, not where its train.toml first said.
    moved = out.rename(tmp_path / "moved")
    assert main(["train", "--resume", str(moved), "--steps", "5", "--quiet"]) == 0
    assert not out.exists() and RunDir(moved).checkpoints().steps()[-1] == 5
    assert TrainConfig.from_toml(moved / "train.toml").out_dir == str(moved)


def test_resume_from_a_step_folder(tmp_path, tokens, capsys):
    out = tmp_path / "run"
    argv = ["train", "--data", str(tokens), "--vocab-size", "32", "--out-dir", str(out), "--quiet", *SMALL]
    assert main([*argv, "--checkpoint-interval", "1", "--keep-checkpoints", "5"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(RunDir(out).checkpoints().path(1))]) == 0
    # From step 1, not from the newest step (2), which it trains again.
    assert "tlm: removed the checkpoints after step 1 (steps [2]): this run replaces them" in capsys.readouterr().err
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines if "train_loss" in line] == [1, 2]


def test_a_diverging_run_stops_with_one_line_and_exit_1(tmp_path, tokens, capsys):
    argv = ["train", "--data", str(tokens), "--vocab-size", "32", "--out-dir", str(tmp_path / "run"), "--quiet", *SMALL,
            "--lr", "1e6", "--weight-decay", "0", "--grad-clip", "0", "--warmup-steps", "0", "--steps", "40",
            "--checkpoint-interval", "1"]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tlm: error: step ") and "Traceback" not in err
    assert "training loss is" in err or "the weights hold NaN" in err


# CS336 §7's ablations, each one flag: it trains, the checkpoint carries it and round-trips, generate and eval read
# it, and the HF export refuses it in one line naming the field (a Llama is pre-norm, RoPE and SwiGLU).
ABLATION_FLAGS = [
    (["--norm-placement", "post"], "norm_placement", "post"),
    (["--norm-placement", "none"], "norm_placement", "none"),
    (["--positions", "none"], "positions", "none"),
    (["--ffn", "silu", "--d-ff", "128"], "ffn", "silu"),  # 4·d_model, the course's SiLU width
]


@pytest.mark.parametrize(("flags", "field", "value"), ABLATION_FLAGS, ids=[" ".join(f[0][:2]) for f in ABLATION_FLAGS])
def test_an_ablation_trains_round_trips_generates_evaluates_and_is_refused_by_the_hf_export(
    flags, field, value, tmp_path, tokens, fails, capsys
):
    from tlm_model import load_model_file, save_model_file

    out = tmp_path / "run"
    assert main(["train", "--data", str(tokens), "--vocab-size", "32", "--out-dir", str(out), "--quiet", *SMALL,
                 *flags]) == 0  # fmt: skip
    assert TrainConfig.from_toml(out / "train.toml").model[field] == value
    model = load_model_file(RunDir(out).checkpoints().path(2)).eval()
    assert getattr(model.config, field) == value
    again = load_model_file(save_model_file(model, tmp_path / "again"))
    assert again.config == model.config
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values(), strict=True))

    # Greedy generation (KV-cached in the command) against recomputing the whole sequence at every step.
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(out), "--prompt-ids", "3 1 4", "--max-new-tokens", "6",
                 "--temperature", "0", "--json"]) == 0  # fmt: skip
    ids = [3, 1, 4]
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert json.loads(capsys.readouterr().out)["ids"] == ids[3:]

    # One window of context + 1 tokens: the mean next-token cross-entropy of the model's logits.
    window = np.load(tokens)[:17]
    np.save(tmp_path / "window.npy", window)
    assert main(["eval", "--checkpoint", str(out), "--data", str(tmp_path / "window.npy"), "--json", "--quiet"]) == 0
    ids = torch.from_numpy(window.astype(np.int64))
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(ids[:-1][None])[0], ids[1:]).item()
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(expected, rel=1e-6)

    fails(["convert", "--to-hf", str(out), "--out", str(tmp_path / "hf")], f"ModelConfig.{field}={value!r}")
    assert not (tmp_path / "hf").exists()


def test_a_logger_that_failed_is_one_line_and_its_own_exit_status(tmp_path, tokens, capsys, monkeypatch):
    import tlm_train
    from tlm_train.loggers import LoggerError

    def fails(config, **kwargs):
        error = LoggerError("tensorboard", OSError(28, "No space left on device"))
        error.args = (f"{error}; stopped at step 3: checkpoint RUN/checkpoints/step_00000003",)
        raise error

    monkeypatch.setattr(tlm_train, "train", fails)
    status = main(["train", "--data", str(tokens), "--out-dir", str(tmp_path / "run"), "--tensorboard", *SMALL])
    assert status == 74
    assert capsys.readouterr().err == (
        "tlm: error: the tensorboard logger failed: OSError: [Errno 28] No space left on device; stopped at step 3: "
        "checkpoint RUN/checkpoints/step_00000003\n"
    )


def test_a_busy_machine_trains_on_the_free_cores_and_says_so_in_one_line(tmp_path, tokens, capsys, monkeypatch):
    # The load figure is injected: three other processes busy on a 2-CPU machine, OMP_NUM_THREADS unset.
    import os

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0, 3.0, 3.0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        argv = ["train", "--data", str(tokens), "--vocab-size", "32", *SMALL]
        assert main([*argv, "--out-dir", str(tmp_path / "run")]) == 0
        threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(previous)
    err = capsys.readouterr().err
    busy = [line for line in err.splitlines() if "the machine is busy" in line]
    assert threads == 1 and len(busy) == 1, err
    assert "load 3.0 on 2 CPUs" in busy[0] and "OMP_NUM_THREADS=1" in busy[0]
    # With OMP_NUM_THREADS set, the user's count stands and nothing is said.
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    try:
        assert main([*argv, "--out-dir", str(tmp_path / "run2")]) == 0
        threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(previous)
    assert threads == 2 and "the machine is busy" not in capsys.readouterr().err


def test_val_tokens_spread_over_the_validation_data_and_tlm_eval_scores_the_same(tmp_path, tokens, capsys):
    out, held = tmp_path / "run", tmp_path / "held.npy"
    np.save(held, np.random.default_rng(1).integers(0, 32, 200).astype(np.uint16))
    argv = ["train", "--data", str(tokens), "--val-data", str(held), "--vocab-size", "32", "--out-dir", str(out),
            *SMALL, "--val-tokens", "40"]  # fmt: skip
    assert main(argv) == 0
    err = capsys.readouterr().err
    # 40 tokens in whole windows of 16: 3 windows, 48 tokens, spread over the 200 held out.
    assert "on 48 tokens in windows spread over the 200 of the validation data (--val-tokens)" in err, err
    assert "step 2: validation loss" in err and "(48 tokens)" in err, err
    final = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert final["step"] == 2 and "val_loss" in final
    assert main(["eval", "--checkpoint", str(out), "--data", str(held), "--val-tokens", "40", "--json", "--quiet"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tokens"] == 48 and report["loss"] == pytest.approx(final["val_loss"], rel=1e-6)
    # An independent computation: windows 0, 4 and 8 of the 12 (i * 12 // 3), scored with F.cross_entropy.
    val = np.load(held).astype(np.int64)
    model = load_model_file(RunDir(out).checkpoints().path(2))
    starts = [16 * (i * 12 // 3) for i in range(3)]
    assert len(val) == 200 and (len(val) - 16 + 15) // 16 == 12  # 12 windows of 16 (+1 target) fit
    inputs = torch.tensor(np.stack([val[s : s + 16] for s in starts]))
    targets = torch.tensor(np.stack([val[s + 1 : s + 17] for s in starts]))
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(inputs).double().flatten(0, 1), targets.flatten()).item()
    assert final["val_loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow  # three short trainings
def test_auto_resume_starts_a_new_run_continues_one_and_is_implied_in_a_requeued_slurm_job(
    tmp_path, monkeypatch, fails
) -> None:
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.tile(np.arange(48, dtype=np.uint16), 30))
    run = tmp_path / "run"
    argv = ["train", "--out-dir", str(run), "--data", str(tokens), "--vocab-size", "48", "--batch-size", "4",
            "--context-length", "16", "--d-model", "32", "--num-layers", "1", "--num-heads", "2", "--d-ff", "64",
            "--sample-tokens", "0", "--peak-flops", "1e9", "--eval-batches", "1", "--quiet"]  # fmt: skip
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert main([*argv, "--steps", "2", "--auto-resume"]) == 0  # nothing there yet: a new run
    assert RunDir(run).checkpoints().steps() == [2]
    fails([*argv, "--steps", "4"], "already holds a run")  # without it, as before
    assert main([*argv, "--steps", "4", "--auto-resume"]) == 0  # the same command, more steps: continued
    assert RunDir(run).checkpoints().steps()[-1] == 4
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # a requeued job runs its script again
    assert main([*argv, "--steps", "6"]) == 0
    assert RunDir(run).checkpoints().steps()[-1] == 6
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps[-1] == 6  # one history, resumed twice


def test_auto_resume_is_a_flag_that_hands_the_run_to_its_resume(tmp_path, tokens, monkeypatch):
    # docs/slurm.sbatch runs `tlm train --distributed ddp --auto-resume --out-dir ...`: the flag takes no value, and
    # what its resume decides (here: "continue") is what train() is called with. train() itself is a stand-in;
    # the slow test above runs the real one.
    import tlm_command.train as command
    import tlm_train

    calls = []

    def auto_resume(config, *, quiet):
        calls.append(("auto_resume", config.out_dir, quiet))
        return config, True

    def train(config, *, resume, **kwargs):
        calls.append(("train", resume))
        return type("Result", (), {"sample": None, "interrupted": False})()

    monkeypatch.setattr(command, "_auto_resume", auto_resume)
    monkeypatch.setattr(tlm_train, "train", train)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)  # not a requeued job: only the flag asks
    run = str(tmp_path / "run")
    argv = ["train", "--data", str(tokens), "--vocab-size", "32", *SMALL, "--quiet"]
    assert main([*argv, "--auto-resume", "--out-dir", run]) == 0
    assert calls == [("auto_resume", run, True), ("train", True)]
    calls.clear()
    assert main([*argv, "--out-dir", run]) == 0  # without it: a new run, no resume asked
    assert calls == [("train", False)]
