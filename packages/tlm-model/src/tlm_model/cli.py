"""The ``tlm`` command line.

``tlm info [--preset NAME]`` describes preset models; ``tlm accounting`` prints the parameter,
memory and FLOP accounting of one preset or compares several; ``tlm generate`` continues a
sequence of token ids with a model (random weights, or a checkpoint).
"""

import argparse
import dataclasses
import json
import pathlib
import sys
import time
from collections.abc import Sequence

import torch

from tlm_model.accounting import COMPONENTS, Accounting, account
from tlm_model.config import PRESETS, ModelConfig
from tlm_model.generate import generate
from tlm_model.lm import TransformerLM


def _count(cfg: ModelConfig) -> int:
    # The meta device gives real module shapes without allocating a byte.
    return TransformerLM.from_config(cfg, device="meta").num_parameters()


def _info(args: argparse.Namespace) -> int:
    if args.preset is None:
        width = max(map(len, PRESETS))
        for name, cfg in PRESETS.items():
            print(f"{name:<{width}}  {_count(cfg):>14,} parameters  ({cfg.num_layers} layers, d_model {cfg.d_model})")
        return 0
    cfg = ModelConfig.from_preset(args.preset)
    params = _count(cfg)
    if args.json:
        print(json.dumps({"preset": args.preset, **cfg.to_dict(), "d_head": cfg.d_head, "parameters": params}))
        return 0
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


def _accounting(args: argparse.Namespace) -> int:
    names = args.compare or [args.preset]
    reports = []
    for name in names:
        cfg = ModelConfig.from_preset(name)
        if args.context_length is not None:
            cfg = dataclasses.replace(cfg, context_length=args.context_length)
        reports.append((name, account(cfg, batch_size=args.batch_size, seq_len=cfg.context_length)))
    if args.json:
        payload = {name: report.to_dict() for name, report in reports}
        print(json.dumps(payload if args.compare else payload[names[0]], indent=2))
    elif args.compare:
        print(format_comparison(reports))
    else:
        print(format_report(*reports[0]))
    if args.plot:
        from tlm_model.plot import plot_shares

        plot_shares(reports, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


class _Progress:
    """A one-line progress bar on stderr: ``[#####.....] 120/240 tokens, 85.3 tok/s``."""

    def __init__(self, total: int, width: int = 30) -> None:
        self.total, self.width, self.start = total, width, time.perf_counter()

    def __call__(self, done: int) -> None:
        filled = self.width * done // max(self.total, 1)
        rate = done / max(time.perf_counter() - self.start, 1e-9)
        bar = "#" * filled + "." * (self.width - filled)
        end = "\n" if done >= self.total else ""
        print(f"\r[{bar}] {done}/{self.total} tokens, {rate:.1f} tok/s", end=end, file=sys.stderr, flush=True)


def _load_model(args: argparse.Namespace) -> TransformerLM:
    if args.checkpoint is None:
        if args.preset is None:
            raise SystemExit("tlm generate: give --preset (random weights) or --checkpoint")
        torch.manual_seed(args.seed)
        return TransformerLM.from_preset(args.preset)
    path = pathlib.Path(args.checkpoint)
    if path.is_dir():  # written by tlm_model.save_checkpoint: weights + config.json
        from tlm_model.checkpoint import load_checkpoint

        config = ModelConfig.from_preset(args.preset) if args.preset else None
        return load_checkpoint(path, config=config)
    if args.preset is None:
        raise SystemExit("tlm generate: a state-dict file carries no config; give --preset too")
    if not path.exists():
        raise SystemExit(f"tlm generate: checkpoint {path} does not exist")
    model = TransformerLM.from_preset(args.preset, device="meta")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state, assign=True)
    model.rope.to_empty(device="cpu")  # the RoPE table is not in the state dict; rebuild it
    return model


def _generate(args: argparse.Namespace) -> int:
    try:
        prompt = [int(tok) for tok in args.prompt_ids.replace(",", " ").split()]
    except ValueError:
        raise SystemExit(
            f"tlm generate: --prompt-ids must be integers separated by spaces, got {args.prompt_ids!r}"
        ) from None
    model = _load_model(args).eval()
    generator = torch.Generator().manual_seed(args.seed)
    out = generate(
        model,
        torch.tensor(prompt),
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_token_id=args.eos_id,
        generator=generator,
        on_token=None if args.quiet else _Progress(args.max_new_tokens),
    )
    print(" ".join(map(str, out[len(prompt) :].tolist())))
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tlm", description="tlm: a from-scratch Transformer language model.")
    commands = parser.add_subparsers(dest="command", required=True)

    info = commands.add_parser("info", help="show a preset's configuration and parameter count")
    info.add_argument("--preset", choices=sorted(PRESETS), help="a preset name; omit to list them all")
    info.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
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
    acc.add_argument("--plot", metavar="FILE.png", help="also draw the FLOP shares as stacked bars (needs matplotlib)")
    acc.set_defaults(handler=_accounting)

    gen = commands.add_parser(
        "generate",
        help="continue a sequence of token ids (KV-cached decoding)",
        description="Prints the new token ids on stdout; a progress bar goes to stderr.",
    )
    gen.add_argument("--preset", choices=sorted(PRESETS), help="model shape (random weights without --checkpoint)")
    gen.add_argument(
        "--checkpoint", metavar="PATH", help="a save_checkpoint directory, or a .safetensors / torch.save state dict"
    )
    gen.add_argument("--prompt-ids", required=True, metavar='"ID ID ..."', help="the prompt's token ids")
    gen.add_argument("--max-new-tokens", type=_positive_int, required=True, metavar="N")
    gen.add_argument("--temperature", type=float, default=1.0, help="0 decodes greedily (default 1.0)")
    gen.add_argument("--top-k", type=_positive_int, default=None, metavar="K")
    gen.add_argument("--top-p", type=float, default=None, metavar="P")
    gen.add_argument("--eos-id", type=int, default=None, metavar="ID", help="stop once this id is generated")
    gen.add_argument("--seed", type=int, default=0, help="seeds the sampler (and random weights)")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    gen.set_defaults(handler=_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
