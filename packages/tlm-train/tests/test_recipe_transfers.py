"""The training loop's copies between host and device, step by step (issue 42): a step that does not log copies
nothing either way; a logging step reads the guard, the loss and the gradient norm in one transfer. Counted by
the ``host_transfers`` fixture (tlm-train's conftest) around each phase of each step of a real CPU run."""

import torch

from tlm_train import TrainConfig, train
from tlm_train.recipe import Recipe

PHASES = ("train_step", "maybe_log", "maybe_evaluate", "maybe_checkpoint")


def test_only_logging_steps_copy_and_each_copies_once(make_config, monkeypatch, host_transfers) -> None:
    seen: dict[tuple[int, str], list[str]] = {}

    def counted(name):  # type: ignore[no-untyped-def]
        original = getattr(Recipe, name)

        def phase(self, step, *args, **kwargs):  # type: ignore[no-untyped-def]
            with host_transfers() as copies:
                out = original(self, step, *args, **kwargs)
            seen.setdefault((step, name), []).extend(copies)
            return out

        return phase

    for name in PHASES:
        monkeypatch.setattr(Recipe, name, counted(name))
    train(make_config(steps=7, log_interval=3, eval_interval=100, checkpoint_interval=100, sample_tokens=0))
    quiet = {key: copies for key, copies in seen.items() if key[0] in (1, 2, 4, 5)}
    assert len(quiet) == 4 * len(PHASES)
    assert all(copies == [] for copies in quiet.values()), quiet
    for step in (3, 6):
        assert seen[(step, "train_step")] == []
        assert seen[(step, "maybe_log")] == ["D2H Tensor.tolist"]  # the guard, the loss and the norm together
        assert seen[(step, "maybe_evaluate")] == seen[(step, "maybe_checkpoint")] == []


def test_the_default_log_interval_follows_the_device(make_config, tmp_path) -> None:
    config = make_config()
    assert config.log_interval is None
    assert config.logging_interval("cpu") == 1
    assert config.logging_interval("cuda") == 10  # each logging step waits for the device
    assert make_config(log_interval=4).logging_interval("cuda") == 4
    (tmp_path / "train.toml").write_text(config.to_toml(), encoding="utf-8")  # TOML has no null: left out
    assert TrainConfig.from_toml(tmp_path / "train.toml") == config


def test_a_run_leaves_torchs_determinism_flags_as_it_found_them(make_config) -> None:
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    train(make_config(steps=1, sample_tokens=0))
    assert (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) == (
        before
    )
