import re

import numpy as np
import pytest
import torch

from tlm_core.tensors import DTYPES, as_index_tensor, check_float_tensor, device_from_name, dtype_from_name


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64])
def test_every_integer_dtype_becomes_int64_with_the_same_values(dtype):
    t = torch.tensor([0, 3, 7], dtype=dtype)
    ids = as_index_tensor("ids", t, 8, "vocab")
    assert ids.dtype == torch.int64 and ids.tolist() == [0, 3, 7]


def test_unsigned_numpy_memmap_dtypes_work():
    ids = as_index_tensor("ids", torch.from_numpy(np.array([1, 65535], dtype=np.uint16)), 65536, "vocab")
    assert ids.tolist() == [1, 65535]


def test_an_int64_input_is_returned_as_is():
    t = torch.tensor([1, 2])
    assert as_index_tensor("ids", t, 3, "vocab") is t


@pytest.mark.parametrize("bad", [torch.tensor([0.0]), torch.tensor([True]), torch.tensor([1j])])
def test_non_integer_tensors_are_refused(bad):
    with pytest.raises(TypeError, match="ids must be an integer tensor"):
        as_index_tensor("ids", bad, 3, "vocab")


def test_a_list_is_refused():
    with pytest.raises(TypeError, match="ids must be a torch.Tensor, got list"):
        as_index_tensor("ids", [1], 3, "vocab")


@pytest.mark.parametrize("values", [[-1, 0], [0, 3]])
def test_out_of_range_values_are_refused_with_the_range_found(values):
    expected = rf"ids must lie in \[0, vocab=3\), got values in \[{min(values)}, {max(values)}\]"
    with pytest.raises(ValueError, match=expected):
        as_index_tensor("ids", torch.tensor(values), 3, "vocab")


def test_empty_and_meta_tensors_pass_without_a_range_check():
    assert as_index_tensor("ids", torch.empty(0, dtype=torch.int32), 1, "vocab").dtype == torch.int64
    assert as_index_tensor("ids", torch.empty(4, dtype=torch.int64, device="meta"), 1, "vocab").is_meta


def test_dtype_names():
    assert dtype_from_name("bfloat16") is torch.bfloat16
    assert set(DTYPES) == {"float32", "bfloat16", "float16", "float64"}
    expected = r"--dtype must be one of \['bfloat16', 'float16', 'float32', 'float64'\], got 'fp8'"
    with pytest.raises(ValueError, match=expected):
        dtype_from_name("fp8", "--dtype")


def test_device_names():
    assert device_from_name("cpu") == torch.device("cpu")
    # An index on a CPU is torch's to accept (torch.zeros(1, device="cpu:0") works); only CUDA indices are counted.
    assert device_from_name("cpu:0") == torch.device("cpu", 0) and torch.zeros(1, device="cpu:0").device.type == "cpu"
    with pytest.raises(ValueError, match="--device must be a torch device such as cpu, cuda or cuda:1, got 'quantum'"):
        device_from_name("quantum")
    with pytest.raises(ValueError, match="--out-device must be a torch device"):
        device_from_name("cpu:x", "--out-device")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cuda:1: this torch has no CUDA device"):
            device_from_name("cuda:1")
    else:
        with pytest.raises(ValueError, match=r"--device cuda:99: only \d+ CUDA device"):
            device_from_name("cuda:99")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_a_floating_tensor_is_returned_as_is(dtype):
    t = torch.zeros(2, dtype=dtype)
    assert check_float_tensor("x", t) is t


@pytest.mark.parametrize(("bad", "message"), [
    (torch.tensor([1]), "x must be a floating-point tensor, got dtype torch.int64"),
    (torch.tensor([True]), "x must be a floating-point tensor, got dtype torch.bool"),
    ([1.0], "x must be a torch.Tensor, got list"),
])  # fmt: skip
def test_anything_but_a_floating_tensor_is_refused(bad, message):
    with pytest.raises(TypeError, match=re.escape(message)):
        check_float_tensor("x", bad)
