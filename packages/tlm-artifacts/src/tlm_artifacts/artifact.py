"""Any artifact a user points a command at: a run folder, a step folder, a model file, an HF Llama folder.

``tlm generate/eval/serve/convert/info --checkpoint X`` and ``tlm train --init-from X`` all go through
:func:`resolve`, then :func:`load_model` and :func:`load_tokenizer`: one dispatch by :attr:`Artifact.kind`.

| X | model | tokenizer |
|---|---|---|
| a run folder | its newest step that verifies (older ones when newer are damaged) | ``RUN/tokenizer/`` |
| a step folder ``RUN/checkpoints/step_N`` | its ``model.safetensors`` (a sharded step: its DCP shards) | the run's |
| a folder holding ``model.safetensors`` | that file | ``tokenizer/`` or ``tokenizer.json`` beside it |
| a ``.safetensors`` file | the file | as for its folder |
| an HF Llama folder (``config.json``) | ``tlm_model.from_hf`` | its ``tokenizer.json`` when tlm can read it |
| a PEFT LoRA adapter folder | its base (any of the above), adapter merged | its ``tokenizer.json``, else the base's |

A LoRA run (``tlm train --lora-rank``), or a step folder of one, opens as its base with the adapters merged
(:func:`load_lora_step`: the base is opened here, as any artifact, and :mod:`tlm_artifacts.lora` applies the
adapters); :func:`lora_step` tells one apart. A PEFT folder (``adapter_config.json``) names its
base in ``base_model_name_or_path``, relative to the adapter folder when not absolute.
"""

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tlm_artifacts.layout import ADAPTER_NAME, CHECKPOINT_DIR, STATE_NAME, TOKENIZER_DIR, RunFolder
from tlm_artifacts.lora import (
    BaseModelError,
    is_peft_folder,
    peft_base_path,
    peft_settings,
    read_adapter_file,
    with_adapters,
    with_peft_adapter,
)
from tlm_artifacts.steps import StepFolders, load_whole_step, read_sharded_tensors, read_step_config, step_of
from tlm_artifacts.train_state import load_train_state
from tlm_core.atomic import read_input
from tlm_lora import weights_sha256
from tlm_model import ModelConfig, TransformerLM
from tlm_model.checkpoint import WEIGHTS_NAME, read_config
from tlm_model.interop import CONFIG_NAME as HF_CONFIG
from tlm_tokenizer.hf_json import TOKENIZER_JSON as HF_TOKENIZER

KINDS = ("run", "step", "model", "hf", "peft")


@dataclass(frozen=True)
class Artifact:
    kind: str  # one of KINDS
    path: Path  # what the user gave
    model_path: Path  # the model file's folder (run: its checkpoints/ folder; hf: the HF folder)
    tokenizer_path: Path | None  # a folder (or tokenizer.json) that may hold a tokenizer
    run: RunFolder | None = None  # the run folder a run or step artifact belongs to

    def describe(self) -> str:
        return {
            "run": "run folder", "step": "step folder", "model": "model file", "hf": "HF Llama folder",
            "peft": "PEFT adapter folder",
        }[self.kind]  # fmt: skip


def resolve(path: str | os.PathLike[str]) -> Artifact:
    """What ``path`` is; ``FileNotFoundError``/``ValueError`` with one line when it is none of the kinds."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder")
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ValueError(f"{path} is not a model file (.safetensors), a run folder, a step folder or an HF folder")
        return Artifact("model", path, path, _tokenizer_near(path.parent))
    if path.name == CHECKPOINT_DIR and RunFolder.is_run(path.parent):
        path = path.parent
    if RunFolder.is_run(path):
        return Artifact("run", path, path / CHECKPOINT_DIR, path / TOKENIZER_DIR, RunFolder(path))
    if is_peft_folder(path):  # before the HF check: PEFT may save a config.json beside the adapter
        base_path = peft_base_path(path)
        if is_peft_folder(base_path):
            raise ValueError(
                f"{path}: its base {base_path} is another PEFT adapter; tlm applies one adapter to a model"
            )
        base = resolve(base_path)
        # tlm convert --to-peft writes the run's tokenizer (its chat template) beside the adapter: it wins.
        own = path / HF_TOKENIZER
        return Artifact("peft", path, path, own if own.is_file() else base.tokenizer_path)
    if (path / HF_CONFIG).is_file() and not _tlm_legacy_config(path / HF_CONFIG):
        return Artifact("hf", path, path, path if (path / HF_TOKENIZER).is_file() else None)
    if (path / WEIGHTS_NAME).is_file() or (path / STATE_NAME).is_file():  # a sharded step has no model file
        run = path.parent.parent if path.parent.name == CHECKPOINT_DIR else None
        if run is not None and RunFolder.is_run(run):
            return Artifact("step", path, path, run / TOKENIZER_DIR, RunFolder(run))
        if not (path / WEIGHTS_NAME).is_file():  # a sharded step folder copied out of its run
            return Artifact("step", path, path, _tokenizer_near(path))
        return Artifact("model", path, path, _tokenizer_near(path))
    raise ValueError(
        f"{path} is not a tlm run folder, step folder or model folder (no {WEIGHTS_NAME}), nor an HF Llama folder "
        f"(no {HF_CONFIG})"
    )


def _tlm_legacy_config(path: Path) -> bool:
    """Whether a config.json is tlm-model 0.1.0's (it carries a "format" field), not an HF model's."""
    try:
        data = json.loads(read_input(path, "config"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "format" in data and "model_type" not in data


def _tokenizer_near(folder: Path) -> Path | None:
    for candidate in (folder / TOKENIZER_DIR, folder / HF_TOKENIZER):
        if candidate.exists():
            return candidate
    return None


def model_file(artifact: Artifact) -> tuple[Path, int | None]:
    """The model file to read and the step it is from (None outside a run): for a run, its newest
    complete step (:func:`load_model` falls back to older ones if that one does not verify)."""
    if artifact.kind in ("hf", "peft"):
        raise ValueError(f"{artifact.path} is an {artifact.describe()}: it has no tlm model file")
    if artifact.kind != "run":
        return artifact.model_path, step_of(artifact.model_path) if artifact.kind == "step" else None
    folders = StepFolders(artifact.model_path)
    steps = folders.steps()
    if not steps:
        raise ValueError(f"{artifact.path} has no complete checkpoint yet (nothing in {artifact.model_path})")
    return folders.path(steps[-1]), steps[-1]


def model_config(artifact: Artifact) -> ModelConfig:
    """The config of the model ``artifact`` holds, read from its header or ``config.json`` (no weights)."""
    if artifact.kind == "hf":
        from tlm_model.interop import config_from_hf

        try:
            return config_from_hf(json.loads(read_input(artifact.path / HF_CONFIG, "HF config")))
        except json.JSONDecodeError as err:
            raise ValueError(f"{artifact.path / HF_CONFIG} is not valid JSON ({err})") from None
    if artifact.kind == "peft":
        return model_config(resolve(peft_base_path(artifact.path)))
    path, _ = model_file(artifact)
    return read_config(path) if artifact.kind == "model" else read_step_config(path)


def lora_step(artifact: Artifact) -> tuple[Path, dict[str, Any]] | None:
    """(step folder, its verified training state) when ``artifact`` is a LoRA run (its newest step) or a step
    folder of one; None for any other artifact."""
    if artifact.kind not in ("run", "step"):
        return None
    folder, _ = model_file(artifact)
    state = load_train_state(folder / STATE_NAME)
    return (folder, state) if state.get("lora") else None


def load_model(
    artifact: Artifact,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    on_damaged: Callable[[int, Exception], None] | None = None,
    **options: Any,
) -> tuple[TransformerLM, int | None]:
    """The model ``artifact`` holds (verified) and its step (None outside a run)."""
    if artifact.kind == "hf":
        from tlm_model import from_hf

        return from_hf(artifact.path, device=device, dtype=dtype, **options), None
    if artifact.kind == "peft":
        return load_peft(artifact.path, device=device, dtype=dtype, **options), None
    from tlm_model import load_model_file

    path, step = model_file(artifact)
    if artifact.kind == "model":
        return load_model_file(path, device=device, dtype=dtype, **options), step
    if artifact.kind == "step":  # either layout: a sharded step's weights are gathered here, in this process
        return load_step_model(path, device=device, dtype=dtype, **options), step
    manager = StepFolders(artifact.model_path)
    for step in reversed(manager.steps()):
        try:
            return load_step_model(manager.path(step), device=device, dtype=dtype, **options), step
        except BaseModelError:  # a LoRA run whose base changed: every step shares it
            raise
        except (ValueError, OSError) as err:  # damaged: say so and take the step before
            if on_damaged is not None:
                on_damaged(step, err)
    raise ValueError(f"{artifact.path}: every checkpoint is damaged; none can be read")


def load_step_model(
    folder: str | os.PathLike[str],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    **options: Any,
) -> TransformerLM:
    """The TransformerLM of a step folder (either layout; a LoRA step's base with its adapters merged), verified;
    ``dtype`` defaults to the saved one. ``options`` go to ``TransformerLM``."""
    if not (Path(folder) / WEIGHTS_NAME).is_file():
        state = load_train_state(Path(folder) / STATE_NAME)
        if state.get("lora"):  # the base the run adapted, the adapters merged in
            return load_lora_step(Path(folder), state, device=device, dtype=dtype, **options)
    return load_whole_step(folder, device=device, dtype=dtype, **options)


def load_base(path: str, *, expect_sha256: str | None, what: str) -> TransformerLM:
    """The float32 base model at ``path`` (any artifact tlm opens), refused when its weights' SHA-256 is not
    ``expect_sha256``."""
    if not Path(path).exists():
        raise BaseModelError(f"{what}: its base model {path} is gone (a LoRA run holds only adapters)")
    model, _ = load_model(resolve(path), dtype=torch.float32)
    if expect_sha256 is not None and weights_sha256(model.state_dict()) != expect_sha256:
        raise BaseModelError(
            f"{what}: the base model at {path} is not the one its adapters were trained on (its weights' SHA-256 "
            "differs)"
        )
    return model


def load_lora_step(
    folder: Path,
    state: dict[str, Any],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    merge: bool = True,
    **options: Any,
) -> TransformerLM:
    """The model of a LoRA step folder: its verified base with the adapters applied (merged unless ``merge``
    is False, when the LoRALinear modules stay in place, as a PEFT export wants them)."""
    lora = state["lora"]
    base = load_base(lora["base"]["path"], expect_sha256=lora["base"]["sha256"], what=str(folder))
    if "adapter_sha256" in state:
        adapters = read_adapter_file(folder / ADAPTER_NAME, state["adapter_sha256"])
    else:  # a sharded (DDP/FSDP2) step: its adapters are in the DCP files
        adapters = read_sharded_tensors(folder)
    return with_adapters(base, state, adapters, str(folder), device=device, dtype=dtype, merge=merge, **options)


def load_peft(
    folder: Path,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    merge: bool = True,
    **options: Any,
) -> TransformerLM:
    """The base a PEFT LoRA adapter folder names, with the adapter applied (merged unless ``merge`` is False)."""
    lora = peft_settings(folder)
    base = load_base(str(peft_base_path(folder)), expect_sha256=None, what=str(folder))
    return with_peft_adapter(base, folder, lora, device=device, dtype=dtype, merge=merge, **options)


def load_tokenizer(artifact: Artifact) -> Any:
    """The artifact's ``tlm_tokenizer.Tokenizer``, or None when it has no tokenizer file; an HF tokenizer
    tlm cannot reproduce exactly (another pre-tokenizer, say) raises :class:`UnreadableTokenizer`, whose
    message gives the reason."""
    if artifact.tokenizer_path is None or not artifact.tokenizer_path.exists():
        return None
    from tlm_tokenizer import Tokenizer

    if artifact.kind == "hf" or artifact.tokenizer_path.name == HF_TOKENIZER:
        try:
            return Tokenizer.from_hf(artifact.tokenizer_path)
        except ValueError as err:
            raise UnreadableTokenizer(str(err)) from None
    return Tokenizer.load(artifact.tokenizer_path)


class UnreadableTokenizer(ValueError):
    """The artifact has a tokenizer, but not one tlm can reproduce exactly."""
