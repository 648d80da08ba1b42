"""The statistics of a sweep with seeds: each setting's mean, sample standard deviation and N, and a
setting's difference from the baseline with a 95% confidence interval.

The interval is Student's t: paired by seed when both settings ran the same seeds (the seed fixes the
initial weights and the batches, so the pairs share their luck and the interval is narrower), Welch's
otherwise (unequal variances, Welch–Satterthwaite degrees of freedom). The t quantile is ``scipy.stats.t``'s
(imported when an interval is computed); the tests hold the intervals against ``scipy.stats.ttest_rel`` and
``ttest_ind`` and the quantile against its closed forms.
"""

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

#: The confidence of every interval the tools print.
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Sample:
    """N values' mean and sample standard deviation (``None`` below two values)."""

    n: int
    mean: float | None
    sd: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def describe(values: Iterable[float]) -> Sample:
    """The mean and the sample (N − 1) standard deviation of ``values``."""
    xs = [float(v) for v in values]
    for x in xs:
        if not math.isfinite(x):
            raise ValueError(f"describe: values must be finite numbers, got {x!r}")
    n = len(xs)
    if n == 0:
        return Sample(0, None, None)
    mean = math.fsum(xs) / n
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else None
    return Sample(n, mean, sd)


@dataclass(frozen=True)
class Difference:
    """``setting − baseline``: the estimate, and its interval at ``confidence`` (``low``/``high`` are
    ``None`` when a side has fewer than two values: one seed gives no spread to measure)."""

    estimate: float
    low: float | None
    high: float | None
    method: str  # "paired" (by seed), "welch", or "none" (no interval)
    df: float | None
    n: int  # pairs (paired), else the setting's values
    n_baseline: int
    confidence: float = CONFIDENCE

    @property
    def excludes_zero(self) -> bool | None:
        """Whether the interval lies wholly on one side of zero; ``None`` without an interval."""
        if self.low is None or self.high is None:
            return None
        return self.low > 0 or self.high < 0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "excludes_zero": self.excludes_zero}


def difference(
    values: Mapping[Any, float], baseline: Mapping[Any, float], *, confidence: float = CONFIDENCE
) -> Difference:
    """The difference of the means of ``values`` and ``baseline`` (each keyed by seed) with its interval:
    a paired t-interval when both hold the same seeds (two or more), Welch's otherwise."""
    if not 0 < confidence < 1:
        raise ValueError(f"difference: confidence must be in (0, 1), got {confidence!r}")
    a, b = describe(values.values()), describe(baseline.values())
    if a.mean is None or b.mean is None:
        raise ValueError(f"difference: both sides need a value, got {a.n} and {b.n}")
    estimate = a.mean - b.mean
    if set(values) == set(baseline) and a.n >= 2:
        diffs = describe(values[k] - baseline[k] for k in values)
        assert diffs.sd is not None
        df: float = diffs.n - 1
        se = diffs.sd / math.sqrt(diffs.n)
        method = "paired"
    elif a.sd is not None and b.sd is not None:
        va, vb = a.sd**2 / a.n, b.sd**2 / b.n
        se = math.sqrt(va + vb)
        # Welch–Satterthwaite; with no spread on either side the difference is exact (df is moot).
        df = (va + vb) ** 2 / (va**2 / (a.n - 1) + vb**2 / (b.n - 1)) if se > 0 else math.inf
        method = "welch"
    else:
        return Difference(estimate, None, None, "none", None, a.n, b.n, confidence)
    half = t_quantile(0.5 + confidence / 2, df) * se if se > 0 else 0.0
    return Difference(estimate, estimate - half, estimate + half, method, df, a.n, b.n, confidence)


def verdict(diff: Difference, *, unit: str = "nats") -> str:
    """One clause a reader can trust: the difference with its interval, and whether it is beyond noise."""
    sign = "+" if diff.estimate >= 0 else "−"
    text = f"{sign}{abs(diff.estimate):.3f} {unit}"
    if diff.low is None or diff.high is None:
        return f"{text} (one seed: no interval, so no claim beyond noise)"
    interval = f"{diff.confidence:.0%} interval [{diff.low:+.3f}, {diff.high:+.3f}]"
    if diff.excludes_zero:
        return f"{text} ({interval}, which excludes zero: {'worse' if diff.estimate > 0 else 'better'} at this scale)"
    return f"{text} ({interval}: no difference beyond noise)"


# ------------------------------------------------------------------------------------------ Student's t


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (``math.inf``: the normal's)."""
    if not 0 < p < 1:
        raise ValueError(f"t_quantile: p must be in (0, 1), got {p!r}")
    if not df > 0:
        raise ValueError(f"t_quantile: df must be positive, got {df!r}")
    from scipy.stats import t

    return float(t.ppf(p, df))
