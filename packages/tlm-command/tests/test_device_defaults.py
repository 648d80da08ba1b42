"""Issue 41 item 4: defaults that follow the device (``--device auto``, bf16 on CUDA, the prefill sizes)."""

import argparse

import pytest
import torch

from tlm_command.args import inference_device


def test_auto_is_the_cpu_without_cuda_and_keeps_the_checkpoints_dtype(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = argparse.Namespace(device="auto", dtype=None)
    assert inference_device(args) == torch.device("cpu") and args.dtype is None  # float32 stays float32


def test_auto_is_cuda_when_there_is_one_with_bf16_and_tf32_matmuls_unless_dtype_says(monkeypatch):
    precision = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "set_float32_matmul_precision", precision.append)
    args = argparse.Namespace(device="auto", dtype=None)
    assert inference_device(args).type == "cuda" and args.dtype == "bfloat16" and precision == ["high"]
    args = argparse.Namespace(device="auto", dtype="float32")
    assert inference_device(args).type == "cuda" and args.dtype == "float32"


@pytest.mark.parametrize("command", ["serve", "generate", "eval"])
def test_the_inference_commands_default_to_auto(command):
    from tlm_command.main import build_parser

    required = {"serve": [], "generate": ["--prompt", "x"], "eval": ["--data", "x"]}[command]
    args = build_parser().parse_args([command, "--checkpoint", "c", *required])
    assert args.device == "auto" and args.dtype is None


def test_serve_takes_the_prefill_sizes_and_defaults_them_by_device():
    from tlm_command.main import build_parser
    from tlm_model.scheduler import PREFILL_BUDGET, PREFILL_CHUNK, prefill_defaults

    args = build_parser().parse_args(["serve", "--checkpoint", "c", "--prefill-chunk", "64", "--token-budget", "256"])
    assert (args.prefill_chunk, args.token_budget) == (64, 256)
    args = build_parser().parse_args(["serve", "--checkpoint", "c"])
    assert (args.prefill_chunk, args.token_budget) == (None, None)
    assert prefill_defaults(torch.device("cpu")) == (PREFILL_CHUNK, PREFILL_BUDGET) == (32, 128)
    chunk, budget = prefill_defaults(torch.device("cuda"))
    assert chunk > PREFILL_CHUNK and budget > PREFILL_BUDGET and budget >= chunk
