"""Fixtures for tlm-command's tests: a small trained run (shared), checkpoints, and the one-line error check."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

#: A run that trains in seconds: the tiny model, 24 steps on the first 60 KB of Python's pydoc topics.
RUN_SETTINGS = dict(
    vocab_size=320, steps=24, batch_size=8, eval_interval=12, eval_batches=2, checkpoint_interval=12,
    warmup_steps=2, peak_flops=1e9, sample_tokens=0,
    model={"context_length": 32, "d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 64},
)  # fmt: skip


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    from tlm_train import default_corpus

    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text(default_corpus()[:60_000], encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def held_out(tmp_path_factory) -> Path:
    from tlm_train import default_corpus

    path = tmp_path_factory.mktemp("text") / "held_out.txt"
    path.write_text(default_corpus()[200_000:210_000], encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def run(tmp_path_factory, corpus) -> Path:
    """A trained run folder (tokenizer, data, two checkpoints), made once for the whole session."""
    from tlm_train import TrainConfig, train

    out = tmp_path_factory.mktemp("runs") / "run"
    train(TrainConfig(out_dir=str(out), data=[str(corpus)], **RUN_SETTINGS))
    return out


@pytest.fixture
def fails(capsys):
    """``fails(argv, *fragments, code=2)``: ``tlm argv`` exits with ``code`` after one stderr line, no stdout."""
    from tlm_command.main import main

    def check(argv, *fragments, code=2):
        with pytest.raises(SystemExit) as info:
            main(argv)
        out, err = capsys.readouterr()
        assert info.value.code == code, err
        assert out == "" and err.endswith("\n") and err.count("\n") == 1, err
        assert err.startswith("tlm: error: "), err
        for fragment in fragments:
            assert fragment in err, err
        return err

    return check


@pytest.fixture
def tlm():
    """``tlm(*argv)``: the command in a subprocess (``python -m tlm``), as a user runs it."""

    def run_command(*argv, **kwargs):
        return subprocess.run([sys.executable, "-m", "tlm", *map(str, argv)], capture_output=True, text=True,
                              timeout=600, **kwargs)  # fmt: skip

    return run_command


#: What a forked command finds imported: every command's module (build_parser imports them), torch,
#: torch._dynamo (which torch.optim's first optimizer imports: seconds), and matplotlib as train's loss plot
#: imports it.
WARM_IMPORTS = """
import torch, torch._dynamo
from tlm_command.main import build_parser
build_parser()
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot
except ImportError:
    pass
"""


@pytest.fixture
def tlm_forked(fork_server):
    """``tlm_forked(*argv)``: what ``tlm(*argv)`` runs (``python -m tlm``'s module), each command in a process
    of its own, forked from an interpreter that has imported the command already (the root conftest's
    ``fork_server``): a journey of many commands then pays for one interpreter start. ``python -m tlm``
    itself, in a new interpreter, is test_main.py's."""
    start = fork_server(WARM_IMPORTS)
    code = "import runpy\nrunpy.run_module('tlm', run_name='__main__', alter_sys=True)"

    def run_command(*argv):
        return start(code, *map(str, argv))

    return run_command


@pytest.fixture(scope="session")
def small_checkpoint(tmp_path_factory):
    """(model, folder) of a small random model saved with tlm-model's save_model_file."""
    from tlm_model import ModelConfig, TransformerLM, save_model_file

    torch.manual_seed(3)
    model = TransformerLM(ModelConfig(50, 16, 16, 1, 2, 24)).eval()
    return model, save_model_file(model, tmp_path_factory.mktemp("small"))
