"""``tlm tokenizer train|encode``: byte-level BPE on a text file, and a text file to token ids."""

import argparse
import json
import os
from typing import Any

from tlm_command.args import UserError, add_command, check_output, positive_int


def add_parser(commands: Any) -> None:
    parser = commands.add_parser("tokenizer", help="train a byte-level BPE tokenizer, or encode a text file to ids")
    sub = parser.add_subparsers(
        dest="tokenizer_command", metavar="{train,encode}", required=True, parser_class=type(parser)
    )

    train = add_command(
        sub,
        "train",
        "train byte-level BPE on a UTF-8 text file",
        "Writes DIR/tokenizer.json (HF tokenizers' format) and DIR/tokenizer_config.json, which tlm, "
        "HF tokenizers and transformers' AutoTokenizer all read. DIR must be new or hold only tokenizer files.",
    )
    train.add_argument("--input", required=True, metavar="FILE", help="UTF-8 training text")
    train.add_argument(
        "--vocab-size",
        type=positive_int,
        required=True,
        metavar="N",
        help="final vocabulary size, counting the 256 bytes and the special tokens",
    )
    train.add_argument(
        "--special-token",
        action="append",
        metavar="TOKEN",
        help="a special token such as '<|endoftext|>' (repeat for more)",
    )
    train.add_argument("--out", required=True, metavar="DIR", help="tokenizer folder to write (replaced whole)")
    _add_run_flags(train, None, "pre-tokenisation processes (default: CPU count, at most 8)")
    train.set_defaults(run=_train)

    encode = add_command(
        sub,
        "encode",
        "encode a UTF-8 text file to a flat token-id array",
        "Writes raw little-endian uint16 ids (uint32 for vocabularies over 65,536); "
        "read with numpy.memmap(FILE, dtype=..., mode='r'), or train on it with tlm train --data FILE.",
    )
    encode.add_argument("--tokenizer", required=True, metavar="DIR", help="a folder written by 'tokenizer train'")
    encode.add_argument("--input", required=True, metavar="FILE", help="UTF-8 text to encode")
    encode.add_argument("--out", required=True, metavar="FILE", help="token-id file to write")
    _add_run_flags(encode, 1, "processes")
    encode.set_defaults(run=_encode)


def _add_run_flags(parser: Any, workers: int | None, workers_help: str) -> None:
    """How a tokenizer subcommand runs and reports: ``--workers``, ``--json``, ``--quiet``."""
    parser.add_argument("--workers", type=positive_int, default=workers, metavar="N", help=workers_help)
    parser.add_argument("--json", action="store_true", help="print a JSON summary")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def _check_input(path: str) -> None:
    """``--input`` is an existing regular file: a folder, a device (``/dev/zero``) or a FIFO is refused."""
    from tlm_core.atomic import check_input

    if not os.path.exists(path):
        raise FileNotFoundError(f"--input: expected a text file, got {path!r} (no such file)")
    check_input(path, "--input")


def _train(args: argparse.Namespace) -> int:
    from tlm_tokenizer import Tokenizer, train_bpe

    _check_input(args.input)
    check_output(args.out, args.input)
    specials = args.special_token or []
    progress = False if args.quiet else None
    vocab, merges = train_bpe(args.input, args.vocab_size, specials, num_workers=args.workers, progress=progress)
    if not merges and args.vocab_size > len(vocab):  # an empty file (or one of lone characters): nothing learnt
        raise UserError(f"--input {args.input} holds no pair of characters to merge; give text to train on")
    Tokenizer(vocab, merges, specials).save(args.out)
    summary = {"out": args.out, "vocab_size": len(vocab), "merges": len(merges)}
    print(json.dumps(summary) if args.json else f"wrote {args.out}: {len(vocab)} tokens, {len(merges)} merges")
    return 0


def _encode(args: argparse.Namespace) -> int:
    from tlm_tokenizer import Tokenizer, encode_file

    _check_input(args.input)
    check_output(args.out, args.input, args.tokenizer)
    tokenizer = Tokenizer.load(args.tokenizer)
    count = encode_file(
        tokenizer, args.input, args.out, num_workers=args.workers, progress=False if args.quiet else None
    )
    summary = {"out": args.out, "tokens": count, "dtype": tokenizer.id_dtype}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"wrote {args.out}: {count} tokens as raw little-endian {tokenizer.id_dtype}")
    return 0
