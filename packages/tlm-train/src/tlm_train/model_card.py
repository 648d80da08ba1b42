"""The ``README.md`` model card of an HF export (``tlm convert --to-hf``): what the model is and how it was
trained, as far as its run folder tells.

The Hub's model card format: YAML metadata between ``---`` lines (``library_name``, ``tags``, ``license``), then
Markdown. The license is left for the user to set: tlm cannot know the terms of the data a model learned from.
Training facts come from the run folder when the export is of a run or of one of its steps: the data files and
their token counts (``RUN/data/info.json``), the step and the planned steps (``train.toml``) and the last
validation loss up to that step (``metrics.jsonl``).
"""

import json
from importlib import metadata
from typing import Any

from tlm_core.atomic import read_input


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:  # pragma: no cover - run from sources without an install
        return "unknown"


def _training(artifact: Any, step: int | None) -> list[str]:
    run = getattr(artifact, "run", None)
    if run is None:
        return ["Not known: this export was not made from a tlm run folder."]
    lines = []
    from tlm_train.run_dir import RunDir

    try:
        config = RunDir(run.path).read_config()
    except (OSError, ValueError):
        config = None
    info: dict[str, Any] = {}
    try:
        info = json.loads(read_input(run.data_dir / "info.json", "run data record"))  # a FIFO: skipped, no hang
    except (OSError, ValueError):
        pass
    sources = info.get("sources", config.data if config is not None else [])
    lines.append(f"- Training data: {', '.join(f'`{s}`' for s in sources) if sources else 'tlm’s built-in corpus'}")
    if config is not None and config.val_data:
        lines.append(f"- Validation data: {', '.join(f'`{s}`' for s in config.val_data)}")
    if "train" in info:
        lines.append(f"- Tokens: {info['train']:,} for training, {info.get('val', 0):,} for validation")
    if isinstance(info.get("chat"), dict):
        chat = info["chat"]
        lines.append(
            f"- Chat fine-tuning: {chat.get('examples')} conversations, loss on `{chat.get('train_on')}` tokens"
        )
    if step is not None:
        planned = f" of {config.total_steps()}" if config is not None else ""
        lines.append(f"- Steps: {step}{planned}")
    if config is not None and config.init_from:
        lines.append(f"- Fine-tuned from: `{config.init_from}`")
    losses = [
        r["val_loss"]
        for r in _records(run)
        if isinstance(r.get("val_loss"), (int, float)) and (step is None or r.get("step", 0) <= step)
    ]
    lines.append(f"- Final validation loss: {losses[-1]:.4f}" if losses else "- Final validation loss: not recorded")
    return lines


def _records(run: Any) -> list[dict[str, Any]]:
    try:
        lines = read_input(run.metrics_path, "metrics log").decode("utf-8").splitlines()
    except (OSError, ValueError):  # missing, a FIFO or device, or not UTF-8: no losses to report
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            break
        if isinstance(record, dict):
            records.append(record)
    return records


def model_card(model: Any, tokenizer: Any, artifact: Any, step: int | None) -> bytes:
    """The card's bytes for ``model`` exported from ``artifact`` (at ``step``, when from a run)."""
    config = model.config.to_dict(drop_none=True)
    run = getattr(artifact, "run", None)
    name = (run.path if run is not None else artifact.path).resolve().name
    family = ("qwen2", "Qwen2") if model.config.qkv_bias else ("llama", "Llama")  # what save_hf writes it as
    out = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        f"tags: [tlm, {family[0]}]",
        "license: null  # set the license of these weights (and of the data they learned from) here",
        "---",
        "",
        f"# {name}",
        "",
        f"A {family[1]}-architecture language model trained with tlm, exported by `tlm convert --to-hf` from the tlm "
        f"{artifact.describe()} `{artifact.path}`.",
        "",
        "## Model",
        "",
        f"{model.num_parameters():,} parameters.",
        "",
        "| field | value |",
        "|---|---|",
        *(f"| {key} | {value} |" for key, value in config.items()),
        "",
        "## Training",
        "",
        *_training(artifact, step),
        "",
        "## Tokenizer",
        "",
    ]
    if tokenizer is None:
        out.append("None exported: the model works on token ids.")
    else:
        specials = ", ".join(f"`{s}`" for s in tokenizer.special_tokens) or "none"
        out.append(f"Byte-level BPE, {tokenizer.vocab_size:,} ids; special tokens: {specials}.")
        if tokenizer.chat_template is not None:
            out.append("It has a chat template (`tokenizer_config.json`): use `tokenizer.apply_chat_template`.")
    out += [
        "",
        "## Software",
        "",
        f"tlm-command {_version('tlm-command')}, tlm-model {_version('tlm-model')}, "
        f"tlm-train {_version('tlm-train')}, tlm-tokenizer {_version('tlm-tokenizer')}.",
        "",
        "## License",
        "",
        "Not set by tlm: fill in the `license` field above.",
        "",
    ]
    return "\n".join(out).encode("utf-8")
