"""Training experiments as a library: sweep plans and their runner (:mod:`tlm_experiments.sweep`), a run's
results read back (:mod:`.compare`), grouped by setting with statistics and plots (:mod:`.results`), and the
intervals behind them (:mod:`.stats`). Every function takes plain values (a sweep: ``sweep.run(SweepOptions(...))``);
``tlm sweep`` and ``tlm compare`` (tlm-command) parse the command line and call them.

Names load on first use (PEP 562): ``tlm_experiments.stats`` imports neither torch nor a training package.
"""

from typing import TYPE_CHECKING

from tlm_core.lazy import lazy_exports

__version__ = "0.1.0"

_HOMES = {
    "collect": "tlm_experiments.compare",
    "plot": "tlm_experiments.compare",
    "read_metrics": "tlm_experiments.compare",
    "summarize": "tlm_experiments.compare",
    "read_manifest": "tlm_experiments.manifest",
    "RunSummary": "tlm_experiments.results",
    "group_runs": "tlm_experiments.results",
    "statistics": "tlm_experiments.results",
    "Difference": "tlm_experiments.stats",
    "Sample": "tlm_experiments.stats",
    "describe": "tlm_experiments.stats",
    "difference": "tlm_experiments.stats",
    "verdict": "tlm_experiments.stats",
    "SweepOptions": "tlm_experiments.sweep",
    "expand_grid": "tlm_experiments.sweep",
}

__all__ = [
    "Difference",
    "RunSummary",
    "Sample",
    "SweepOptions",
    "__version__",
    "collect",
    "describe",
    "difference",
    "expand_grid",
    "group_runs",
    "plot",
    "read_manifest",
    "read_metrics",
    "statistics",
    "summarize",
    "verdict",
]

if TYPE_CHECKING:
    from tlm_experiments.compare import collect, plot, read_metrics, summarize
    from tlm_experiments.manifest import read_manifest
    from tlm_experiments.results import RunSummary, group_runs, statistics
    from tlm_experiments.stats import Difference, Sample, describe, difference, verdict
    from tlm_experiments.sweep import SweepOptions, expand_grid


lazy_exports(__name__, _HOMES)
