"""`tlm accounting --world-size N`: per-rank training memory under DDP and FSDP2 from the CLI.

The figures themselves are checked against measured tensor bytes in test_train_memory.py; these
tests pin the wiring: the right config, batch and mode reach ``train_memory``, and misuse is a
one-line error.
"""

import json

import pytest

from tlm_command.main import main
from tlm_model import ModelConfig
from tlm_train.memory import train_memory


@pytest.mark.parametrize("checkpointing", [False, True])
def test_json_holds_both_modes_for_the_preset(capsys, checkpointing):
    argv = ["accounting", "--preset", "gpt2-small", "--world-size", "4", "--batch-size", "2", "--json"]
    assert main(argv + ["--activation-checkpointing"] * checkpointing) == 0
    got = json.loads(capsys.readouterr().out)["training_memory_per_rank"]
    cfg = ModelConfig.from_preset("gpt2-small")
    for mode in ("ddp", "fsdp"):
        want = train_memory(cfg, mode=mode, world_size=4, batch_size=2, activation_checkpointing=checkpointing)
        assert got[mode]["total"] == want.total
        assert got[mode]["parameters"] == want.parameters and got[mode]["tokens"] == 2 * cfg.context_length
    assert got["fsdp"]["parameters"] < got["ddp"]["parameters"]  # sharded over 4 ranks


def test_table_follows_the_report(capsys):
    assert main(["accounting", "--preset", "course-tinystories", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "Training memory per rank (rank 0 of 2" in out and out.index("Training memory") > out.index("Training:")


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--compare", "gpt2-small", "gpt2-xl", "--world-size", "2"], "use it with --preset, not --compare"),
        (["--preset", "gpt2-small", "--activation-checkpointing"], "give --world-size N too"),
        (["--preset", "gpt2-small", "--world-size", "0"], "must be a positive integer"),
    ],
)
def test_misuse_is_one_line(capsys, argv, fragment):
    with pytest.raises(SystemExit) as exit_info:
        main(["accounting", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("tlm: error: ") and fragment in err and err.count("\n") == 1
