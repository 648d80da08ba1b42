"""The ``tlm`` command line. ``tlm info --preset NAME`` describes a preset model."""

import argparse
import json
import sys
from collections.abc import Sequence

from tlm_model.config import PRESETS, ModelConfig
from tlm_model.lm import TransformerLM


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


def _count(cfg: ModelConfig) -> int:
    # The meta device gives real module shapes without allocating a byte.
    return TransformerLM.from_config(cfg, device="meta").num_parameters()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tlm", description="tlm: a from-scratch Transformer language model.")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="show a preset's configuration and parameter count")
    info.add_argument("--preset", choices=sorted(PRESETS), help="a preset name; omit to list them all")
    info.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    info.set_defaults(handler=_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
