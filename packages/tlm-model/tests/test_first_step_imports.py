"""A server's first request runs the eager engine's first forward: it must not pay for an import the forward does
not need (``torch.broadcast_shapes`` imports sympy, seconds on a slow CPU, the first time it is called)."""

import json
import subprocess
import sys

import pytest

CODE = """
import dataclasses, json, sys
import torch
from tlm_model import ModelConfig, TransformerLM
from tlm_model.batching import DecodeBatch

config = dataclasses.replace(ModelConfig.from_preset("course-tinystories"), num_layers=1)
batch = DecodeBatch(TransformerLM(config).eval(), 8, pack_weights=True)  # the server's eager batch packs
before = "sympy" in sys.modules
batch.add_many([torch.tensor([1, 2, 3]), *[torch.tensor([4])] * 7])  # a prompt forward
batch.step(torch.arange(5, 13))  # a decode step, on the packed weights where torch has MKL
print(json.dumps([before, "sympy" in sys.modules]))
"""


@pytest.mark.slow  # a fresh interpreter imports torch
def test_the_first_eager_forwards_import_no_sympy():
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [False, False]
