"""The ``tlm`` command line.

``tlm info [--preset NAME] [--json]`` describes preset models; ``tlm accounting`` prints the
parameter, memory and FLOP accounting of one preset or compares several; ``tlm generate`` continues
a sequence of token ids with a model (random weights, or a checkpoint read by
:func:`tlm_model.load_checkpoint`); ``tlm convert --from-hf DIR --out DIR`` turns an HF Llama folder
into a tlm checkpoint and ``tlm convert --to-hf CHECKPOINT --out DIR`` the reverse.
``python -m tlm_model`` is the same command.

Every user error prints one line, ``tlm: error: ...``, and exits with status 2; Ctrl-C exits
with 130. Other packages add subcommands through the ``tlm.cli`` entry-point group: each entry
point is a callable ``register(subparsers)`` that adds its parsers and sets
``set_defaults(handler=fn)``, where ``fn(args) -> int``. A handler's ``ValueError``, ``TypeError``
or ``OSError`` becomes the one-line error; a plugin that fails to load is skipped with a warning.
"""

import argparse
import contextlib
import dataclasses
import importlib.metadata
import json
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import torch

from tlm_model import __version__
from tlm_model.accounting import COMPONENTS, Accounting, account
from tlm_model.checkpoint import load_checkpoint, save_checkpoint
from tlm_model.config import PRESETS, ModelConfig
from tlm_model.generate import generate
from tlm_model.interop import from_hf, save_hf
from tlm_model.lm import TransformerLM
from tlm_model.train_memory import TrainMemory, train_memory

PLUGIN_GROUP = "tlm.cli"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class UserError(Exception):
    """A mistake in the command line or its inputs: printed as one line, exit status 2."""


def _count(cfg: ModelConfig) -> int:
    # The meta device gives real module shapes without allocating a byte.
    return TransformerLM.from_config(cfg, device="meta").num_parameters()


def _describe(name: str, cfg: ModelConfig) -> dict[str, Any]:
    return {"preset": name, **cfg.to_dict(), "d_head": cfg.d_head, "parameters": _count(cfg)}


def _info(args: argparse.Namespace) -> int:
    if args.preset is None:
        if args.json:
            print(json.dumps({name: _describe(name, cfg) for name, cfg in PRESETS.items()}))
            return 0
        width = max(map(len, PRESETS))
        for name, cfg in PRESETS.items():
            print(f"{name:<{width}}  {_count(cfg):>14,} parameters  ({cfg.num_layers} layers, d_model {cfg.d_model})")
        return 0
    cfg = ModelConfig.from_preset(args.preset)
    described = _describe(args.preset, cfg)
    if args.json:
        print(json.dumps(described))
        return 0
    params = described["parameters"]
    rows = [("preset", args.preset), *cfg.to_dict().items(), ("d_head", cfg.d_head)]
    rows.append(("parameters", f"{params:,} ({params / 1e9:.3f} B)"))
    rows.append(("float32 weights", f"{4 * params / 1e9:.2f} GB ({4 * params / 2**30:.2f} GiB)"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def human(n: float, unit: str = "") -> str:
    """1.234e12 -> '1.234 T' + unit (decimal prefixes)."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= factor:
            return f"{n / factor:.3f} {prefix}{unit}"
    return f"{n:.0f} {unit}".rstrip()


def format_report(name: str, report: Accounting) -> str:
    cfg = report.config
    lines = [
        f"{name}: {cfg.num_layers} layers, d_model {cfg.d_model}, {cfg.num_heads} heads, d_ff {cfg.d_ff}, "
        f"vocab {cfg.vocab_size}; batch {report.batch_size} × seq {report.seq_len}",
        "",
        "Parameters",
    ]
    for component, count in report.params.items():
        lines.append(f"  {component:<20} {count:>15,}  {100 * count / report.params_total:6.2f}%")
    lines.append(f"  {'total':<20} {report.params_total:>15,}")
    lines += [
        "",
        "Memory (parameters only; activations excluded)",
        "  "
        + ", ".join(f"{dtype} {human(report.param_bytes(dtype), 'B')}" for dtype in ("float32", "bfloat16", "float16")),
        "  float32 training state (params + grads + AdamW m, v = 16 B/param): "
        + human(report.training_state_bytes, "B"),
        "",
        "Forward matmul FLOPs (2·m·n·p each)     full QKᵀ (seed)    share     causal (i ≥ j)    share",
    ]
    full, causal = report.component_flops, report.component_flops_causal
    shares, causal_shares = report.shares(), report.shares(causal=True)
    for component, label in COMPONENTS.items():
        lines.append(
            f"  {label:<36} {human(full[component], 'FLOP'):>16} {100 * shares[component]:7.2f}%  "
            f"{human(causal[component], 'FLOP'):>16} {100 * causal_shares[component]:7.2f}%"
        )
    lines.append(
        f"  {'total':<36} {human(report.forward_flops, 'FLOP'):>16}           "
        f"{human(report.forward_flops_causal, 'FLOP'):>16}"
    )
    lines += ["", "Every matrix multiply of one forward pass"]
    for mm in report.matmuls:
        lines.append(f"  {mm.name:<13} {mm.shapes:<28} × {mm.count:<6} {mm.flops:>22,} FLOP")
    lines += ["", "Elementwise work (estimate; not in the matmul totals)"]
    for part, flops in report.elementwise_flops.items():
        lines.append(f"  {part:<12} {human(flops, 'FLOP'):>16}")
    lines.append(
        f"  {'total':<12} {human(report.elementwise_flops_total, 'FLOP'):>16}  "
        f"({100 * report.elementwise_flops_total / report.forward_flops:.2f}% of the matmul FLOPs)"
    )
    lines += [
        "",
        f"Training: backward ≈ 2 × forward = {human(2 * report.forward_flops, 'FLOP')}; "
        f"one step ≈ {human(report.training_flops, 'FLOP')} = {human(report.training_flops / report.tokens, 'FLOP')} "
        f"per token",
    ]
    return "\n".join(lines)


def format_comparison(reports: Sequence[tuple[str, Accounting]]) -> str:
    width = max(14, *(len(name) + 2 for name, _ in reports))
    header = f"{'share of forward FLOPs':<36}" + "".join(f"{name:>{width}}" for name, _ in reports)
    lines = [header]
    for component, label in COMPONENTS.items():
        lines.append(f"{label:<36}" + "".join(f"{100 * r.shares()[component]:>{width - 1}.2f}%" for _, r in reports))
    lines.append(
        f"{'forward FLOPs (full QKᵀ)':<36}" + "".join(f"{human(r.forward_flops, 'F'):>{width}}" for _, r in reports)
    )
    lines.append(
        f"{'forward FLOPs (causal)':<36}"
        + "".join(f"{human(r.forward_flops_causal, 'F'):>{width}}" for _, r in reports)
    )
    lines.append(f"{'parameters':<36}" + "".join(f"{r.params_total / 1e6:>{width - 2},.1f} M" for _, r in reports))
    seqs = sorted({r.seq_len for _, r in reports})
    lines.append(f"(batch {reports[0][1].batch_size} × seq {', '.join(map(str, seqs))})")
    return "\n".join(lines)


def _check_plot_target(path: str) -> None:
    """Everything --plot needs, checked before any work: matplotlib, the folder, the format."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'tlm-model[plot]' (or pip install matplotlib)") from None
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UserError(f"--plot {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise UserError(f"--plot {path}: the folder {folder} is not writable")
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise UserError(f"--plot {path}: unknown image format {suffix!r}; expected one of {sorted(formats)}")


def _training_memory(args: argparse.Namespace, cfg: ModelConfig) -> list[TrainMemory]:
    return [
        train_memory(
            cfg,
            mode=mode,
            world_size=args.world_size,
            batch_size=args.batch_size,
            activation_checkpointing=args.activation_checkpointing,
        )
        for mode in ("ddp", "fsdp")
    ]


def format_training_memory(memory: Sequence[TrainMemory]) -> str:
    """Rank 0's training memory under DDP and FSDP2, float32 weights and AdamW state."""
    first = memory[0]
    checkpointing = "with" if first.activation_checkpointing else "without"
    lines = [
        "",
        f"Training memory per rank (rank 0 of {first.world_size}, {first.tokens:,} tokens per rank and micro-batch, "
        f"float32, AdamW, {checkpointing} activation checkpointing):",
        f"  {'':<28}" + "".join(f"{m.mode.upper():>14}" for m in memory),
    ]
    rows = [
        ("parameters", "parameters"),
        ("gradients", "gradients"),
        ("AdamW state (m, v)", "optimizer"),
        ("gathered (FSDP2 unshard)", "gathered"),
        ("activations kept", "activations"),
        ("recomputed (one block)", "recomputed"),
    ]
    for label, field in rows:
        lines.append(f"  {label:<28}" + "".join(f"{human(getattr(m, field), 'B'):>14}" for m in memory))
    lines.append(f"  {'total':<28}" + "".join(f"{human(m.total, 'B'):>14}" for m in memory))
    lines.append(
        f"  {'activations per token':<28}" + "".join(f"{human(m.activations_per_token, 'B'):>14}" for m in memory)
    )
    return "\n".join(lines)


def _accounting(args: argparse.Namespace) -> int:
    if args.world_size is not None and args.compare:
        raise UserError("--world-size reports one model: use it with --preset, not --compare")
    if args.activation_checkpointing and args.world_size is None:
        raise UserError("--activation-checkpointing applies to the training memory: give --world-size N too")
    if args.plot:
        _check_plot_target(args.plot)
    names = args.compare or [args.preset]
    reports = []
    for name in names:
        cfg = ModelConfig.from_preset(name)
        if args.context_length is not None:
            cfg = dataclasses.replace(cfg, context_length=args.context_length)
        reports.append((name, account(cfg, batch_size=args.batch_size, seq_len=cfg.context_length)))
    memory = _training_memory(args, cfg) if args.world_size is not None else None
    if args.json:
        payload = {name: report.to_dict() for name, report in reports}
        single = payload[names[0]]
        if memory is not None:
            single["training_memory_per_rank"] = {m.mode: {**dataclasses.asdict(m), "total": m.total} for m in memory}
        print(json.dumps(payload if args.compare else single, indent=2))
    elif args.compare:
        print(format_comparison(reports))
    else:
        print(format_report(*reports[0]))
        if memory is not None:
            print(format_training_memory(memory))
    if args.plot:
        from tlm_model.plot import plot_shares

        plot_shares(reports, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


@contextlib.contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Callable[[int], None]]:
    """An ``on_token`` callback drawing a tqdm bar on stderr (none when stderr is not a terminal).

    The bar starts at the first new token, which comes out of the prefill: its rate counts decoding
    alone. Leaving the ``with`` block closes the bar's line on every path: early EOS, error, Ctrl-C.
    """
    from tqdm import tqdm

    bars: list[Any] = []

    def on_token(done: int) -> None:
        if not bars:
            bars.append(tqdm(total=total, initial=done, unit="tok", file=sys.stderr, disable=None if enabled else True,
                             dynamic_ncols=True))  # fmt: skip
        else:
            bars[0].update(done - bars[0].n)

    try:
        yield on_token
    finally:
        for bar in bars:
            bar.close()


def _token_ids(text: str, what: str) -> list[int]:
    try:
        ids = [int(tok) for tok in text.replace(",", " ").split()]
    except ValueError:
        raise UserError(f"{what} must be integers separated by spaces or commas, got {text!r}") from None
    if not ids:
        raise UserError(f"{what} is empty; give at least one token id")
    return ids


def _prompt(ids: list[int], args: argparse.Namespace, model: TransformerLM) -> list[int]:
    """The prompt's token ids checked against the model (a tokenizer's ids would go through here too)."""
    vocab = model.config.vocab_size
    if bad := [i for i in ids if not 0 <= i < vocab]:
        raise UserError(f"--prompt-ids must be in [0, {vocab}) for this model's vocabulary, got {bad[:5]}")
    if args.eos_id is not None and not 0 <= args.eos_id < vocab:
        raise UserError(f"--eos-id must be in [0, {vocab}) for this model's vocabulary, got {args.eos_id}")
    return ids


def _load_tokenizer(args: argparse.Namespace) -> Any:
    """The ``--tokenizer`` folder as a ``tlm_tokenizer.Tokenizer``, or None; ``--prompt`` needs one."""
    if args.tokenizer is None:
        if args.prompt is not None:
            raise UserError("--prompt needs --tokenizer DIR to turn the text into ids (or give --prompt-ids)")
        return None
    try:
        from tlm_tokenizer import Tokenizer
    except ImportError:
        raise UserError("--tokenizer needs the tlm-tokenizer package: pip install tlm-tokenizer") from None
    return Tokenizer.load(args.tokenizer)


def _token_ids_of(args: argparse.Namespace, tokenizer: Any) -> list[int]:
    if args.prompt is None:
        return _token_ids(args.prompt_ids, "--prompt-ids")
    ids = tokenizer.encode(args.prompt)
    if not ids:
        raise UserError("--prompt is empty; give some text")
    return ids


def _emit(new_ids: list[int], tokenizer: Any) -> None:
    """Print the continuation: as text through the tokenizer, else as ids."""
    print(tokenizer.decode(new_ids) if tokenizer is not None else " ".join(map(str, new_ids)))


def _device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError:
        raise UserError(f"--device must be a torch device such as cpu, cuda or cuda:1, got {text!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {text}: this torch has no CUDA device")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UserError(f"--device {text}: only {torch.cuda.device_count()} CUDA device(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"--device {text}: MPS is not available")
    return device


def _load_model(args: argparse.Namespace, device: torch.device) -> TransformerLM:
    dtype = DTYPES[args.dtype] if args.dtype else None
    if args.checkpoint is None:
        if args.preset is None:
            raise UserError("generate needs --preset (random weights) or --checkpoint")
        torch.manual_seed(args.seed)
        return TransformerLM.from_preset(args.preset, device=device, dtype=dtype)
    config = ModelConfig.from_preset(args.preset) if args.preset else None
    return load_checkpoint(args.checkpoint, config=config, device=device, dtype=dtype)


def _generate(args: argparse.Namespace) -> int:
    device = _device(args.device)
    tokenizer = _load_tokenizer(args)
    ids = _token_ids_of(args, tokenizer)  # before the model loads: a typo fails fast
    model = _load_model(args, device).eval()
    prompt = _prompt(ids, args, model)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    with _progress(args.max_new_tokens, enabled=not args.quiet) as on_token:
        out = generate(
            model,
            torch.tensor(prompt, device=device),
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            eos_token_id=args.eos_id,
            generator=generator,
            on_token=on_token,
        )
    _emit(out[len(prompt) :].tolist(), tokenizer)
    return 0


def _convert(args: argparse.Namespace) -> int:
    dtype = DTYPES[args.dtype] if args.dtype else None
    if args.from_hf is not None:
        model = from_hf(args.from_hf, dtype=dtype)
        save_checkpoint(model, args.out)
        source, target = "HF Llama folder", "tlm checkpoint"
    else:
        model = load_checkpoint(args.to_hf, dtype=dtype)
        save_hf(model, args.out)
        source, target = "tlm checkpoint", "HF Llama folder"
    report = {"from": args.from_hf or args.to_hf, "out": args.out, "parameters": model.num_parameters(),
              "config": model.config.to_dict()}  # fmt: skip
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{source} {report['from']} -> {target} {args.out} ({human(report['parameters'])} parameters)")
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (0 decodes greedily), got {text!r}")
    return value


def _top_p(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


def _token_id(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a token id (an integer >= 0), got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a token id (an integer >= 0), got {value}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line: ``tlm: error: <command>: <message>``."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("tlm").strip()
        where = f"{command}: " if command else ""
        self.exit(2, f"tlm: error: {where}{message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The built-in commands plus every plugin of the ``tlm.cli`` entry-point group."""
    parser = _Parser(prog="tlm", description="tlm: a from-scratch Transformer language model.")
    parser.add_argument("--version", action="version", version=f"tlm {__version__} (tlm-model)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    info = commands.add_parser("info", help="show a preset's configuration and parameter count")
    info.add_argument("--preset", choices=sorted(PRESETS), help="a preset name; omit to list them all")
    info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    info.set_defaults(handler=_info)

    acc = commands.add_parser(
        "accounting",
        help="parameters, memory and FLOPs of a preset, or component shares across presets",
        description="Analytic accounting: exact parameter and matmul FLOP counts, elementwise work as an estimate.",
    )
    which = acc.add_mutually_exclusive_group(required=True)
    which.add_argument("--preset", choices=sorted(PRESETS), help="report one preset in full")
    which.add_argument("--compare", nargs="+", choices=sorted(PRESETS), metavar="PRESET",
                       help="compare the FLOP shares of several presets side by side")  # fmt: skip
    acc.add_argument("--context-length", type=_positive_int, metavar="N",
                     help="sequence length to account for (default: the preset's context length)")  # fmt: skip
    acc.add_argument("--batch-size", type=_positive_int, default=1, metavar="B", help="default 1")
    acc.add_argument("--json", action="store_true", help="print JSON instead of tables")
    acc.add_argument("--world-size", type=_positive_int, metavar="N",
                     help="also report per-rank training memory under DDP and FSDP2 at N ranks")  # fmt: skip
    acc.add_argument("--activation-checkpointing", action="store_true",
                     help="with --world-size: per-block activation checkpointing")  # fmt: skip
    acc.add_argument("--plot", metavar="FILE.png", help="also draw the FLOP shares as stacked bars (needs matplotlib)")
    acc.set_defaults(handler=_accounting)

    gen = commands.add_parser(
        "generate",
        help="continue a sequence of token ids (KV-cached decoding)",
        description=(
            "Prints the new token ids (with --tokenizer, the text) on stdout; "
            "a progress bar goes to stderr when it is a terminal."
        ),
    )
    gen.add_argument("--preset", choices=sorted(PRESETS), help="model shape (random weights without --checkpoint)")
    gen.add_argument(
        "--checkpoint",
        metavar="PATH",
        help="a save_checkpoint folder or file, or a state-dict file (.safetensors, .pt) with --preset",
    )
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-ids", metavar='"ID ID ..."', help="the prompt's token ids")
    prompt.add_argument("--prompt", metavar="TEXT", help="the prompt as text (needs --tokenizer)")
    gen.add_argument("--tokenizer", metavar="DIR", help="a tlm-tokenizer folder: encodes --prompt, decodes the output")
    gen.add_argument("--max-new-tokens", type=_positive_int, required=True, metavar="N")
    gen.add_argument("--temperature", type=_temperature, default=1.0, help="0 decodes greedily (default 1.0)")
    gen.add_argument("--top-k", type=_positive_int, default=None, metavar="K")
    gen.add_argument("--top-p", type=_top_p, default=None, metavar="P", help="nucleus sampling, in (0, 1]")
    gen.add_argument("--eos-id", type=_token_id, default=None, metavar="ID", help="stop once this id is generated")
    gen.add_argument("--seed", type=int, default=0, help="seeds the sampler (and random weights)")
    gen.add_argument("--device", default="cpu", help="torch device to run on (default cpu)")
    gen.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                     help="weights' dtype (default: the checkpoint's, float32 for random weights)")  # fmt: skip
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    gen.set_defaults(handler=_generate)

    conv = commands.add_parser(
        "convert",
        help="convert between an HF Llama folder and a tlm checkpoint",
        description="--from-hf reads config.json + safetensors (sharded or not) and writes a tlm checkpoint; "
        "--to-hf writes config.json + model.safetensors that transformers' from_pretrained loads. "
        "Settings tlm does not compute (biases, sliding window, unknown keys) are refused by name.",
    )
    direction = conv.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", metavar="DIR", help="an HF Llama model folder")
    direction.add_argument("--to-hf", metavar="CHECKPOINT", help="a tlm checkpoint (save_checkpoint folder or file)")
    conv.add_argument("--out", required=True, metavar="DIR", help="the folder to write")
    conv.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="convert the weights (default: as stored)")
    conv.add_argument("--json", action="store_true", help="print a JSON summary")
    conv.set_defaults(handler=_convert)

    _load_plugins(commands)
    return parser


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]


def _load_plugins(commands: Any) -> None:
    for entry_point in importlib.metadata.entry_points(group=PLUGIN_GROUP):
        try:
            entry_point.load()(commands)
        except Exception as err:  # a broken plugin must not take the built-in commands down
            print(f"tlm: warning: plugin {entry_point.name!r} ({entry_point.value}) not loaded: "
                  f"{type(err).__name__}: {_first_line(err)}", file=sys.stderr)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tlm`` command; returns 0. A user error prints one line and raises ``SystemExit(2)``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except (UserError, ValueError, TypeError, OSError) as err:
        if isinstance(err, OSError) and err.filename is not None and err.strerror:
            message = f"{err.strerror}: {err.filename}"
        else:
            message = _first_line(err)
        parser.exit(2, f"tlm: error: {message}\n")
    except KeyboardInterrupt:
        parser.exit(130, "tlm: interrupted\n")
