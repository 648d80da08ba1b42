"""What ``deterministic=True`` sets on each device type, chosen by one function and applied by another.

``deterministic`` promises bit-exact results (a resumed run equals an uninterrupted one). On CUDA that needs
more than the CPU does: ``torch.use_deterministic_algorithms(True, warn_only=False)`` (PyTorch's flash-attention
backward picks its deterministic algorithm only when ``warn_only`` is False; with ``warn_only=True`` it warns and
runs the non-deterministic one), ``CUBLAS_WORKSPACE_CONFIG`` set before cuBLAS makes its first handle, cuDNN in
deterministic mode without autotuning, and scaled-dot-product attention limited to the flash and math kernels
(the memory-efficient and cuDNN kernels' backward are not deterministic). An op with no deterministic kernel then
raises instead of running, and :func:`refusal` turns that error into one line naming the op. Document masks
keep FlexAttention: its Triton backward has no atomic adds (``tlm_attention.documents.flex_kernel_options``
names those kernels). A device type
that tlm has no such list for (``mps``, ``xpu``, ...) is refused before the run starts.
"""

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

#: The cuBLAS workspace setting a deterministic CUDA run uses (":16:8" is the other one cuBLAS documents).
CUBLAS_WORKSPACE = ":4096:8"
_CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")

#: Device types whose deterministic settings are known; another one with ``deterministic`` is refused.
DETERMINISTIC_DEVICES = ("cpu", "cuda")


class DeterminismError(ValueError):
    """``deterministic`` was asked for where a kernel cannot be deterministic."""


@dataclass(frozen=True)
class Determinism:
    """The settings of one run on one device type (:func:`determinism_for`); None: left as torch has it."""

    algorithms: bool  # torch.use_deterministic_algorithms, never warn_only: an op without a deterministic kernel raises
    cublas_workspace: str | None  # CUBLAS_WORKSPACE_CONFIG
    cudnn_deterministic: bool | None
    cudnn_benchmark: bool | None
    sdpa_kernels: tuple[str, ...] | None  # the scaled-dot-product attention kernels left enabled


def determinism_for(device_type: str, deterministic: bool) -> Determinism:
    """The settings a run on ``device_type`` uses; raises :class:`DeterminismError` for ``deterministic`` on
    a device type not in :data:`DETERMINISTIC_DEVICES`."""
    if not deterministic:
        return Determinism(False, None, None, None, None)
    if device_type not in DETERMINISTIC_DEVICES:
        raise DeterminismError(
            f"--deterministic on {device_type}: tlm knows no deterministic kernel set for this device "
            "(bit-exact resume is promised on cpu and cuda); pass --no-deterministic"
        )
    if device_type != "cuda":
        return Determinism(True, None, None, None, None)
    return Determinism(
        algorithms=True,
        cublas_workspace=CUBLAS_WORKSPACE,
        cudnn_deterministic=True,
        cudnn_benchmark=False,
        sdpa_kernels=("flash", "math"),
    )


def set_cublas_workspace(settings: Determinism) -> list[str]:
    """Put ``settings.cublas_workspace`` in the environment (cuBLAS reads it when this process makes its first
    handle, so call this before anything touches CUDA); what cannot be guaranteed, one note each."""
    if settings.cublas_workspace is None:
        return []
    have = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if have is None:
        if torch.cuda.is_initialized():
            return [
                "CUDA was already in use in this process, so cuBLAS may not be deterministic: set "
                f"CUBLAS_WORKSPACE_CONFIG={settings.cublas_workspace} in the environment"
            ]
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = settings.cublas_workspace
        return []
    if have not in _CUBLAS_DETERMINISTIC:
        return [f"CUBLAS_WORKSPACE_CONFIG={have} is not :4096:8 or :16:8, so cuBLAS may not be deterministic"]
    return []


_SDPA = {
    "flash": (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.enable_flash_sdp),
    "math": (torch.backends.cuda.math_sdp_enabled, torch.backends.cuda.enable_math_sdp),
    "mem_efficient": (torch.backends.cuda.mem_efficient_sdp_enabled, torch.backends.cuda.enable_mem_efficient_sdp),
    "cudnn": (torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.enable_cudnn_sdp),
}


def apply(settings: Determinism) -> Callable[[], None]:
    """Set ``settings`` in this process's torch (global flags); returns the function that restores them."""
    restore = contextlib.ExitStack()
    if settings.algorithms:
        before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
        restore.callback(torch.use_deterministic_algorithms, before[0], warn_only=before[1])
        torch.use_deterministic_algorithms(True, warn_only=False)
    if settings.cudnn_deterministic is not None:
        restore.callback(setattr, torch.backends.cudnn, "deterministic", torch.backends.cudnn.deterministic)
        torch.backends.cudnn.deterministic = settings.cudnn_deterministic
    if settings.cudnn_benchmark is not None:
        restore.callback(setattr, torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
        torch.backends.cudnn.benchmark = settings.cudnn_benchmark
    if settings.sdpa_kernels is not None:
        for name, (enabled, enable) in _SDPA.items():
            restore.callback(enable, enabled())
            enable(name in settings.sdpa_kernels)
    return restore.close


def describe(settings: Determinism) -> str:
    """One line saying what a deterministic CUDA run set (for the run's log)."""
    kernels = " and ".join(settings.sdpa_kernels or ("any",))
    return (
        f"deterministic on CUDA: CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG')}, deterministic "
        f"algorithms (an op without a deterministic kernel stops the run), attention by the {kernels} kernels"
    )


def refusal(error: RuntimeError) -> DeterminismError | None:
    """The one-line :class:`DeterminismError` for torch's "no deterministic implementation" error (None for any
    other error): the op it names cannot run deterministically on this device."""
    text = str(error)
    if "deterministic implementation" not in text:
        return None
    first = text.strip().splitlines()[0] if text.strip() else text
    return DeterminismError(f"--deterministic: {first.split(', but you set')[0]}; pass --no-deterministic to run it")
