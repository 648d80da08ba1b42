"""LoRA fine-tuning runs (``lora_rank``): the base frozen and never saved, AdamW holding the adapters only,
step folders holding the adapters and the base's identity, a bit-exact resume that refuses another base,
and the run opening (merged) wherever a model is read."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import tlm_artifacts as artifacts
from tlm_artifacts.layout import ADAPTER_NAME, STATE_NAME
from tlm_lora import weights_sha256
from tlm_train import ResumeError, RunDir, TrainConfig, train

MODEL = {"context_length": 16, "d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 64}
COMMON = dict(vocab_size=48, batch_size=4, eval_batches=2, peak_flops=1e9, warmup_steps=1, sample_tokens=0, seed=3)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    np.save(path, np.tile(np.random.default_rng(0).integers(0, 48, 40), 30).astype(np.uint16))
    return path


@pytest.fixture(scope="module")
def base(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pretrained run (full training, 3 steps) to adapt."""
    out = tmp_path_factory.mktemp("base") / "run"
    train(TrainConfig(data=[str(data)], out_dir=str(out), steps=3, model=dict(MODEL), **COMMON))
    return out


def lora_config(data: Path, base: Path, out: Path, **changes) -> TrainConfig:
    settings = dict(
        data=[str(data)], out_dir=str(out), init_from=str(base), steps=6, checkpoint_interval=3, eval_interval=3,
        grad_accum=2, lora_rank=4, lora_alpha=8.0, lora_targets="q,v,o,w2", lora_dropout=0.1, **COMMON,
    )  # fmt: skip
    return TrainConfig(**{**settings, **changes})


@pytest.fixture(scope="module")
def lora_run(data: Path, base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lora") / "run"
    train(lora_config(data, base, out))
    return out


def test_a_lora_run_saves_the_adapters_and_the_base_identity_and_trains_only_them(lora_run: Path, base: Path):
    checkpoint = RunDir(lora_run).checkpoints().load(6)
    assert sorted(p.name for p in checkpoint.path.iterdir()) == [ADAPTER_NAME, STATE_NAME]
    state = checkpoint.state
    base_model, _ = artifacts.load_model(artifacts.resolve(base), dtype=torch.float32)
    assert state["lora"] == {
        "rank": 4, "alpha": 8.0, "targets": "q,v,o,w2", "dropout": 0.1,
        "base": {"path": str(base.resolve()), "sha256": weights_sha256(base_model.state_dict())},
    }  # fmt: skip
    # 2 layers x (q, v, o, w2) x (A, B), and AdamW's moments for exactly those (and nothing of the base).
    assert len(state["model"]) == 16 and all(".lora_" in k for k in state["model"])
    assert set(state["optimizer"]["state"]) == set(state["model"])
    assert all(t.abs().sum() > 0 for k, t in state["model"].items() if ".lora_B." in k)  # B moved off zero
    # The run opens as its base with the adapters merged: different from the base, base weights elsewhere.
    merged, step = artifacts.load_model(artifacts.resolve(lora_run))
    assert step == 6
    mine, theirs = merged.state_dict(), base_model.state_dict()
    assert torch.equal(mine["layers.0.attn.k_proj.weight"], theirs["layers.0.attn.k_proj.weight"])
    assert not torch.equal(mine["layers.0.attn.q_proj.weight"], theirs["layers.0.attn.q_proj.weight"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_lora_run_resumes_bit_exactly(dtype: str, data: Path, base: Path, lora_run: Path, tmp_path: Path):
    if dtype != "float32":  # autocast on the CPU; its own uninterrupted reference
        lora_run = tmp_path / "reference"
        train(lora_config(data, base, lora_run, dtype=dtype))
    out = tmp_path / "run"
    shutil.copytree(lora_run, out)
    # From the step-3 checkpoint (the steps after it abandoned): the base re-read, the adapters, AdamW's
    # moments, the schedule, the sampler and the dropout RNG restored.
    train(lora_config(data, base, out, dtype=dtype), resume_from=3)
    got, want = (RunDir(r).checkpoints().load(6).state for r in (out, lora_run))
    assert got["model"].keys() == want["model"].keys()
    assert all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"])
    for name, entries in want["optimizer"]["state"].items():
        for key, value in entries.items():
            assert torch.equal(torch.as_tensor(got["optimizer"]["state"][name][key]), torch.as_tensor(value))


def test_a_resume_on_another_base_is_refused_before_anything_is_written(data, base, tmp_path, snapshot):
    out = tmp_path / "run"
    moved = tmp_path / "base"
    shutil.copytree(base, moved)
    train(lora_config(data, moved, out, steps=3))
    # The same path, other weights: a base retrained in place.
    train(TrainConfig(data=[str(data)], out_dir=str(tmp_path / "other"), steps=3, model=dict(MODEL),
                      **{**COMMON, "seed": 9}))  # fmt: skip
    shutil.rmtree(moved)
    shutil.copytree(tmp_path / "other", moved)
    before = snapshot(out)
    with pytest.raises(ResumeError, match="not the base model its adapters were trained on"):
        train(lora_config(data, moved, out), resume=True)
    assert snapshot(out) == before
    with pytest.raises(ValueError, match="not the one its adapters were trained on"):
        artifacts.load_model(artifacts.resolve(out))


def test_lora_settings_are_checked_at_the_boundary(data: Path, base: Path, tmp_path: Path):
    with pytest.raises(ValueError, match="lora_rank adapts a trained model"):
        TrainConfig(data=[str(data)], lora_rank=4)
    with pytest.raises(ValueError, match=r"lora_targets: targets: unknown roles \['qq'\]"):
        lora_config(data, base, tmp_path / "run", lora_targets="q,qq")
    with pytest.raises(ValueError, match="lora_rank must be"):
        lora_config(data, base, tmp_path / "run", lora_rank=-1)
    with pytest.raises(ValueError, match="--lora-rank 33 is more than the --init-from model's d_model 32"):
        train(lora_config(data, base, tmp_path / "run", lora_rank=33))


def test_a_lora_run_on_a_token_file_keeps_the_bases_vocabulary(data: Path, base: Path, tmp_path: Path):
    # No tokenizer anywhere (the base trained on token ids): the ids are held to the base's vocabulary (48), not
    # to --vocab-size's default, and nothing grows.
    settings = {k: v for k, v in COMMON.items() if k != "vocab_size"}
    lines: list[str] = []
    config = TrainConfig(data=[str(data)], out_dir=str(tmp_path / "run"), init_from=str(base), steps=1,
                         lora_rank=2, **settings)  # fmt: skip
    train(config, log=lines.append)
    assert artifacts.model_config(artifacts.resolve(tmp_path / "run")).vocab_size == 48
    assert not [line for line in lines if "vocabulary grows" in line], lines
    wide = tmp_path / "wide.npy"
    np.save(wide, np.arange(60, dtype=np.uint16).repeat(20))
    with pytest.raises(ValueError, match=r"token ids in \[0, 59\], outside \[0, 48\) \(the --init-from model's"):
        train(config.replace(data=[str(wide)], out_dir=str(tmp_path / "wide")))


TORCHRUN_SCRIPT = """
import json, sys
from tlm_train import TrainConfig, train
train(TrainConfig(**json.loads(sys.argv[1])))
"""


@pytest.mark.slow  # two torchrun ranks (gloo): ~20 s on the 2-core machine
@pytest.mark.parametrize("mode", ["fsdp"])
def test_a_lora_run_on_two_ranks_equals_one_process(mode: str, data: Path, base: Path, tmp_path: Path):
    import json
    import os
    import subprocess
    import sys

    from tlm_artifacts.steps import read_sharded_tensors

    # No dropout: each rank draws its own masks, so only a dropout-free run can equal one process.
    changes = dict(lora_dropout=0.0, batch_size=8)
    single = tmp_path / "single"
    train(lora_config(data, base, single, **changes))
    settings = lora_config(data, base, tmp_path / "ranks", distributed=mode, **changes).to_dict()
    script = tmp_path / "train_script.py"
    script.write_text(TORCHRUN_SCRIPT)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([*launcher, str(script), json.dumps(settings)], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    folder = RunDir(tmp_path / "ranks").checkpoints().path(6)
    got, want = read_sharded_tensors(folder), RunDir(single).checkpoints().load(6).state["model"]
    assert got.keys() == want.keys()
    # The ranks' gradients are averaged by a reduce-scatter instead of one mean: float32 ulps, far below an
    # update (~lr = 3e-3), see test_distributed.py.
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-5
    # The sharded step opens in one process, merged, like a one-process LoRA run.
    merged, _ = artifacts.load_model(artifacts.resolve(tmp_path / "ranks"))
    reference, _ = artifacts.load_model(artifacts.resolve(single))
    ids = torch.arange(12).reshape(1, 12)
    with torch.no_grad():
        torch.testing.assert_close(merged(ids), reference(ids), rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # a tokenizer and four short runs: ~6 s on the 2-core machine
def test_a_lora_chat_fine_tune_of_a_run_without_the_markers_trains_resumes_and_opens(tmp_path: Path):
    import json

    words = "the cat sat on a mat and then ran far away from every dog it saw".split()
    text = tmp_path / "text.txt"
    text.write_text(" ".join(words * 200), encoding="utf-8")
    shape = {"context_length": 32, "d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 64}
    base = tmp_path / "base"
    settings = {**COMMON, "vocab_size": 290, "batch_size": 4}
    train(TrainConfig(data=[str(text)], out_dir=str(base), steps=1, model=shape, **settings))
    rng = np.random.default_rng(0)
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"prompt": " ".join(rng.choice(words, 3)), "completion": " ".join(
        rng.choice(words, 4))}) + "\n" for _ in range(40)), encoding="utf-8")  # fmt: skip
    lora = dict(data=[str(chat)], init_from=str(base), steps=4, checkpoint_interval=2, eval_interval=2,
                lora_rank=2, lora_targets="q,v,lm_head", lora_dropout=0.1, **settings)  # fmt: skip
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train(TrainConfig(out_dir=str(whole), **lora))
    shutil.copytree(whole, resumed)
    train(RunDir(resumed).read_config(out_dir=str(resumed)), resume_from=2)  # as tlm train --resume reads it
    got, want = (RunDir(r).checkpoints().load(4).state["model"] for r in (resumed, whole))
    assert all(torch.equal(got[k], want[k]) for k in want)
    # The markers grew the vocabulary (mean rows, frozen); the run opens grown, the adapters merged.
    model, _ = artifacts.load_model(artifacts.resolve(whole))
    base_model, _ = artifacts.load_model(artifacts.resolve(base))
    assert model.config.vocab_size == base_model.config.vocab_size + 2
    old = base_model.token_embeddings.weight
    torch.testing.assert_close(model.token_embeddings.weight[-2:], old.mean(0).expand(2, -1), rtol=0, atol=1e-6)


def test_a_bfloat16_lora_run_holds_its_frozen_base_in_bfloat16(data: Path, base: Path, tmp_path: Path):
    # Issue 42: autocast would cast every frozen float32 weight on each forward; held in bfloat16 they take half
    # the memory and give the same products (tlm-lora's test_lora.py checks the bits). Adapters stay float32.
    from tlm_train import init_distributed
    from tlm_train.recipe import Recipe

    with Recipe(lora_config(data, base, tmp_path / "run", dtype="bfloat16"), init_distributed("cpu")) as recipe:
        recipe.setup()
        dtypes = {n: (p.dtype, p.requires_grad) for n, p in recipe.model.named_parameters()}
    frozen_matmuls = {d for n, (d, grad) in dtypes.items() if not grad and "proj" in n}
    assert frozen_matmuls == {torch.bfloat16}
    assert {d for d, grad in dtypes.values() if grad} == {torch.float32}
