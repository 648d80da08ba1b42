"""What the property-based tests of softmax, SDPA and attention share: the dtypes they draw and the
rounding bounds of each (test modules import it by name; the conftest.py beside it puts it on sys.path)."""

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]

# The `device` fixture only names a device, so sharing it across examples is safe.
fixture_ok = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])

seeds = st.integers(0, 2**32 - 1)


def unit_roundoff(dtype: torch.dtype) -> float:
    """Largest relative error of rounding a real number to ``dtype`` (half its machine epsilon)."""
    return torch.finfo(dtype).eps / 2


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # softmax reduces in float32, or in float64 for float64 input.
    return torch.promote_types(dtype, torch.float32)


def output_rounding(dtype: torch.dtype) -> float:
    # The one rounding of a float32 result back to a narrower input dtype (none otherwise).
    return unit_roundoff(dtype) if dtype != compute_dtype(dtype) else 0.0
