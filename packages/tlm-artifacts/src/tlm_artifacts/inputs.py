"""What reading an artifact opens: the paths a command must never write over.

A LoRA run (or a step of one) reads its base model again each time it opens, and a PEFT adapter folder reads the
base its ``adapter_config.json`` names: a command that writes a folder (``tlm convert --out``, ``tlm train
--out-dir``) compares its output with every one of these, not only with the path it was given.
"""

import os
from pathlib import Path

__all__ = ["read_paths"]


def read_paths(path: str | os.PathLike[str]) -> list[Path]:
    """``path`` and every base model opening it reads (a LoRA run's or step's ``--init-from``, a PEFT adapter's
    ``base_model_name_or_path``, and that base's own in turn), each once, in that order. A path that is not an
    artifact tlm opens is returned alone: the command's own reader says what is wrong with it."""
    from tlm_artifacts.artifact import lora_step, resolve
    from tlm_artifacts.lora import peft_base_path

    found: list[Path] = []
    seen: set[Path] = set()
    todo: list[Path] = [Path(path)]
    while todo:
        current = todo.pop()
        if current.resolve() in seen:
            continue
        seen.add(current.resolve())
        found.append(current)
        try:
            artifact = resolve(current)
            if artifact.kind == "peft":
                todo.append(peft_base_path(artifact.path))
            elif (step := lora_step(artifact)) is not None:
                todo.append(Path(step[1]["lora"]["base"]["path"]))
        except (OSError, ValueError):
            continue  # not an artifact (or damaged): nothing more to name; its reader refuses it in one line
    return found
