"""``tlm eval``: a checkpoint's loss, perplexity and bits per byte on held-out text or tokens.

The file is cut into windows of the model's context (or ``--context-length``), each token predicted from
the tokens before it in its window; every token after the file's first is scored once, the tail included.
By default the windows do not overlap; ``--stride S`` slides them S tokens at a time, each scoring only the
tokens the one before did not, so every token past the first window has at least context − S tokens of
history (HF's sliding-window perplexity). Bits per byte
divide the summed loss by the UTF-8 bytes the scored tokens stand for (special tokens count none), so
they compare across tokenizers. Forward passes only: no gradient is ever computed.
"""

import argparse
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tlm_command.args import (
    UserError,
    add_command,
    add_device_arguments,
    fit_threads,
    inference_device,
    positive_int,
    say,
)
from tlm_command.loading import add_model_arguments, load_model

if TYPE_CHECKING:
    import numpy as np
    import torch


def add_parser(commands: Any) -> None:
    parser = add_command(
        commands, "eval", "loss, perplexity and bits per byte of a checkpoint on a text or token file", __doc__
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--data",
        required=True,
        metavar="FILE",
        help="UTF-8 text (encoded with the tokenizer), or token ids (.npy, or raw .bin/.u16/.u32)",
    )
    parser.add_argument(
        "--token-dtype", choices=("uint16", "uint32"), default="uint16", help="the id type of a raw token file (.bin)"
    )
    parser.add_argument("--batch-size", type=positive_int, default=8, metavar="B", help="windows per forward pass")
    parser.add_argument(
        "--context-length",
        type=positive_int,
        default=None,
        metavar="N",
        help="window length (default: the model's context length)",
    )
    parser.add_argument(
        "--stride",
        type=positive_int,
        default=None,
        metavar="S",
        help="slide the windows S tokens at a time, each token scored once (default: the context: no overlap)",
    )
    parser.add_argument(
        "--max-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="evaluate only the first N tokens of the file",
    )
    parser.add_argument(
        "--val-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="score N tokens (in whole windows of the context, no overlap) spread evenly over the whole file, as "
        "tlm train's validation with the same --val-tokens does: RUN/data/val.npy then gives the run's number "
        "(default: every token)",
    )
    add_device_arguments(parser, "compute in this dtype (default: the checkpoint's; bfloat16/float16 via autocast)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)


def _tokens(path: Path, tokenizer: Any, token_dtype: str) -> "np.ndarray":
    import numpy as np

    from tlm_train.data import is_token_file, read_token_file

    if is_token_file(path):
        return read_token_file(path, token_dtype)
    if tokenizer is None:
        raise UserError(f"--data {path} is text, and the checkpoint has no tokenizer: give --tokenizer DIR")
    from tlm_core.atomic import read_input

    try:
        text = read_input(path, "--data").decode("utf-8")  # the handle checked a regular file is the one read
    except UnicodeDecodeError as err:
        raise UserError(f"--data {path} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    return np.asarray(tokenizer.encode(text), dtype=np.int64)


def _token_bytes(tokenizer: Any, vocab: int) -> "torch.Tensor | None":
    """The UTF-8 length of each id's text (special tokens: 0, they stand for no text)."""
    from tlm_train.evaluate import token_byte_lengths

    return None if tokenizer is None else token_byte_lengths(tokenizer, vocab)


def run(args: argparse.Namespace) -> int:
    from tlm_core.atomic import check_input
    from tlm_core.progress import progress_bar
    from tlm_core.tensors import dtype_from_name
    from tlm_train import EvalBatches, evaluate

    device = inference_device(args)
    fit_threads(device, quiet=args.quiet)
    check_input(args.data, "--data")  # the cheap checks before the model loads: a regular file
    model, tokenizer, artifact = load_model(args, device)
    ids = _tokens(Path(args.data), tokenizer, args.token_dtype)
    if args.max_tokens is not None:
        ids = ids[: args.max_tokens]
    vocab, context = model.config.vocab_size, args.context_length or model.config.context_length
    if context > model.config.context_length:
        raise UserError(f"--context-length {context} exceeds the model's context length {model.config.context_length}")
    if len(ids) < 2:
        raise UserError(f"--data {args.data} holds {len(ids)} tokens; evaluation needs at least 2")
    context = min(context, len(ids) - 1)
    top = int(ids.max())
    if int(ids.min()) < 0 or top >= vocab:
        raise UserError(f"--data {args.data} holds token ids up to {top}, outside the model's vocabulary [0, {vocab})")
    if args.stride is not None and args.stride > context:
        raise UserError(f"--stride {args.stride} exceeds the context length {context}; a token would go unscored")
    if args.val_tokens is not None:
        if args.stride is not None:
            raise UserError("--val-tokens scores whole windows spread over the file: give it without --stride")
        batches = EvalBatches(ids, args.batch_size, context, device, windows=-(-args.val_tokens // context))
    else:
        batches = EvalBatches(ids, args.batch_size, context, device, stride=args.stride, score_once=True)
    # Autocast for reduced precision; float32/float64 weights were already converted by --dtype.
    autocast = dtype_from_name(args.dtype) if args.dtype in ("bfloat16", "float16") else None
    with progress_bar(False if args.quiet else None, total=len(batches), unit="batch", desc="evaluating") as bar:
        result = evaluate(
            model, _counted(batches, bar), autocast_dtype=autocast, token_bytes=_token_bytes(tokenizer, vocab)
        )
    report = {"checkpoint": str(artifact.path), "data": args.data, "context_length": context,
              "stride": args.stride or context, **result.to_dict()}  # fmt: skip
    if args.json:
        print(json.dumps(report))
        return 0
    bpb = "n/a (no tokenizer)" if result.bits_per_byte is None else f"{result.bits_per_byte:.4f}"
    print(f"tokens {result.tokens:,}  loss {result.loss:.4f}  perplexity {result.perplexity:.3f}  bits/byte {bpb}")
    if not math.isfinite(result.loss):
        say("the loss is not finite: the checkpoint's weights or the data are not what they should be")
    return 0


def _counted(batches: Any, bar: Any) -> Any:
    for batch in batches:
        yield batch
        bar.update()
