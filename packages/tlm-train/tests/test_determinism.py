"""``deterministic`` on each device type (issue 42): the flags a CUDA run sets, pinned on the CPU (the choice is
a function of the device type; the CPU build of torch holds every one of these global flags), the refusal of a
device without a known deterministic kernel set, and the one-line refusal of an op without a deterministic
kernel."""

import pytest
import torch

from tlm_train.determinism import (
    CUBLAS_WORKSPACE,
    Determinism,
    DeterminismError,
    apply,
    determinism_for,
    refusal,
    set_cublas_workspace,
)


def test_a_cuda_run_uses_deterministic_algorithms_without_warn_only_and_flash_or_math_attention() -> None:
    # PyTorch's flash-attention backward runs its deterministic algorithm only when warn_only is False; the
    # memory-efficient and cuDNN attention backward are not deterministic; cuBLAS needs its workspace setting.
    assert determinism_for("cuda", True) == Determinism(
        algorithms=True,
        cublas_workspace=":4096:8",
        cudnn_deterministic=True,
        cudnn_benchmark=False,
        sdpa_kernels=("flash", "math"),
    )
    assert determinism_for("cpu", True) == Determinism(True, None, None, None, None)
    assert determinism_for("cuda", False) == Determinism(False, None, None, None, None)


@pytest.mark.parametrize("device_type", ["mps", "xpu"])
def test_a_device_without_a_known_deterministic_kernel_set_is_refused_in_one_line(device_type) -> None:
    with pytest.raises(DeterminismError, match=f"--deterministic on {device_type}: .*--no-deterministic") as info:
        determinism_for(device_type, True)
    assert "\n" not in str(info.value)
    assert determinism_for(device_type, False).algorithms is False  # --no-deterministic runs there


def _flags() -> tuple[object, ...]:
    cuda = torch.backends.cuda
    return (
        torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, cuda.flash_sdp_enabled(),
        cuda.math_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.cudnn_sdp_enabled(),
    )  # fmt: skip


def test_applying_the_cuda_settings_sets_each_flag_and_restoring_puts_them_back() -> None:
    before = _flags()
    torch.use_deterministic_algorithms(True, warn_only=True)  # what the old code chose on CUDA
    try:
        restore = apply(determinism_for("cuda", True))
        try:
            assert _flags() == (True, False, True, False, True, True, False, False)
        finally:
            restore()
        assert _flags()[:2] == (True, True)
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    assert _flags() == before


def test_the_cublas_workspace_is_set_when_absent_and_a_wrong_one_is_said(monkeypatch) -> None:
    settings = determinism_for("cuda", True)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert set_cublas_workspace(settings) == []
    import os

    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    assert set_cublas_workspace(settings) == [
        "CUBLAS_WORKSPACE_CONFIG=:0:0 is not :4096:8 or :16:8, so cuBLAS may not be deterministic"
    ]
    assert set_cublas_workspace(determinism_for("cpu", True)) == []


def test_an_op_without_a_deterministic_kernel_is_refused_in_one_line_naming_it() -> None:
    # torch's own error (the alert every kernel without a deterministic variant raises; this one names a CUDA op).
    from torch._prims_common import alert_not_deterministic

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        with pytest.raises(RuntimeError) as info:
            alert_not_deterministic("index_add_cuda_")
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    refused = refusal(info.value)
    assert refused is not None, info.value
    assert "\n" not in str(refused)
    assert str(refused).startswith("--deterministic: index_add_cuda_ does not have a deterministic implementation")
    assert str(refused).endswith("pass --no-deterministic to run it")
    assert refusal(RuntimeError("CUDA out of memory")) is None
