"""``tlm info``: the presets, one preset, or what an artifact (run, step, model file, HF folder) holds."""

import argparse
import json
from typing import Any

from tlm_command.args import add_command
from tlm_model.config import PRESETS, ModelConfig


def add_parser(commands: Any) -> None:
    parser = add_command(
        commands,
        "info",
        "describe the presets, one preset, or a run, checkpoint or HF folder",
        "Without arguments: every preset with its parameter count.",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--preset", choices=sorted(PRESETS), help="describe this preset")
    which.add_argument(
        "--checkpoint", metavar="PATH", help="describe a run folder, step folder, model file or HF folder"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(run=run)


def _count(config: ModelConfig) -> int:
    from tlm_model.accounting import shape_model

    return sum(p.numel() for p in shape_model(config).parameters())  # meta device: shapes, no memory


def describe(config: ModelConfig) -> dict[str, Any]:
    return {**config.to_dict(), "d_head": config.d_head, "parameters": _count(config)}


def run(args: argparse.Namespace) -> int:
    if args.checkpoint is not None:
        return _artifact(args)
    if args.preset is None:
        if args.json:
            print(json.dumps({name: {"preset": name, **describe(cfg)} for name, cfg in PRESETS.items()}))
            return 0
        width = max(map(len, PRESETS))
        for name, cfg in PRESETS.items():
            print(f"{name:<{width}}  {_count(cfg):>14,} parameters  ({cfg.num_layers} layers, d_model {cfg.d_model})")
        return 0
    described = {"preset": args.preset, **describe(ModelConfig.from_preset(args.preset))}
    _print(described, args.json)
    return 0


def _print(described: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(described))
        return
    params = described["parameters"]
    rows = [(k, v) for k, v in described.items() if k != "parameters"]
    rows.append(("parameters", f"{params:,} ({params / 1e9:.3f} B)"))
    rows.append(("float32 weights", f"{4 * params / 1e9:.2f} GB ({4 * params / 2**30:.2f} GiB)"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def _artifact(args: argparse.Namespace) -> int:
    import tlm_artifacts

    artifact = tlm_artifacts.resolve(args.checkpoint)
    described: dict[str, Any] = {"path": str(artifact.path), "kind": artifact.describe()}
    if artifact.run is not None:
        steps = tlm_artifacts.StepFolders(artifact.run.checkpoints_dir).steps()
        described["run"] = str(artifact.run.path)
        described["steps"] = ", ".join(map(str, steps)) if not args.json else steps
    if artifact.kind not in ("hf", "peft"):
        described["step"] = tlm_artifacts.model_file(artifact)[1]
    if (found := tlm_artifacts.lora_step(artifact)) is not None:  # a LoRA run: adapters over a named base
        lora = found[1]["lora"]
        described["lora"] = (
            {k: v for k, v in lora.items() if k != "base"} | {"base": lora["base"]["path"]}
            if args.json
            else f"rank {lora['rank']}, alpha {lora['alpha']:g} on {lora['targets']}, base {lora['base']['path']}"
        )
    described["tokenizer"] = str(artifact.tokenizer_path) if artifact.tokenizer_path is not None else None
    described.update(describe(tlm_artifacts.model_config(artifact)))
    _print(described, args.json)
    return 0
