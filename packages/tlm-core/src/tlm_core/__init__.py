"""What every tlm package shares: argument checks, all-or-nothing writes, progress bars.

Standard library only. Names load on first use (PEP 562), so ``from tlm_core.checks import check_int``
costs the checks alone; ``tlm_core.tensors`` (index and dtype checks) imports torch and is meant for the
packages that have it; ``tlm_core.progress`` imports tqdm only when a bar shows.
"""

from tlm_core.lazy import lazy_exports

__version__ = "0.1.1"

_HOMES = {
    "atomic_file": "tlm_core.atomic",
    "atomic_path": "tlm_core.atomic",
    "atomic_write": "tlm_core.atomic",
    "read_dir_files": "tlm_core.atomic",
    "remove_leftovers": "tlm_core.atomic",
    "replace_dir": "tlm_core.atomic",
    "check_bool": "tlm_core.checks",
    "check_choice": "tlm_core.checks",
    "check_int": "tlm_core.checks",
    "check_number": "tlm_core.checks",
    "check_positive_int": "tlm_core.checks",
    "rephrased": "tlm_core.checks",
    "short_repr": "tlm_core.checks",
    "lazy_exports": "tlm_core.lazy",
    "progress_bar": "tlm_core.progress",
}

__all__ = ["__version__", *sorted(_HOMES)]


lazy_exports(__name__, _HOMES)
