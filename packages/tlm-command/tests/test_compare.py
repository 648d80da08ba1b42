"""``tlm compare``: what differs between runs, their final and best losses, tokens, time and divergence, read from
train.toml and metrics.jsonl written here by hand; the plot; paths that are neither a run nor a sweep."""

import json

import pytest

from tlm_command.main import main
from tlm_model import TransformerLM
from tlm_train import TrainConfig

TINY = {"context_length": 16, "d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 64}


def _run(folder, records, **settings):
    """A run folder as tlm train leaves it: train.toml (the resolved model) and metrics.jsonl."""
    config = TrainConfig(out_dir=str(folder), vocab_size=32, steps=4, model=TINY, **settings)
    folder.mkdir()
    config = config.replace(model=config.model_config(32).to_dict(drop_none=True))
    (folder / "train.toml").write_text(config.to_toml())
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return config


FINISHED = [
    {"step": 0, "tokens": 0, "val_loss": 4.0, "time_s": 0.5},
    {"step": 2, "tokens": 128, "train_loss": 3.6, "val_loss": 3.1, "time_s": 1.5},
    {"step": 4, "tokens": 256, "train_loss": 3.3, "val_loss": 3.2, "time_s": 2.0},
]
DIVERGED = [
    {"step": 0, "tokens": 0, "val_loss": 4.0, "time_s": 0.25},
    {"step": 2, "tokens": 128, "train_loss": 3.9, "val_loss": 3.5, "time_s": 1.0},
    {"step": 3, "event": "diverged", "message": "step 3: training loss is nan", "time_s": 1.25},
]


def test_runs_side_by_side_with_what_differs_and_how_each_ended(tmp_path, capsys) -> None:
    config = _run(tmp_path / "a", FINISHED, lr=1e-3)
    _run(tmp_path / "b", DIVERGED, lr=1e-2)
    png = tmp_path / "compare.png"
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(png), "--json"]) == 0
    a, b = json.loads(capsys.readouterr().out)
    parameters = sum(p.numel() for p in TransformerLM(config.model_config()).parameters())
    assert a == {
        "name": "a", "path": str(tmp_path / "a"), "settings": {"lr": 1e-3}, "status": "done", "steps": 4,
        "planned_steps": 4, "final_val_loss": 3.2, "best_val_loss": 3.1, "tokens": 256, "parameters": parameters,
        "wall_time_s": 2.0, "tokens_per_s": 128.0, "diverged": False, "diverged_at": None,
    }  # fmt: skip
    assert (b["settings"], b["status"], b["diverged"], b["diverged_at"]) == ({"lr": 1e-2}, "diverged", True, 3)
    assert (b["final_val_loss"], b["best_val_loss"], b["steps"], b["tokens_per_s"]) == (None, 3.5, 2, 128 / 1.25)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 4 and "| b | lr=0.01 | diverged at step 3 | 2/4 |" in table[3]


def test_a_path_that_is_neither_a_run_nor_a_sweep_is_one_line(tmp_path, fails) -> None:
    fails(["compare", str(tmp_path)], f"{tmp_path}: neither a run folder (train.toml) nor a sweep folder (sweep.json)")


def test_the_plot_draws_each_runs_curves_by_step_and_by_time_and_marks_the_divergence(tmp_path, monkeypatch) -> None:
    matplotlib = pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    _run(tmp_path / "a", FINISHED, lr=1e-3)
    _run(tmp_path / "b", DIVERGED, lr=1e-2)
    figures = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (figures.append(fig), close(fig)))
    monkeypatch.setitem(matplotlib.rcParams, "savefig.format", "pdf")  # a user's default format does not apply
    png = tmp_path / "compare.png"
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    by_step, by_time, _ = figures[0].axes

    def curves(ax):
        return [(line.get_label(), line.get_xdata().tolist(), line.get_ydata().tolist()) for line in ax.get_lines()]

    a_losses, b_losses = [r["val_loss"] for r in FINISHED], [r["val_loss"] for r in DIVERGED[:2]]
    assert curves(by_step)[:2] == [("a", [0, 2, 4], a_losses), ("b", [0, 2], b_losses)]
    assert curves(by_time) == [("a", [0.5, 1.5, 2.0], a_losses), ("b", [0.25, 1.0], b_losses)]
    cross = by_step.get_lines()[2]  # b diverged: a red × on its last validation loss
    assert (cross.get_marker(), cross.get_color()) == ("x", "red")
    assert (cross.get_xdata().tolist(), cross.get_ydata().tolist()) == ([2], [3.5])
    assert [text.get_text() for text in by_step.get_legend().get_texts()] == ["a", "b"]
    # Both panels plot the validation loss, one against the step and one against the wall-clock time.
    assert [(ax.get_xlabel(), ax.get_ylabel()) for ax in (by_step, by_time)] == [
        ("step", "validation loss (nats/token)"),
        ("wall-clock time (s)", "validation loss (nats/token)"),
    ]
