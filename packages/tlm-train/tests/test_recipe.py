"""train(config) end to end in-process: text → tokenizer → model → run folder → sample; the model's shape from
the [model] table; fine-tuning with init_from; the non-finite stop; checks made before anything is written."""

import json
import math
import random

import numpy as np
import pytest
import torch

from tlm_model import ModelConfig, TransformerLM, load_model_file, save_model_file
from tlm_train import NonFiniteLossError, RunDir, TrainConfig, default_corpus, train
from tlm_train.metrics import TIMING_FIELDS


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_text_data_trains_a_tokenizer_and_writes_every_file(tmp_path, make_config) -> None:
    text = tmp_path / "text.txt"
    text.write_text(default_corpus()[:30_000], encoding="utf-8")
    config = make_config(data=[str(text)], vocab_size=300, eval_interval=2, checkpoint_interval=2)
    result = train(config)
    run = tmp_path / "run"
    saved = TrainConfig.from_toml(run / "train.toml")
    # train.toml records what ran: the model resolved field by field (vocabulary from the tokenizer).
    assert saved == config.replace(model=config.model_config(300).to_dict(drop_none=True))
    assert RunDir(run).tokenizer().vocab_size == 300 and (run / "loss.png").stat().st_size > 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_00000002", "step_00000004"]
    assert sorted(p.name for p in (run / "data").iterdir()) == ["info.json", "train.npy", "val.npy"]
    records = _records(run)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    fields = {"step", "tokens", "train_loss", "lr", "grad_norm", "tokens_per_s", "mfu"}
    assert all(fields <= set(r) for r in records[1:])
    # MFU: the training FLOPs per second over --peak-flops (1e9 here), per logged step.
    from tlm_train.metrics import training_flops_per_token

    per_token = training_flops_per_token(saved.model_config(), 16)
    assert all(r["mfu"] == pytest.approx(per_token * r["tokens_per_s"] / 1e9, rel=1e-12) for r in records[1:])
    assert [s for s, _ in result.val_losses] == [0, 2, 4]
    # An untrained model is close to uniform over the vocabulary.
    assert abs(result.val_losses[0][1] - math.log(300)) < 0.5
    assert isinstance(result.sample, str) and result.sample
    assert not result.interrupted and result.step == 4
    assert load_model_file(run / "checkpoints" / "step_00000004").config.vocab_size == 300


def test_model_fields_as_settings_train_a_gqa_tied_model_and_the_checkpoint_says_so(make_config, tmp_path) -> None:
    config = make_config(model={**make_config().model, "num_heads": 4, "num_kv_heads": 2, "tie_word_embeddings": True})
    train(config)
    model = load_model_file(tmp_path / "run" / "checkpoints" / "step_00000004")
    assert (model.config.num_heads, model.config.kv_heads, model.config.tie_word_embeddings) == (4, 2, True)
    assert model.lm_head.weight is model.token_embeddings.weight
    assert model.state_dict()["layers.0.attn.k_proj.weight"].shape == (2 * 8, 32)  # 2 kv heads of d_head 8


def test_the_same_seed_gives_the_same_run_and_seeds_every_rng(make_config, tmp_path) -> None:
    a = train(make_config(out_dir=str(tmp_path / "a")))
    first = (random.random(), np.random.random(), torch.rand(1).item())  # noqa: NPY002
    b = train(make_config(out_dir=str(tmp_path / "b")))
    second = (random.random(), np.random.random(), torch.rand(1).item())  # noqa: NPY002
    assert first == second  # seed_everything(seed) reached Python's, numpy's and torch's RNGs alike
    assert a.val_losses == b.val_losses
    drop = lambda r: {k: v for k, v in r.items() if k not in TIMING_FIELDS}  # noqa: E731
    assert [drop(r) for r in _records(tmp_path / "a")] == [drop(r) for r in _records(tmp_path / "b")]


def test_nan_loss_names_a_checkpoint_whose_weights_gave_a_finite_loss(tmp_path, make_config) -> None:
    # lr 1e6 (no decay) throws the weights far out after a few steps; the loss then stops being finite.
    config = make_config(lr=1.0e6, min_lr=0.0, warmup_steps=0, weight_decay=0.0, checkpoint_interval=1,
                         keep_checkpoints=1, steps=30, grad_clip=0.0)  # fmt: skip
    with pytest.raises(NonFiniteLossError) as info:
        train(config)
    message = str(info.value)
    failed = int(message.split()[1].rstrip(":"))
    manager = RunDir(tmp_path / "run").checkpoints()
    if "no checkpoint holds weights" in message:
        assert failed <= 2
        return
    good = int(message.split("finite loss is step ")[1].split(":")[0])
    assert good <= failed - 2 and good in manager.steps()  # pruning waited for a finite step after each save
    # The named checkpoint really gives a finite loss on the training data.
    model = load_model_file(manager.path(good))
    ids = torch.from_numpy(np.load(config.data[0])[:17].astype(np.int64))
    assert math.isfinite(float(model.loss(ids[None, :-1], ids[None, 1:])))


def test_a_nan_mid_run_stops_at_the_next_logged_step_with_the_state_from_before_it(tmp_path, make_config, monkeypatch):
    # The device path end to end: step 6's loss is NaN; steps 6 and 7 run on (no raise, no device read); step 8
    # logs, reads the guard and stops with the diverged record naming step 6. The weights, the optimizer state
    # and the schedule are then bit-for-bit those that the checkpoint of step 5 holds, and that checkpoint
    # (the newest) still verifies.
    import tlm_train.step as step_module
    from tlm_train.checkpoint import capture_state
    from tlm_train.distributed import init_distributed
    from tlm_train.recipe import Recipe

    original, calls = step_module.LanguageModelLoss.forward, []

    def forward(self, inputs, targets):
        loss = original(self, inputs, targets)
        if torch.is_grad_enabled():
            calls.append(1)
            if len(calls) == 6:
                return loss * float("nan")
        return loss

    monkeypatch.setattr(step_module.LanguageModelLoss, "forward", forward)
    config = make_config(steps=10, log_interval=4, eval_interval=10, checkpoint_interval=5, keep_checkpoints=1)
    with Recipe(config, init_distributed("cpu")) as recipe:
        with pytest.raises(NonFiniteLossError, match=r"^step 6: training loss is nan, gradient norm nan: stopped "):
            recipe.run()
        assert len(calls) == 8  # steps 7 and 8 ran before the flag was read
        now = capture_state(recipe.model, recipe.optimizer, step=5, scheduler=recipe.scheduler)
    manager = RunDir(tmp_path / "run").checkpoints()
    assert manager.steps() == [5]
    saved = manager.load(5).state  # digests verified on read
    for part in ("model", "optimizer", "scheduler"):
        assert _identical(now[part], saved[part]), part
    record = _records(tmp_path / "run")[-1]
    assert record["event"] == "diverged" and record["step"] == 6
    # Step 6's loss came from step 5's weights, so no kept checkpoint is vouched for (keep_checkpoints=1).
    assert record["message"] == (
        "step 6: training loss is nan, gradient norm nan: stopped before the update; no "
        "checkpoint holds weights that gave a finite loss"
    )


def test_a_resumed_run_that_diverges_names_the_step_counted_from_the_runs_start(tmp_path, make_config, monkeypatch):
    # Resumed at step 4, the second step it trains is step 6: that is the step the stop and its record name.
    import tlm_train.step as step_module

    train(make_config(steps=4, checkpoint_interval=4))
    original, calls = step_module.LanguageModelLoss.forward, []

    def forward(self, inputs, targets):
        loss = original(self, inputs, targets)
        if torch.is_grad_enabled():
            calls.append(1)
            if len(calls) == 2:
                return loss * float("nan")
        return loss

    monkeypatch.setattr(step_module.LanguageModelLoss, "forward", forward)
    with pytest.raises(NonFiniteLossError, match=r"^step 6: training loss is nan, gradient norm nan: stopped "):
        train(make_config(steps=8, checkpoint_interval=4, log_interval=1), resume=True)
    record = _records(tmp_path / "run")[-1]
    assert record["event"] == "diverged" and record["step"] == 6


def _identical(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def test_non_finite_weights_are_never_saved(tmp_path, make_config, monkeypatch) -> None:
    import tlm_train.recipe as recipe

    original = recipe.capture_state

    def poisoned(*args, **kwargs):
        state = original(*args, **kwargs)
        if kwargs["step"] == 3:
            state["model"]["ln_final.weight"] = torch.full_like(state["model"]["ln_final.weight"], float("nan"))
        return state

    monkeypatch.setattr(recipe, "capture_state", poisoned)
    with pytest.raises(NonFiniteLossError, match="step 3: the weights hold NaN or infinite values; .* step 2"):
        train(make_config(checkpoint_interval=1, keep_checkpoints=3))
    assert RunDir(tmp_path / "run").checkpoints().steps() == [1, 2]


def test_an_existing_run_is_refused_without_resume(make_config) -> None:
    config = make_config(steps=2)
    train(config)
    with pytest.raises(ValueError, match="already holds a run: continue it with --resume"):
        train(config)
    assert train(config, resume=True).step == 2  # nothing left to do


@pytest.mark.parametrize(
    ("settings", "error", "message"),
    [
        ({"device": "cuda"} if not torch.cuda.is_available() else {"device": "cuda:99"}, ValueError, "--device cuda"),
        ({"data": ["/nonexistent/x.npy"]}, FileNotFoundError, "no such file"),
        ({"tokenizer": "/nonexistent/tok"}, FileNotFoundError, "--tokenizer /nonexistent/tok: no such folder"),
        ({"init_from": "/nonexistent/run"}, FileNotFoundError, "--init-from /nonexistent/run"),
        ({"distributed": "fsdp"}, ValueError, "--distributed fsdp needs several processes"),
        ({"batch_size": 6, "grad_accum": 4}, ValueError, "must split evenly into grad_accum"),
    ],
)
def test_bad_settings_are_refused_before_anything_is_written(tmp_path, make_config, settings, error, message) -> None:
    with pytest.raises(error, match=message):
        train(make_config(**settings))
    assert not (tmp_path / "run").exists()


def test_two_token_files_are_refused_not_read_as_text(tmp_path, make_config, tokens) -> None:
    other = tmp_path / "more.npy"
    np.save(other, np.zeros(100, dtype=np.uint16))
    with pytest.raises(ValueError, match="one token-id file"):
        train(make_config(data=[str(tokens), str(other)]))
    assert not (tmp_path / "run").exists()


def test_token_file_ids_must_fit_the_vocabulary(make_config) -> None:
    with pytest.raises(ValueError, match=r"holds token ids in \[0, 31\], outside \[0, 16\) \(--vocab-size\)"):
        train(make_config(vocab_size=16))


def test_a_token_file_with_a_tokenizer_keeps_it_and_samples_text(tmp_path, make_config) -> None:
    from tlm_tokenizer import Tokenizer, train_bpe

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(default_corpus()[:20_000], encoding="utf-8")
    tokenizer = Tokenizer(*train_bpe(str(corpus), 300, ["<|endoftext|>"]), ["<|endoftext|>"])
    tokenizer.save(tmp_path / "tok")
    ids = tmp_path / "ids.npy"
    np.save(ids, np.asarray(tokenizer.encode(corpus.read_text()), dtype=np.uint16))
    result = train(make_config(data=[str(ids)], tokenizer=str(tmp_path / "tok"), vocab_size=300))
    assert RunDir(tmp_path / "run").tokenizer().encode("the cat") == tokenizer.encode("the cat")
    assert result.sample is not None and not result.sample.replace(" ", "").isdigit()  # text, not ids


def test_train_toml_records_one_vocabulary_size_the_models(tmp_path, make_config) -> None:
    from tlm_tokenizer import Tokenizer, train_bpe

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(default_corpus()[:20_000], encoding="utf-8")
    Tokenizer(*train_bpe(str(corpus), 300, ["<|endoftext|>"]), ["<|endoftext|>"]).save(tmp_path / "tok")
    # --tokenizer with text: the flag's vocabulary (1024, its default) trains nothing; the model has 300 ids.
    train(make_config(data=[str(corpus)], tokenizer=str(tmp_path / "tok"), vocab_size=1024, steps=1))
    saved = TrainConfig.from_toml(tmp_path / "run" / "train.toml")
    assert saved.vocab_size == saved.model["vocab_size"] == 300


def test_init_from_starts_from_the_weights_and_shape_of_a_model_file(tmp_path, make_config) -> None:
    torch.manual_seed(5)
    source = TransformerLM(ModelConfig(32, 16, 24, 1, 3, 40, num_kv_heads=1, tie_word_embeddings=True))
    save_model_file(source, tmp_path / "source")
    config = make_config(init_from=str(tmp_path / "source"), steps=1, model={}, lr=1e-9, min_lr=0.0, warmup_steps=0)
    result = train(config)
    # Step 0's validation loss is the source model's own on the same windows.
    from tlm_train import EvalBatches, evaluate

    val = np.load(config.data[0], mmap_mode="r")
    val = val[len(val) - max(1, round(len(val) * 0.1)) :]
    expected = evaluate(source, EvalBatches(val, 4, 16, windows=2 * 4)).loss
    assert result.val_losses[0][1] == pytest.approx(expected, rel=1e-6)
    tuned = load_model_file(tmp_path / "run" / "checkpoints" / "step_00000001")
    assert tuned.config == source.config
    assert TrainConfig.from_toml(tmp_path / "run" / "train.toml").model_config() == source.config


def test_init_from_refuses_a_shape_change(tmp_path, make_config) -> None:
    save_model_file(TransformerLM(ModelConfig(32, 16, 24, 1, 3, 40)), tmp_path / "source")
    with pytest.raises(ValueError, match="--d-model 32 differs from the --init-from model's 24"):
        train(make_config(init_from=str(tmp_path / "source")))


def test_bfloat16_autocast_trains_with_float32_weights(tmp_path, make_config) -> None:
    result = train(make_config(dtype="bfloat16", steps=3))
    assert all(math.isfinite(loss) for _, loss in result.val_losses)
    model = load_model_file(tmp_path / "run" / "checkpoints" / "step_00000003")
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_float16_trains_with_loss_scaling_and_saves_the_scaler(tmp_path, make_config) -> None:
    result = train(make_config(dtype="float16", steps=3))
    assert all(math.isfinite(loss) for _, loss in result.val_losses)
    state = RunDir(tmp_path / "run").checkpoints().load(3).state
    assert state["scaler"]["scale"] > 0  # torch.amp.GradScaler's state, restored on resume


@pytest.mark.slow
def test_compile_trains_like_eager(tmp_path, make_config) -> None:
    # --compile (torch.compile of each block, inductor on this device) must change speed, not results:
    # the same seed gives the same losses as eager to float32 rounding, and the checkpoint keeps plain keys.
    from torch._dynamo.utils import counters

    runs, graphs = {}, {}
    for compiled in (False, True):
        out = tmp_path / f"run-{compiled}"
        counters.clear()
        result = train(make_config(out_dir=str(out), steps=3, compile=compiled))
        graphs[compiled] = counters["stats"]["unique_graphs"]
        losses = [r.get("train_loss") for r in _records(out)]
        state = load_model_file(out / "checkpoints" / "step_00000003").state_dict()
        runs[compiled] = (losses[1:], [loss for _, loss in result.val_losses], state)
    (eager_train, eager_val, eager_state), (compiled_train, compiled_val, compiled_state) = runs[False], runs[True]
    assert compiled_train == pytest.approx(eager_train, rel=1e-5, abs=0)
    assert compiled_val == pytest.approx(eager_val, rel=1e-5, abs=0)
    assert compiled_state.keys() == eager_state.keys()
    assert graphs[False] == 0 and graphs[True] >= 1  # the flag really compiled something


def test_an_out_dir_holding_the_token_file_is_refused_before_anything_is_written(tmp_path, make_config, snapshot):
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match=f"--out-dir {tmp_path} holds --data {tmp_path / 'tokens.npy'}"):
        train(make_config(out_dir=str(tmp_path)))
    assert snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["tokens.npy"]


def test_a_warm_up_longer_than_the_run_is_clamped_to_it_with_a_one_line_notice(tmp_path, make_config) -> None:
    lines: list[str] = []
    train(make_config(steps=3, warmup_steps=50, lr=1e-3, log_interval=1), log=lines.append)
    notices = [line for line in lines if "warm" in line]
    assert notices == [
        "--warmup-steps 50 is longer than the run's 3 steps: the learning rate warms up over all 3 and never decays"
    ]
    # The course's warm-up t / T_w · lr at iteration t = step - 1, with T_w the run's 3 steps.
    lrs = [r["lr"] for r in _records(tmp_path / "run") if "lr" in r]
    assert lrs == pytest.approx([0.0, 1e-3 / 3, 2e-3 / 3], rel=1e-12)


FILE_NAMES = (".corpus.txt", "corpus.txt", "metrics.jsonl", "train.toml", "loss.png")
FOLDER_NAMES = ("tokenizer", "data")


def test_symlinks_planted_at_every_name_of_the_run_folder_are_never_followed(tmp_path, make_config, snapshot):
    outside, run = tmp_path / "outside", tmp_path / "run"
    for name in FILE_NAMES:
        (outside / "files").mkdir(parents=True, exist_ok=True)
        (outside / "files" / name).write_text(f"the user's own {name}\n")
    for name in FOLDER_NAMES:  # a tokenizer.json there would be replaced if the link were followed
        (outside / name).mkdir()
        (outside / name / "tokenizer.json").write_text(f"the user's own {name} folder\n")
    before = snapshot(outside)
    run.mkdir()
    for name in FILE_NAMES:
        (run / name).symlink_to(outside / "files" / name)
    for name in FOLDER_NAMES:
        (run / name).symlink_to(outside / name, target_is_directory=True)
    text = tmp_path / "text.txt"
    text.write_text(default_corpus()[:20_000], encoding="utf-8")
    train(make_config(data=[str(text)], vocab_size=280, steps=2, checkpoint_interval=1, sample_tokens=0))
    assert snapshot(outside) == before
    assert RunDir(run).checkpoints().steps() == [1, 2] and len(_records(run)) == 3
    for name in ("metrics.jsonl", "train.toml", "loss.png", "tokenizer", "data", "checkpoints"):
        assert not (run / name).is_symlink(), name  # replaced by the run's own file or folder


@pytest.mark.parametrize(
    ("name", "what"),
    [(".lock", "follows one"), ("checkpoints", "writes through one"), ("tensorboard", "writes through one")],
)
def test_a_symlink_at_the_lock_or_the_checkpoints_is_refused_in_one_line(tmp_path, make_config, snapshot, name, what):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("precious\n")
    before = snapshot(victim)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / name).symlink_to(victim / "precious.txt" if name == ".lock" else victim)
    with pytest.raises(ValueError, match=rf"^\S+/run/{name} is a symbolic link: tlm train never {what}; remove it"):
        train(make_config())
    assert snapshot(victim) == before and sorted(p.name for p in (tmp_path / "run").iterdir()) == [name]


@pytest.mark.parametrize("resume", [True, False])
def test_a_run_folder_of_the_earlier_layout_is_refused_never_restarted(tmp_path, make_config, snapshot, resume):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for step in (100, 200):  # tlm-train 0.1's checkpoint files
        torch.save({"iteration": step}, run / "checkpoints" / f"step_{step:08d}.pt")
    RunDir(run).write_config(make_config())
    (run / "metrics.jsonl").write_text('{"step": 200, "train_loss": 1.5}\n')
    before = snapshot(run)
    with pytest.raises(
        ValueError,
        match=r"is a tlm-train 0.1 run \(2 checkpoints/step_N.pt files, the newest "
        r"step_00000200.pt\), which this version cannot read, so it is neither resumed nor overwritten",
    ):
        train(make_config(), resume=resume)
    assert snapshot(run) == before
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "metrics.jsonl", "train.toml"]


def test_val_tokens_are_scored_in_whole_windows_spread_over_the_validation_data() -> None:
    # --val-tokens' help: "in whole windows of the context spread evenly over the whole validation data"; 40 tokens
    # at a context of 16 are ceil(40 / 16) = 3 windows, the i-th of the 12 that fit taken at window i·12 // 3
    # (EvalBatches' docstring). The batches alone are built, on a stand-in recipe: no model, no training.
    from types import SimpleNamespace

    from tlm_train.recipe import Recipe

    val = np.arange(200, dtype=np.uint16)  # (200 - 1) // 16 = 12 whole windows of 16 (+1 target) fit
    stand_in = SimpleNamespace(
        config=TrainConfig(batch_size=4, grad_accum=1, val_tokens=40),
        info=SimpleNamespace(world_size=1, rank=0, device=torch.device("cpu")),
        data=SimpleNamespace(train=np.arange(500, dtype=np.uint16), val=val, rows=False, tokenizer=None),
        model_config=ModelConfig(vocab_size=500, context_length=16, d_model=16, num_layers=1, num_heads=2, d_ff=32),
    )
    Recipe._build_batches(stand_in)
    assert stand_in.val_batches.starts.tolist() == [16 * (i * 12 // 3) for i in range(3)] == [0, 64, 128]
    assert stand_in.val_scored == 3 * 16 and stand_in.val_total == 200
    # Without --val-tokens: eval_batches micro-batches of windows (here more than fit: all 12).
    stand_in.config = TrainConfig(batch_size=4, grad_accum=1, eval_batches=8)
    Recipe._build_batches(stand_in)
    assert stand_in.val_scored == 12 * 16
