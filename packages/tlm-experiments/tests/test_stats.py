"""tlm_experiments.stats against SciPy's t-tests (their confidence intervals), the t quantile's closed forms, and
values worked by hand."""

import math

import pytest
import scipy.stats as scipy_stats

from tlm_experiments.stats import Difference, describe, difference, t_quantile, verdict


@pytest.mark.parametrize("p", [0.5, 0.6, 0.9, 0.975, 0.995, 0.025])
def test_t_quantile_holds_the_closed_forms(p):
    """Student's t has closed-form quantiles for 1 degree of freedom (Cauchy), 2, and infinitely many (normal)."""
    from statistics import NormalDist

    assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9, abs=1e-12)
    assert t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-9, abs=1e-12)
    assert t_quantile(p, math.inf) == pytest.approx(NormalDist().inv_cdf(p), rel=1e-9, abs=1e-12)


def test_t_quantile_takes_fractional_degrees_of_freedom():
    """Welch's df is fractional: its quantile lies between the neighbouring integers' (the 97.5% one falls as df
    grows)."""
    assert t_quantile(0.975, 4) > t_quantile(0.975, 4.5) > t_quantile(0.975, 5)


def test_describe_by_hand():
    # 2, 4, 4, 4, 5, 5, 7, 9: mean 5, squared deviations sum to 32, sample variance 32 / 7.
    sample = describe([2, 4, 4, 4, 5, 5, 7, 9])
    assert (sample.n, sample.mean) == (8, 5.0)
    assert sample.sd == pytest.approx(math.sqrt(32 / 7), rel=1e-15)
    assert describe([3.5]) == describe([3.5]).__class__(1, 3.5, None)
    assert describe([]).mean is None
    with pytest.raises(ValueError, match="finite"):
        describe([1.0, math.nan])


A = {0: 4.10, 1: 4.25, 2: 4.02, 3: 4.18}
B = {0: 4.00, 1: 4.21, 2: 3.95, 3: 4.05}


def test_paired_interval_matches_scipy():
    diff = difference(A, B)
    pairs = [A[k] - B[k] for k in A]
    reference = scipy_stats.ttest_rel(list(A.values()), list(B.values())).confidence_interval(0.95)
    assert diff.method == "paired" and diff.df == 3 and diff.n == 4
    assert diff.estimate == pytest.approx(sum(pairs) / 4, rel=1e-12)
    assert (diff.low, diff.high) == (pytest.approx(reference.low, rel=1e-9), pytest.approx(reference.high, rel=1e-9))
    assert diff.excludes_zero  # every pair is positive: 0.10, 0.04, 0.07, 0.13


def test_paired_by_hand():
    # Differences 1, 2, 3: mean 2, sd 1, se 1/√3; t(0.975, 2) = 4.302652729749464.
    diff = difference({"a": 11.0, "b": 12.0, "c": 13.0}, {"a": 10.0, "b": 10.0, "c": 10.0})
    half = 4.302652729749464 / math.sqrt(3)
    assert (diff.low, diff.high) == (pytest.approx(2 - half, rel=1e-12), pytest.approx(2 + half, rel=1e-12))


def test_welch_when_the_seeds_differ_matches_scipy():
    a = {0: 4.10, 1: 4.25, 2: 4.02}  # seed 3 of this setting diverged: no pairs by seed
    diff = difference(a, B)
    reference = scipy_stats.ttest_ind(list(a.values()), list(B.values()), equal_var=False)
    interval = reference.confidence_interval(0.95)
    assert diff.method == "welch" and (diff.n, diff.n_baseline) == (3, 4)
    assert diff.df == pytest.approx(reference.df, rel=1e-12)
    assert (diff.low, diff.high) == (pytest.approx(interval.low, rel=1e-9), pytest.approx(interval.high, rel=1e-9))
    assert not diff.excludes_zero


def test_one_seed_has_no_interval():
    diff = difference({0: 4.2}, {0: 4.0})
    assert diff.method == "none" and diff.low is None and diff.excludes_zero is None
    assert diff.estimate == pytest.approx(0.2)
    assert "no claim beyond noise" in verdict(diff)


def test_no_spread_gives_an_exact_difference():
    diff = difference({0: 5.0, 1: 5.0}, {2: 4.0, 3: 4.0})
    assert (diff.low, diff.high, diff.excludes_zero) == (1.0, 1.0, True)


def test_verdict_says_noise_when_the_interval_holds_zero():
    assert "no difference beyond noise" in verdict(Difference(0.01, -0.02, 0.04, "paired", 2, 3, 3))
    beyond = verdict(Difference(0.05, 0.02, 0.08, "paired", 2, 3, 3))
    assert "excludes zero" in beyond and "worse at this scale" in beyond
    assert "better" in verdict(Difference(-0.05, -0.08, -0.02, "welch", 3.1, 3, 3))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="p must be in"):
        t_quantile(1.0, 3)
    with pytest.raises(ValueError, match="df must be positive"):
        t_quantile(0.9, 0)
    with pytest.raises(ValueError, match="both sides need a value"):
        difference({}, {0: 1.0})
    for confidence in (0.0, 1.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match=rf"^difference: confidence must be in \(0, 1\), got {confidence}$"):
            difference({0: 1.0, 1: 2.0}, {0: 1.5, 1: 2.5}, confidence=confidence)
