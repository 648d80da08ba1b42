"""tlm_experiments.compare on its own (tlm-command's ``tlm compare`` tests reach it through the command line): what
``summarize`` reads from a run folder written here by hand, and the records ``read_metrics`` refuses. Every expected
value is counted from the records below."""

import json

import pytest

from tlm_core.cli import UserError
from tlm_experiments.compare import markdown, read_metrics, summarize
from tlm_model import TransformerLM

FINISHED = [
    {"step": 0, "tokens": 0, "val_loss": 4.0, "time_s": 0.5},
    {"step": 2, "tokens": 128, "train_loss": 3.6, "val_loss": 3.1, "time_s": 1.5},
    {"step": 4, "tokens": 256, "train_loss": 3.3, "val_loss": 3.2, "time_s": 2.0},
]
UNSTABLE = [  # finished, but 6.5 > 1.5 x 4.0 at step 2
    {"step": 0, "tokens": 0, "val_loss": 4.0, "time_s": 0.5},
    {"step": 2, "tokens": 128, "train_loss": 5.0, "val_loss": 6.5, "time_s": 1.5},
    {"step": 4, "tokens": 256, "train_loss": 3.3, "val_loss": 3.4, "time_s": 2.0},
]
DIVERGED = [
    {"step": 0, "tokens": 0, "val_loss": 4.0, "time_s": 0.25},
    {"step": 2, "tokens": 128, "train_loss": 3.9, "val_loss": 3.5, "time_s": 1.0},
    {"step": 3, "event": "diverged", "message": "step 3: training loss is nan", "time_s": 1.25},
]


def test_a_finished_run_is_done_with_its_last_and_best_losses_its_tokens_and_its_rate(hand_run, tmp_path) -> None:
    hand_run(tmp_path / "a", FINISHED, seed=3)
    s = summarize(tmp_path / "a")
    assert (s.name, s.path, s.status, s.steps, s.planned_steps) == ("a", str(tmp_path / "a"), "done", 4, 4)
    assert (s.final_val_loss, s.best_val_loss, s.tokens, s.wall_time_s, s.tokens_per_s) == (3.2, 3.1, 256, 2.0, 128.0)
    assert (s.diverged, s.diverged_at, s.unstable_at, s.message, s.seed) == (False, None, None, None, 3)
    assert s.curve == [(0, 0.5, 4.0), (2, 1.5, 3.1), (4, 2.0, 3.2)]
    assert summarize(tmp_path / "a", name="lr=1e-3", settings={"lr": 1e-3}).name == "lr=1e-3"


def test_each_ending_from_the_records_and_a_sweeps_status_wins(hand_run, tmp_path) -> None:
    for name, records in (("unstable", UNSTABLE), ("diverged", DIVERGED), ("interrupted", FINISHED[:2])):
        hand_run(tmp_path / name, records)
    unstable = summarize(tmp_path / "unstable")
    assert (unstable.status, unstable.unstable_at, unstable.final_val_loss) == ("unstable", 2, 3.4)
    diverged = summarize(tmp_path / "diverged")
    assert (diverged.status, diverged.diverged, diverged.diverged_at, diverged.steps) == ("diverged", True, 3, 2)
    assert diverged.final_val_loss is None and diverged.tokens_per_s == 128 / 1.25
    interrupted = summarize(tmp_path / "interrupted")
    assert (interrupted.status, interrupted.steps, interrupted.final_val_loss) == ("interrupted", 2, None)
    failed = summarize(tmp_path / "interrupted", status="failed", message="out of memory")
    assert (failed.status, failed.message, failed.diverged) == ("failed", "out of memory", False)
    told = summarize(tmp_path / "interrupted", status="diverged", message="ignored")
    assert (told.status, told.diverged, told.message) == ("diverged", True, None)


@pytest.mark.parametrize(
    ("line", "what"),
    [
        ({"step": 1.0}, "step 1.0"),
        ({"step": True}, "step true"),
        ({"step": -1}, "step -1"),
        ({"loss": 2.0}, "no step"),
        ([1, 2], "a list, not an object"),
    ],
)
def test_a_record_without_an_integer_step_of_zero_or_more_is_refused_by_line(tmp_path, line, what) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 0}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(UserError) as caught:
        read_metrics(path)
    assert str(caught.value) == f"{path}: line 2: expected a record with an integer step >= 0, got {what}"


def test_a_last_line_cut_short_is_dropped_and_a_missing_log_has_no_records(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 2}\n{"step": 4, "val_lo')
    assert read_metrics(path) == [{"step": 0}, {"step": 2}]
    assert read_metrics(tmp_path / "none.jsonl") == []


def test_the_table_has_a_row_per_run_with_four_decimals_of_loss_and_thousands_separated(hand_run, tmp_path) -> None:
    config = hand_run(tmp_path / "a", FINISHED)
    hand_run(tmp_path / "b", DIVERGED)
    parameters = sum(p.numel() for p in TransformerLM(config.model_config()).parameters())
    a = summarize(tmp_path / "a", settings={"lr": 0.001})
    b = summarize(tmp_path / "b", settings={"lr": 0.01}, name="b")
    table = markdown([a, b]).splitlines()
    assert table[0] == (
        "| run | settings | status | steps | parameters | final val loss | best val loss | tokens | wall time (s) "
        "| tokens/s |"
    )
    assert table[1] == "|" + "---|" * 10
    assert table[2] == f"| a | lr=0.001 | done | 4/4 | {parameters:,} | 3.2000 | 3.1000 | 256 | 2.0 | 128 |"
    # 1.25 s to one decimal and 128 / 1.25 = 102.4 tokens/s to none, as format() rounds them.
    assert table[3] == f"| b | lr=0.01 | diverged at step 3 | 2/4 | {parameters:,} | – | 3.5000 | 128 | 1.2 | 102 |"
    assert len(table) == 4


@pytest.mark.parametrize("value", [0.5, 3.14159, 0.001, 0.000123456, -0.0004, 0.0])
def test_a_table_cell_keeps_four_decimals_and_three_significant_digits_below_a_thousandth(value):
    # A learning rate of 1.2e-4 printed with four decimals would read 0.0001: below 1e-3 (and not 0) a cell keeps
    # three significant digits instead, as format(value, ".3g") writes them.
    from tlm_experiments.compare import _fmt

    small = value != 0 and abs(value) < 1e-3
    assert _fmt(value) == (format(value, ".3g") if small else format(value, ".4f"))


def test_the_statistics_table_is_against_the_baseline_asked_for():
    # `tlm compare --baseline LR=2` compares every setting with that one: its row is the baseline, the other's row
    # is its final loss minus the baseline's (3.0 - 2.5 = +0.5 with one seed each; 2.5 - 3.0 the other way round).
    from tlm_experiments.compare import full_markdown
    from tlm_experiments.results import RunSummary

    def run(lr, loss):
        return RunSummary(name=f"lr={lr}", path=f"runs/lr={lr}", settings={"lr": lr}, status="done", steps=10,
                          planned_steps=10, final_val_loss=loss, best_val_loss=loss, tokens=100, parameters=10,
                          wall_time_s=1.0, tokens_per_s=100.0, diverged=False, seed=0)  # fmt: skip

    summaries = [run(1, 3.0), run(2, 2.5)]
    for baseline, other, difference in (("lr=2", "lr=1", "+0.5000"), ("lr=1", "lr=2", "-0.5000")):
        rows = {line.split(" | ")[0].lstrip("| "): line for line in full_markdown(summaries, baseline=baseline)
                .splitlines() if line.startswith("| lr=")}  # fmt: skip
        assert " | baseline | " in rows[baseline] and f" | {difference} (no interval: one seed) | " in rows[other]
