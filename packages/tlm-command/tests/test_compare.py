"""``tlm compare``: what differs between runs, their final and best losses, tokens, time and divergence, read from
train.toml and metrics.jsonl written here by hand; the plot; paths that are neither a run nor a sweep."""

import json
import sys

import pytest

from tlm_command.main import main
from tlm_model import TransformerLM
from tlm_train import TrainConfig

TINY = {"context_length": 16, "d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 64}


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


def test_runs_side_by_side_with_what_differs_and_how_each_ended(hand_run, tmp_path, capsys) -> None:
    config = hand_run(tmp_path / "a", FINISHED, lr=1e-3)
    hand_run(tmp_path / "b", DIVERGED, lr=1e-2)
    png = tmp_path / "compare.png"
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(png), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    a, b = report["runs"]
    parameters = sum(p.numel() for p in TransformerLM(config.model_config()).parameters())
    assert a == {
        "name": "a", "path": str(tmp_path / "a"), "settings": {"lr": 1e-3}, "status": "done", "steps": 4,
        "planned_steps": 4, "final_val_loss": 3.2, "best_val_loss": 3.1, "tokens": 256, "parameters": parameters,
        "wall_time_s": 2.0, "tokens_per_s": 128.0, "diverged": False, "diverged_at": None, "seed": 0,
        "unstable_at": None, "message": None,
    }  # fmt: skip
    assert (b["settings"], b["status"], b["diverged"], b["diverged_at"]) == ({"lr": 1e-2}, "diverged", True, 3)
    assert (b["final_val_loss"], b["best_val_loss"], b["steps"], b["tokens_per_s"]) == (None, 3.5, 2, 128 / 1.25)
    # One run per setting, each named by its run: the first is the baseline; the diverged one has no final loss.
    assert report["baseline"] == "a" and report["unstable_above"] == 1.5
    assert [(s["label"], s["statuses"], s["final_val_loss"]["n"]) for s in report["settings"]] == [
        ("a", {"done": 1}, 1),
        ("b", {"diverged": 1}, 0),
    ]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert "| b | lr=0.01 | diverged at step 3 | 2/4 |" in table[3]
    assert table[5].startswith("| setting | seeds | runs | final val loss, mean ± sd (N) |")


UNSTABLE = [  # finished, but its loss went to 6.5 > 1.5 × 4.0 at step 2 on the way
    {"step": 0, "tokens": 0, "val_loss": 4.0, "time_s": 0.5},
    {"step": 2, "tokens": 128, "train_loss": 5.0, "val_loss": 6.5, "time_s": 1.5},
    {"step": 4, "tokens": 256, "train_loss": 3.3, "val_loss": 3.4, "time_s": 2.0},
]
INTERRUPTED = FINISHED[:2]  # stopped (Ctrl-C) at step 2 of 4: resumable


def test_each_status_says_what_happened_and_the_unstable_threshold_is_a_flag(hand_run, tmp_path, capsys) -> None:
    for name, records in (("done", FINISHED), ("diverged", DIVERGED), ("unstable", UNSTABLE),
                          ("interrupted", INTERRUPTED)):  # fmt: skip
        hand_run(tmp_path / name, records, lr=len(name) * 1e-3)
    folders = [str(tmp_path / n) for n in ("done", "diverged", "unstable", "interrupted")]
    assert main(["compare", *folders, "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [r["status"] for r in runs] == ["done", "diverged", "unstable", "interrupted"]
    assert (runs[2]["unstable_at"], runs[2]["final_val_loss"]) == (2, 3.4)  # finished: a result, flagged
    assert runs[3]["final_val_loss"] is None and not runs[3]["diverged"]  # interrupted is never diverged
    assert main(["compare", *folders]) == 0
    table = capsys.readouterr().out
    assert "| unstable (step 2: 6.50, 1.62× its start 4.00) |" in table
    assert "| interrupted at step 2 (resumable; not a result) |" in table
    assert main(["compare", *folders, "--json", "--unstable-above", "2"]) == 0  # 6.5 < 2 × 4.0
    assert json.loads(capsys.readouterr().out)["runs"][2]["status"] == "done"


def test_seeds_of_a_setting_are_grouped_and_compared_with_the_baseline_paired_by_seed(
    hand_run, tmp_path, capsys
) -> None:
    from tlm_experiments.stats import difference

    finals = {("baseline", 0): 3.20, ("baseline", 1): 3.25, ("baseline", 2): 3.18,
              ("wide", 0): 3.10, ("wide", 1): 3.16, ("wide", 2): 3.07}  # fmt: skip
    for (setting, seed), final in finals.items():
        records = [*FINISHED[:2], {**FINISHED[2], "val_loss": final}]
        hand_run(tmp_path / f"{setting}{seed}", records, seed=seed, lr=1e-3 if setting == "baseline" else 2e-3)
    assert main(["compare", *sorted(str(p) for p in tmp_path.iterdir()), "--json"]) == 0
    base, wide = json.loads(capsys.readouterr().out)["settings"]
    assert (base["label"], base["seeds"], base["vs_baseline"]) == ("lr=0.001", [0, 1, 2], None)
    expected = difference({k: finals["wide", k] for k in range(3)}, {k: finals["baseline", k] for k in range(3)})
    assert wide["vs_baseline"] == {**expected.to_dict(), "excludes_zero": expected.excludes_zero}
    assert wide["vs_baseline"]["method"] == "paired" and wide["final_val_loss"]["n"] == 3
    # --baseline chooses the setting the others are compared with.
    assert main(["compare", *sorted(str(p) for p in tmp_path.iterdir()), "--json", "--baseline", "lr=0.002"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["baseline"] == "lr=0.002" and report["settings"][1]["vs_baseline"] is None
    assert report["settings"][0]["vs_baseline"]["estimate"] == pytest.approx(-expected.estimate, rel=1e-12)


def test_a_baseline_that_is_not_a_setting_is_one_line(hand_run, tmp_path, fails) -> None:
    hand_run(tmp_path / "a", FINISHED, lr=1e-3)
    fails(["compare", str(tmp_path / "a"), "--baseline", "b"], "--baseline b: no such setting; the settings are a")


def test_a_path_that_is_neither_a_run_nor_a_sweep_is_one_line(tmp_path, fails) -> None:
    fails(["compare", str(tmp_path)], f"{tmp_path}: neither a run folder (train.toml) nor a sweep folder (sweep.json)")


def test_the_plot_is_written_whole_whatever_the_users_default_format(hand_run, tmp_path, monkeypatch) -> None:
    matplotlib = pytest.importorskip("matplotlib")

    hand_run(tmp_path / "a", FINISHED, lr=1e-3)
    monkeypatch.setitem(matplotlib.rcParams, "savefig.format", "pdf")
    png = tmp_path / "compare.png"
    assert main(["compare", str(tmp_path / "a"), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plot_never_replaces_what_it_compares_nor_a_folder(hand_run, tmp_path, fails) -> None:
    run = tmp_path / "a"
    hand_run(run, FINISHED, lr=1e-3)
    metrics = (run / "metrics.jsonl").read_bytes()
    out = run / "metrics.jsonl"
    fails(["compare", str(run), "--out", str(out)], f"--out {out} would overwrite the input {run}; choose another")
    assert (run / "metrics.jsonl").read_bytes() == metrics
    (tmp_path / "plots").mkdir()
    fails(["compare", str(run), "--out", str(tmp_path / "plots")], f"--out {tmp_path / 'plots'} is a folder")


def test_a_plot_without_matplotlib_is_one_line_saying_what_to_install(hand_run, tmp_path, fails, monkeypatch) -> None:
    hand_run(tmp_path / "a", FINISHED, lr=1e-3)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    fails(["compare", str(tmp_path / "a"), "--out", str(tmp_path / "c.png")],
          "tlm: error: plots need matplotlib: pip install 'tlm-command[plot]'")  # fmt: skip
    assert not (tmp_path / "c.png").exists()


def test_runs_of_other_tokenizers_compare_in_bits_per_byte_and_runs_of_other_data_are_refused(
    tmp_path, capsys, fails
) -> None:
    from tlm_train import default_corpus, train

    text, other = tmp_path / "text.txt", tmp_path / "other.txt"
    text.write_text(default_corpus()[:30_000], encoding="utf-8")
    other.write_text(default_corpus()[40_000:70_000], encoding="utf-8")
    common = dict(steps=2, batch_size=2, eval_batches=1, eval_interval=2, warmup_steps=1, peak_flops=1e9,
                  sample_tokens=0, model=TINY)  # fmt: skip
    for name, data, vocab, lr in [("a", text, 300, 3e-3), ("a2", text, 300, 1e-3), ("b", text, 270, 3e-3),
                                  ("c", other, 300, 3e-3)]:  # fmt: skip
        train(TrainConfig(out_dir=str(tmp_path / name), data=[str(data)], vocab_size=vocab, lr=lr, **common))

    def last(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines if "val_loss" in line][-1]

    # One tokenizer: losses in nats per token, as before.
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "a2"), "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["loss_unit"] == "nats/token" and captured.err == ""
    assert report["runs"][0]["final_val_loss"] == last("a")["val_loss"]
    # Two tokenizers, one data set: bits per byte, each run's own (what its validation measured), said on stderr.
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["loss_unit"] == "bits/byte" and "tokenizers differ" in captured.err
    for run in report["runs"]:
        assert run["final_val_loss"] == pytest.approx(last(run["name"])["val_bpb"], rel=1e-12)
        assert run["final_val_loss"] != pytest.approx(last(run["name"])["val_loss"], rel=1e-3)
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    table = capsys.readouterr().out
    assert "final val bits/byte" in table and "the runs' tokenizers differ" in table
    # Other data: refused in one line naming both runs.
    fails(["compare", str(tmp_path / "a"), str(tmp_path / "c")], str(tmp_path / "a"), str(tmp_path / "c"),
          "different data")  # fmt: skip


def test_the_plot_never_replaces_what_it_compares(hand_run, tmp_path, fails) -> None:
    hand_run(tmp_path / "a", FINISHED, lr=1e-3)
    metrics = tmp_path / "a" / "metrics.jsonl"
    before = metrics.read_bytes()
    for out in (metrics, tmp_path / "a", tmp_path):  # a file it reads, the run, the folder above
        fails(["compare", str(tmp_path / "a"), "--out", str(out)], f"--out {out} would overwrite the input")
    assert metrics.read_bytes() == before and (tmp_path / "a").is_dir()
