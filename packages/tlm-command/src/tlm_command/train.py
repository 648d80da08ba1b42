"""``tlm train``: text to a tokenizer, a trained model and a sample, in one run folder.

Every setting is a flag, read over ``--config FILE.toml``; the model is ``--preset`` with any field a flag
too (``--num-kv-heads 2``). ``--init-from X`` fine-tunes X (a run, checkpoint, HF Llama or PEFT adapter
folder); ``--lora-rank R`` trains only LoRA adapters on its frozen weights. ``--resume RUN`` continues from the
newest checkpoint that verifies (or ``RUN/checkpoints/step_N``): flags apply from there on, and one that would
change the model, data, tokenizer or seed is refused. Scale-out is torchrun's, rank 0 writing the files:
``torchrun --nproc-per-node 2 -m tlm train --distributed fsdp`` (one machine, gloo on CPU), or SLURM's
``srun ... --auto-resume`` (docs/slurm.sbatch: SIGUSR1 checkpoints and requeues the job).

Exit status: 0 done, 1 the loss diverged, 2 a user error, 130 stopped by a signal (checkpointed), 74 a
logger failed (a full disk...; stopped, checkpointed when the disk took it; ``--logger-errors warn`` trains on).
"""

import argparse
import dataclasses
import json
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

from tlm_command.args import UserError, add_command, fit_threads
from tlm_core.checks import rephrased
from tlm_model.config import PRESETS, ModelConfig
from tlm_train.config import TrainConfig

#: The settings ``tlm train --help`` shows first; ``--help-all`` adds the rest. Every flag's help, default
#: and choices come from the dataclass field it sets (:class:`TrainConfig`, :class:`ModelConfig`).
COMMON = ("out_dir", "data", "tokenizer", "vocab_size", "preset", "steps", "batch_size", "lr", "device")
#: The exit status of a run stopped by a logger's failure (sysexits' EX_IOERR): the run stopped with a checkpoint
#: of that step when the disk took one (``--logger-errors warn``: it trains on without that logger instead). The
#: others: 0 done, 1 the loss diverged, 2 a user error, 130 stopped by Ctrl-C/SIGTERM (checkpointed).
LOGGER_FAILED = 74
#: The metavar of a number flag by its type (a field's ``metavar`` metadata wins).
_METAVARS: dict[Any, str] = {int: "N", float: "X"}
#: Model fields with no flag: the vocabulary is the tokenizer's.
_NO_FLAG = ("vocab_size",)


def _flag_type(annotation: Any) -> tuple[Any, bool]:
    """(scalar type, is_list) of a field annotation such as ``int | None`` or ``list[str]``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is list:
        return args[0], True
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return args[0], False
    return annotation, False


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r} ({err.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _json_object_or_name(names: tuple[str, ...]) -> Any:
    def parse(text: str) -> dict[str, Any] | str:
        if text in names:
            return text
        if text.isidentifier():  # a name, but not one of these
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(names)} or a JSON object, got {text!r}")
        return _json_object(text)

    return parse


def shown(field: dataclasses.Field[Any], value: Any) -> str:
    """A field's value as ``--help`` shows it: the field's ``shown`` text for None or [], ``on``/``off``
    for a switch, a list space-separated."""
    if value is None or value == []:
        return str(field.metadata.get("shown", "none"))
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return " ".join(map(str, value))
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, str) and value != value.strip():
        return repr(value)
    return str(value)


def _default(field: dataclasses.Field[Any]) -> Any:
    # Read from the field, not from TrainConfig(): building one checks the device, which imports torch.
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _add(parser: Any, field: dataclasses.Field[Any], default: str, dest: str) -> None:
    kind, is_list = _flag_type(field.type)
    flag = "--" + field.name.replace("_", "-")
    help_text = f"{field.metadata.get('help', '')} ({default})".replace("%", "%%")
    common: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS, "help": help_text}
    if kind is bool:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
    elif (kind is dict or typing.get_origin(kind) is dict) and "names" in field.metadata:
        # A table, or one of the names that stand for one (a RoPE rule that --init-from's context completes).
        names = field.metadata["names"]
        parser.add_argument(flag, type=_json_object_or_name(names), metavar="|".join((*names, "JSON")), **common)
    elif kind is dict or typing.get_origin(kind) is dict:
        parser.add_argument(flag, type=_json_object, metavar="JSON", **common)
    else:
        choices = field.metadata.get("choices")
        # A number's metavar is its kind (N, X), so most flags fit their help on the same line; others name it.
        metavar = None if choices else field.metadata.get("metavar", _METAVARS.get(kind, field.name.upper()))
        parser.add_argument(flag, type=kind, nargs="+" if is_list else None, metavar=metavar, choices=choices, **common)


def add_parser(commands: Any) -> None:
    parser = add_command(
        commands,
        "train",
        "train a tokenizer and a model (default data needs no download); fine-tune with --init-from",
        __doc__,
        usage="%(prog)s [--config FILE.toml | --resume RUN] [--quiet] [--SETTING VALUE ...]",
    )
    common = parser.add_argument_group("common flags")
    common.add_argument("--config", metavar="FILE.toml", help="settings file (flags override it)")
    common.add_argument("--resume", metavar="RUN", help="continue a run folder (or a step folder of one)")
    common.add_argument("--quiet", action="store_true", help="no progress bar and no log lines")
    more = parser.more_group("training settings")
    more.add_argument(
        "--auto-resume",
        action="store_true",
        help="continue --out-dir from its newest checkpoint when it holds a run, else start it (a job that SLURM "
        "may requeue: docs/slurm.sbatch; implied in a requeued job) (default: off)",
    )
    fields = {f.name: f for f in dataclasses.fields(TrainConfig) if f.name != "model"}
    for name in (*COMMON, *(n for n in fields if n not in COMMON)):
        field = fields[name]
        value = f"default: {shown(field, _default(field))}"
        _add(common if name in COMMON else more, field, value, name)
    base = _default(fields["preset"])
    model = parser.more_group(
        "model flags (the [model] table)",
        f"Each sets one ModelConfig field over the --preset's; the value shown is the {base} preset's.",
    )
    for field in dataclasses.fields(ModelConfig):
        if field.name not in _NO_FLAG:
            value = f"{base}: {shown(field, getattr(PRESETS[base], field.name))}"
            _add(model, field, value, f"model.{field.name}")
    parser.set_defaults(run=run)


def _settings(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    values = vars(args)
    train = {f.name: values[f.name] for f in dataclasses.fields(TrainConfig) if f.name in values and f.name != "model"}
    model = {key.removeprefix("model."): value for key, value in values.items() if key.startswith("model.")}
    return train, model


def config_from_args(args: argparse.Namespace) -> tuple[TrainConfig, int | None, bool]:
    """The run's settings (the saved ones for ``--resume``, then ``--config``, then flags), the step to resume
    from (None: the newest), and whether to resume."""
    overrides, model = _settings(args)
    if model:
        overrides["model"] = model
    if args.resume is not None:
        from tlm_train.run_dir import RunDir

        if args.config is not None:
            raise UserError("--resume continues with the run's own train.toml; --config does not apply to it")
        run, step = _resume_target(Path(args.resume))
        if "out_dir" in overrides and Path(overrides["out_dir"]).resolve() != run.resolve():
            raise UserError(f"--out-dir {overrides['out_dir']} differs from the run being resumed ({run})")
        overrides["out_dir"] = str(run)
        return RunDir(run).read_config(**overrides), step, True
    if args.config is not None:
        if not Path(args.config).is_file():
            raise FileNotFoundError(f"--config {args.config}: no such file")
        return TrainConfig.from_toml(args.config, **overrides), None, False
    return TrainConfig(**overrides), None, False


def _resume_target(path: Path) -> tuple[Path, int | None]:
    from tlm_train.checkpoint import CheckpointManager
    from tlm_train.run_dir import CHECKPOINT_DIR, RunDir

    match = CheckpointManager.PATTERN.fullmatch(path.name)
    if match and path.parent.name == CHECKPOINT_DIR and RunDir.is_run(path.parent.parent):
        return path.parent.parent, int(match.group(1))
    if not RunDir.is_run(path):
        raise UserError(f"--resume {path}: not a tlm train run folder (no train.toml or checkpoints/ in it)")
    return path, None


def _requeued() -> bool:
    from tlm_train.cluster import requeued

    return requeued()


def _auto_resume(config: TrainConfig, *, quiet: bool) -> tuple[TrainConfig, bool]:
    """``--auto-resume``: the run in ``--out-dir`` continued (its train.toml, with the flags a resume may change
    over it), or ``config`` started afresh when the folder holds no run yet."""
    from tlm_train.cluster import auto_resume_config

    continued = auto_resume_config(config)
    if continued is None:
        return config, False
    if not quiet:
        _log(f"--auto-resume: {config.out_dir} holds a run; continuing it from its newest checkpoint")
    return continued, True


def _flags(message: str) -> str:
    """Settings named as the user typed them: ``TrainConfig.min_lr`` -> ``--min-lr``."""
    message = re.sub(r"TrainConfig\.model: ModelConfig\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), message)
    message = re.sub(r"(?:TrainConfig|ModelConfig)\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), message)
    return message


def _log(line: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(f"tlm: {line}", file=sys.stderr)


#: The optional logger backends: (flag, the module each needs, tlm-train's extra that installs it).
OPTIONAL_LOGGERS = (("--tensorboard", "tensorboard", "tensorboard"), ("--wandb", "wandb", "wandb"))


def _check_loggers(config: TrainConfig) -> None:
    """A logger whose library is missing is one line before anything is written (its ImportError came after the run
    folder's data and tokenizer, as a traceback)."""
    import importlib.util

    for flag, module, extra in OPTIONAL_LOGGERS:
        if getattr(config, flag[2:]) and importlib.util.find_spec(module) is None:
            raise UserError(f"{flag} needs the {module} package: pip install 'tlm-train[{extra}]'")


def run(args: argparse.Namespace) -> int:
    try:  # the settings are checked before torch is imported: a wrong flag is refused at once
        config, step, resume = config_from_args(args)
    except (TypeError, ValueError) as err:
        raise rephrased(err, _flags(str(err))) from None
    _check_loggers(config)
    from tlm_train import NonFiniteLossError, RunInUseError, train
    from tlm_train.loggers import LoggerError

    fit_threads(config.device, quiet=args.quiet)  # a busy machine: fewer threads than cores, said in one line

    if not resume and (args.auto_resume or _requeued()):
        config, resume = _auto_resume(config, quiet=args.quiet)
    try:
        result = train(
            config,
            resume=resume,
            resume_from=step,
            log=None if args.quiet else _log,
            progress=False if args.quiet else None,
        )
    except RunInUseError as err:
        raise UserError(str(err)) from None
    except NonFiniteLossError as err:
        print(f"tlm: error: {err}", file=sys.stderr)
        return 1
    except LoggerError as err:  # the run stopped with a checkpoint; the error says where
        print(f"tlm: error: {err}", file=sys.stderr)
        return LOGGER_FAILED
    except (TypeError, ValueError) as err:
        raise rephrased(err, _flags(str(err))) from None
    if result.sample is not None and not args.quiet:
        _log(f"run folder: {result.run_dir}")
        print("sample:", result.sample.replace("\n", "\n        "))
    return 130 if result.interrupted else 0
