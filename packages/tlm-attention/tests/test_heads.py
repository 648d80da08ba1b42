"""head_layout: the heads' sizes an attention is built with, and the rule that checks them (the attention's
constructor and tlm_model.ModelConfig both call it). It imports no torch."""

import subprocess
import sys

import pytest

from tlm_attention import head_layout


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((32, 8), (8, 4)),  # defaults: every head has its own keys and values, d_model / num_heads wide
        ((32, 8, 2), (2, 4)),  # grouped-query attention: 4 query heads share each key/value head
        ((32, 8, 1, 16), (1, 16)),  # multi-query, with a head width of its own
        ((30, 4, None, 8), (4, 8)),  # head_dim frees d_model from dividing by num_heads
    ],
)
def test_the_layout(args, expected):
    assert head_layout(*args) == expected


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_kv_heads": 3}, ValueError, r"^num_kv_heads must divide num_heads, got num_heads=8, num_kv_heads=3$"),
        ({"num_kv_heads": 0}, ValueError, "num_kv_heads must be positive"),
        ({"num_kv_heads": 2.0}, TypeError, "num_kv_heads must be an int"),
        ({"head_dim": 0}, ValueError, "head_dim must be positive"),
        ({"d_model": 30}, ValueError, r"^d_model must be divisible by num_heads, got d_model=30, num_heads=8 \(or set"),
        ({"d_model": 0}, ValueError, "d_model must be positive"),
        ({"num_heads": True}, TypeError, "num_heads must be an int"),
    ],
)
def test_bad_layouts_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        head_layout(**{"d_model": 32, "num_heads": 8, **kwargs})


def test_the_owner_prefixes_every_name():
    with pytest.raises(ValueError, match=r"^ModelConfig\.num_kv_heads must divide num_heads"):
        head_layout(32, 8, 3, owner="ModelConfig.")
    with pytest.raises(ValueError, match=r"^ModelConfig\.d_model must be divisible by num_heads"):
        head_layout(30, 8, owner="ModelConfig.")


def test_it_imports_no_torch():
    code = "import sys, tlm_attention.heads; assert 'torch' not in sys.modules, 'torch was imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
