"""What ``generate``, ``eval`` and ``convert`` share: a model and its tokenizer from ``--checkpoint X``."""

import argparse
from typing import TYPE_CHECKING, Any

from tlm_command.args import UserError, damaged, say

if TYPE_CHECKING:
    import torch

    from tlm_model import TransformerLM


def add_model_arguments(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    parser.add_argument(
        "--checkpoint",
        metavar="PATH",
        required=required,
        help="a run folder (its newest checkpoint), a step folder, a model file or folder, or an HF Llama folder",
    )
    parser.add_argument("--tokenizer", metavar="DIR", help="a tokenizer folder (default: the checkpoint's own)")


def load_tokenizer(path: str | None, artifact: Any) -> Any:
    """``--tokenizer DIR`` when given, else the artifact's own tokenizer (or None when it has none)."""
    import tlm_artifacts
    from tlm_tokenizer import Tokenizer

    if path is not None:
        return Tokenizer.load(path)
    if artifact is None:
        return None
    try:
        return tlm_artifacts.load_tokenizer(artifact)
    except tlm_artifacts.UnreadableTokenizer as err:
        say(f"the tokenizer of {artifact.path} is not one tlm can reproduce ({err}); working with token ids")
        return None


def load_model(
    args: argparse.Namespace, device: "torch.device", *, compile: bool = False
) -> "tuple[TransformerLM, Any, Any]":
    """(model in eval mode, tokenizer or None, the resolved artifact) for ``--checkpoint``."""
    import tlm_artifacts
    from tlm_core.tensors import dtype_from_name

    dtype = dtype_from_name(args.dtype, "--dtype") if getattr(args, "dtype", None) else None
    artifact = tlm_artifacts.resolve(args.checkpoint)
    model, _ = tlm_artifacts.load_model(artifact, device=device, dtype=dtype, on_damaged=damaged)
    tokenizer = load_tokenizer(args.tokenizer, artifact)
    if tokenizer is not None and tokenizer.vocab_size > model.config.vocab_size:
        raise UserError(
            f"the tokenizer has {tokenizer.vocab_size} ids but the model only {model.config.vocab_size}: they do not "
            "belong together"
        )
    return model.eval(), tokenizer, artifact
