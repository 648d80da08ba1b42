"""Opening a model for inference needs no training package: ``tlm generate`` on a run folder reads it through
tlm_artifacts alone (ARCHITECTURE.md, "One reader for what inference opens")."""

import json
import subprocess
import sys

import pytest

CODE = """
import argparse, json, sys

def train_modules():
    return sorted(m for m in sys.modules if m == "tlm_train" or m.startswith("tlm_train."))

argv = ["generate", "--checkpoint", sys.argv[1], "--prompt", "def", "--max-new-tokens", "4", "--json", "--quiet"]
# The generate command alone: its parser, then its run on the run folder.
from tlm_command import generate
parser = argparse.ArgumentParser()
generate.add_parser(parser.add_subparsers())
args = parser.parse_args(argv)
assert args.run(args) == 0
print(json.dumps(train_modules()))
# The whole command, as a user runs it: the parser of every subcommand is built first.
from tlm_command.main import main
assert main(argv) == 0
print(json.dumps(train_modules()))
"""


@pytest.mark.slow  # a fresh interpreter imports torch
def test_generate_on_a_run_folder_imports_nothing_of_tlm_train(run):
    done = subprocess.run([sys.executable, "-c", CODE, str(run)], capture_output=True, text=True, timeout=300,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    first, alone, second, whole = done.stdout.strip().splitlines()[-4:]
    assert len(json.loads(first)["ids"]) == 4 and json.loads(second) == json.loads(first)
    assert json.loads(alone) == []
    # tlm's parser describes `tlm train`'s flags from TrainConfig (tlm_train.config, no torch): nothing more.
    assert json.loads(whole) == ["tlm_train", "tlm_train.config"]
