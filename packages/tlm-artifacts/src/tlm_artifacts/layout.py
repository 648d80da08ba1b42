"""The names of the files and folders tlm writes and reads back, and the run folder's paths (no torch).

```
RUN/train.toml  tokenizer/  data/{train.npy,val.npy,info.json}  metrics.jsonl
    checkpoints/latest  checkpoints/step_00000100/{model.safetensors | adapter.safetensors | shards/, train_state.pt}
```

``tlm train`` writes these (tlm-train imports every name from here); everything that opens a model reads them.
"""

import os
import re
from pathlib import Path
from typing import Any

#: A run's settings (``tlm_train.TrainConfig`` as TOML); its presence, or ``checkpoints/``'s, makes a run folder.
CONFIG_NAME = "train.toml"
TOKENIZER_DIR = "tokenizer"
DATA_DIR = "data"
CHECKPOINT_DIR = "checkpoints"
METRICS_NAME = "metrics.jsonl"
#: In a checkpoints folder: the name of the newest saved step folder (see :meth:`StepFolders.steps`).
LATEST_NAME = "latest"
#: A step folder's training state (``tlm_artifacts.train_state``'s format).
STATE_NAME = "train_state.pt"
#: In a sharded step folder: torch.distributed.checkpoint's files (``.metadata``, one ``.distcp`` per rank).
SHARDS_DIR = "shards"
#: The file DCP writes last into ``shards/``: a sharded step is complete once it is there.
SHARDS_METADATA = ".metadata"
#: A LoRA step folder's adapter file (in place of tlm-model's ``model.safetensors``).
ADAPTER_NAME = "adapter.safetensors"
#: A step folder's name: ``step_`` and the step, at least 8 digits.
STEP_PATTERN = re.compile(r"step_(\d{8,})")
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"


def step_name(step: int) -> str:
    return f"step_{step:08d}"


class RunFolder:
    """The paths of a run folder and what inference reads from it (``tlm_train.RunDir`` adds the writing).
    Its step folders: ``tlm_artifacts.StepFolders(run.checkpoints_dir)``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"

    config_path = property(lambda self: self.path / CONFIG_NAME)
    tokenizer_dir = property(lambda self: self.path / TOKENIZER_DIR)
    data_dir = property(lambda self: self.path / DATA_DIR)
    checkpoints_dir = property(lambda self: self.path / CHECKPOINT_DIR)
    metrics_path = property(lambda self: self.path / METRICS_NAME)

    @staticmethod
    def is_run(path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` is a folder that ``tlm train`` wrote (its ``train.toml`` or ``checkpoints/``)."""
        path = Path(path)
        return path.is_dir() and ((path / CONFIG_NAME).is_file() or (path / CHECKPOINT_DIR).is_dir())

    def has_tokenizer(self) -> bool:
        return self.tokenizer_dir.is_dir()

    def tokenizer(self) -> Any:
        """The run's ``tlm_tokenizer.Tokenizer``, or None when it trained on token ids without one."""
        if not self.has_tokenizer():
            return None
        from tlm_tokenizer import Tokenizer

        return Tokenizer.load(self.tokenizer_dir)
