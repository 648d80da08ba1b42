"""``tlm tokenizer train|encode``: a plug-in for the ``tlm`` command (entry point group ``tlm.cli``).

``register(subparsers)`` adds the ``tokenizer`` parser; each leaf sets ``handler(args) -> int``.
User errors are raised as ``ValueError``/``TypeError``/``OSError`` with a one-line message, which
the caller (``tlm``'s main, or ``python -m tlm_tokenizer``) prints as ``tlm: error: <msg>``, exit 2.
"""

import argparse
import json
import os
import sys
from typing import Any

from tlm_tokenizer.tokenizer import Tokenizer
from tlm_tokenizer.train import train_bpe

__all__ = ["register"]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _train(args: argparse.Namespace) -> int:
    if not os.path.isfile(args.input):
        raise FileNotFoundError(f"--input: expected a text file, got {args.input!r} (no such file)")
    vocab, merges = train_bpe(
        args.input,
        args.vocab_size,
        args.special_token or [],
        num_workers=args.workers,
        progress=False if args.quiet else None,
    )
    Tokenizer(vocab, merges, args.special_token or []).save(args.out)
    summary = {"out": args.out, "vocab_size": len(vocab), "merges": len(merges)}
    print(json.dumps(summary) if args.json else f"wrote {args.out}: {len(vocab)} tokens, {len(merges)} merges")
    return 0


def _encode(args: argparse.Namespace) -> int:
    if not os.path.isfile(args.input):
        raise FileNotFoundError(f"--input: expected a text file, got {args.input!r} (no such file)")
    tokenizer = Tokenizer.load(args.tokenizer)
    count = tokenizer.encode_file(
        args.input, args.out, num_workers=args.workers, progress=False if args.quiet else None
    )
    summary = {"out": args.out, "tokens": count, "dtype": tokenizer.id_dtype}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"wrote {args.out}: {count} tokens as raw little-endian {tokenizer.id_dtype}")
    return 0


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``tokenizer {train,encode}`` to an argparse subparsers object; returns the new parser."""
    parser = subparsers.add_parser(
        "tokenizer", help="train a byte-level BPE tokenizer, or encode a text file to token ids"
    )
    commands = parser.add_subparsers(dest="tokenizer_command", metavar="{train,encode}", required=True)

    train = commands.add_parser(
        "train",
        help="train byte-level BPE on a UTF-8 text file",
        description="Writes DIR/tokenizer.json (HF tokenizers' format) and DIR/tokenizer_config.json; "
        "DIR must be new or hold only tokenizer files.",
    )
    train.add_argument("--input", required=True, metavar="FILE", help="UTF-8 training text")
    train.add_argument("--vocab-size", type=_positive_int, required=True, metavar="N",
                       help="final vocabulary size, counting the 256 bytes and the special tokens")  # fmt: skip
    train.add_argument("--special-token", action="append", metavar="TOKEN",
                       help="a special token such as '<|endoftext|>' (repeat for more)")  # fmt: skip
    train.add_argument("--out", required=True, metavar="DIR", help="tokenizer directory to write (replaced whole)")
    train.add_argument("--workers", type=_positive_int, default=None, metavar="N",
                       help="pre-tokenisation processes (default: CPU count, at most 8)")  # fmt: skip
    train.add_argument("--json", action="store_true", help="print a JSON summary")
    train.add_argument("--quiet", action="store_true", help="no progress bars")
    train.set_defaults(handler=_train)

    encode = commands.add_parser(
        "encode",
        help="encode a UTF-8 text file to a flat token-id array",
        description="Writes raw little-endian uint16 ids (uint32 for vocabularies over 65,536); "
        "read with numpy.memmap(FILE, dtype=..., mode='r').",
    )
    encode.add_argument("--tokenizer", required=True, metavar="DIR", help="a directory written by 'tokenizer train'")
    encode.add_argument("--input", required=True, metavar="FILE", help="UTF-8 text to encode")
    encode.add_argument("--out", required=True, metavar="FILE", help="token-id file to write")
    encode.add_argument("--workers", type=_positive_int, default=1, metavar="N", help="processes (default 1)")
    encode.add_argument("--json", action="store_true", help="print a JSON summary")
    encode.add_argument("--quiet", action="store_true", help="no progress bar")
    encode.set_defaults(handler=_encode)
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m tlm_tokenizer") -> int:
    """Stand-alone entry point: the same ``tokenizer`` commands without tlm-model installed."""
    parser = argparse.ArgumentParser(prog=prog, description="tlm's byte-level BPE tokenizer")
    register(parser.add_subparsers(dest="command", metavar="tokenizer", required=True))
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, TypeError, OSError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        print(f"tlm: error: {message}", file=sys.stderr)
        return 2
