"""Stacked-bar chart of each component's share of forward FLOPs (needs the ``plot`` extra)."""

import os
from collections.abc import Sequence

from tlm_core.atomic import atomic_write
from tlm_model.accounting import COMPONENTS, Accounting


def plot_shares(reports: Sequence[tuple[str, Accounting]], path: str, causal: bool = False) -> None:
    """Write one stacked bar per (name, report) to ``path`` (format from its suffix, e.g. .png; PNG without one),
    all-or-nothing (``tlm_core.atomic.atomic_write``): a kill or an error leaves the old file, a symlink at ``path``
    is replaced, never written through, and ``path`` is never renamed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(
            "--plot needs matplotlib: pip install 'tlm-model[plot]' (or pip install matplotlib)"
        ) from None

    names = [name for name, _ in reports]
    fig, ax = plt.subplots(figsize=(1.6 * len(reports) + 4.5, 4.8), layout="constrained")
    bottom = [0.0] * len(reports)
    for component, label in COMPONENTS.items():
        shares = [100 * report.shares(causal)[component] for _, report in reports]
        bars = ax.bar(names, shares, bottom=bottom, label=label, width=0.6)
        for bar, share in zip(bars, shares, strict=True):
            if share >= 4:
                ax.text(bar.get_x() + bar.get_width() / 2, bar.get_y() + share / 2, f"{share:.0f}%",
                        ha="center", va="center", fontsize=8)  # fmt: skip
        bottom = [b + s for b, s in zip(bottom, shares, strict=True)]
    seqs = sorted({report.seq_len for _, report in reports})
    convention = "causal count" if causal else "full QKᵀ, the course's convention"
    ax.set_title(f"Share of forward matmul FLOPs ({convention}; seq {', '.join(map(str, seqs))})", fontsize=10)
    ax.set_ylabel("% of forward matmul FLOPs")
    ax.set_ylim(0, 100)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    # savefig(path) would open a symlink's target and truncate it, and append ".png" to a path without a suffix.
    suffix = os.path.splitext(path)[1].lstrip(".").lower() or "png"
    try:
        atomic_write(path, lambda file: fig.savefig(file, format=suffix, dpi=120))
    finally:
        plt.close(fig)
