"""docs/experiments.md's sentences come from the numbers: tools/make_experiments_doc.py's page, written from runs
made up here (three seeds per setting), says *no difference beyond noise* exactly when an interval holds zero,
finds the best rate and the edge of stability from the statuses, and says where removing RMSNorm moved the edge."""

import importlib.util
import pathlib

import pytest

from tlm_experiments.compare import RunSummary

ROOT = pathlib.Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "tools" / "make_experiments_doc.py"

pytestmark = pytest.mark.skipif(
    not SCRIPT.exists(), reason="docs/experiments.md lives in the tlm monorepo; this copy has no tools/ or docs/"
)


def _run(name, status, final, seed, **settings):
    curve = [(0, 0.0, 6.3), (200, 1.0, 4.0 if status != "unstable" else 12.0), (400, 2.0, final or 4.0)]
    if status == "diverged":
        curve = curve[:1]
    return RunSummary(
        name=f"{name},seed={seed}", path=f"{name},seed={seed}", settings={**settings, "seed": seed}, status=status,
        steps=400 if status != "diverged" else 30, planned_steps=400,
        final_val_loss=final if status in ("done", "unstable") else None, best_val_loss=final or 6.3, tokens=1,
        parameters=984_192, wall_time_s=50.0, tokens_per_s=1.0, diverged=status == "diverged",
        diverged_at=31 if status == "diverged" else None, seed=seed,
        unstable_at=200 if status == "unstable" else None, curve=curve,
    )  # fmt: skip


def _setting(name, status, finals, **settings):
    return [_run(name, status, f, seed, **settings) for seed, f in enumerate(finals)]


@pytest.fixture(scope="module")
def doc():
    spec = importlib.util.spec_from_file_location("make_experiments_doc", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_says_what_the_numbers_say(doc) -> None:
    lr_runs = [
        *_setting("lr=0.001", "done", [3.48, 3.47, 3.49], lr=0.001),
        *_setting("lr=0.01", "done", [3.13, 3.16, 3.12], lr=0.01),
        *_setting("lr=0.1", "done", [3.41, 3.43, 3.38], lr=0.1),
        *_setting("lr=1", "unstable", [5.41, 5.35, 5.33], lr=1),
        *_setting("lr=3", "diverged", [None, None, None], lr=3),
    ]
    norm_runs = [
        *_setting("no-norm,lr=0.001", "done", [3.58, 3.57, 3.59], lr=0.001, **{"model.norm_placement": "none"}),
        *_setting("no-norm,lr=0.01", "done", [3.28, 3.30, 3.27], lr=0.01, **{"model.norm_placement": "none"}),
        *_setting("no-norm,lr=0.1", "diverged", [None, None, None], lr=0.1, **{"model.norm_placement": "none"}),
        *_setting("no-norm,lr=1", "diverged", [None, None, None], lr=1, **{"model.norm_placement": "none"}),
    ]
    ablation_runs = [  # post-norm within noise (+0.01 against a spread of 0.02), NoPE worse, SiLU worse
        *_setting("post-norm", "done", [3.16, 3.15, 3.13], **{"model.norm_placement": "post"}),
        *_setting("nope", "done", [3.33, 3.36, 3.32], **{"model.positions": "none"}),
        *_setting("silu", "done", [3.20, 3.23, 3.19], **{"model.ffn": "silu", "model.d_ff": 512}),
    ]
    batch_runs = [_run(f"batch={b},lr={lr}", "done", f, 0, batch_size=b, lr=lr)
                  for b, lr, f in ((1, 0.003, 3.3), (1, 0.01, 3.5), (16, 0.01, 3.1), (16, 0.03, 3.2))]  # fmt: skip
    page = doc.page({
        "n_tokens": 216_634, "lr_runs": lr_runs, "best_lr": 0.01, "norm_lrs": [0.001, 0.01, 0.1, 1],
        "norm_runs": norm_runs, "ablation_runs": ablation_runs, "batch_runs": batch_runs,
        "tuned": [batch_runs[0], batch_runs[2]], "budget": 409_600, "sample": {"text": "The end"},
        "sample_run": "lr=0.01,seed=0", "figures": "experiments",
        "made": {"session": {"load": 0.5, "jobs": 2}, "minutes": 33.0, "sweeps": {"lr": 15.0}},
    })  # fmt: skip
    text = " ".join(page.split())
    assert "took **33.0 minutes**" in text
    assert "The best mean final loss came at lr = 0.01 (3.137 ± 0.021 over 3 seeds)" in text
    assert "The edge of stability, the smallest rate above it at which a run diverged or went unstable" in text
    assert "is lr = 1: 3 unstable (above 1.5× the start first at steps 200, 200, 200)." in text
    assert "The best rate sits 100× below the edge." in text
    assert "The next rate up, 0.1, against the best: +0.270 nats" in text and "worse at this scale" in text
    assert "The edge of stability without the norm is lr = 0.1 (3 diverged (at steps 31, 31, 31))" in text
    assert "removing RMSNorm moved the edge to a lower rate" in text
    assert "post-norm (the norm after each sublayer) vs pre-norm: +0.010 nats" in text
    post_norm = text.split("post-norm (the norm after each sublayer) vs pre-norm: ")[1].split(";")[0]
    assert post_norm.endswith("no difference beyond noise)")
    nope = text.split("NoPE (no position embedding) vs RoPE: ")[1].split(";")[0]
    assert "which excludes zero: worse at this scale" in nope
    assert "| post-norm is worse than pre-norm | +0.010 [" in text and "| no (within noise) |" in text
    assert "| NoPE is worse than RoPE | +0.200 [" in text
    assert "| a larger batch wants a larger rate | 1: 0.003, 16: 0.01 | yes (one seed each) |" in text
    assert "```text The end ```" in text
