"""The gate's interval (``paired.ratio_bounds``, what ``paired_loss_difference`` and every simulation of the gate
compute) against an independent implementation of its definition: the delta-method t interval of a ratio of sums,
and Hall's skew-corrected bound found by solving Hall's cubic numerically, not by the closed-form inverse the code
uses. Then the bootstrap variant of the paired loss difference against its own definition."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.stats import skew
from scipy.stats import t as t_dist

from nexa_dagster.core.evaluation.paired import paired_loss_difference, ratio_bounds, ratio_interval


def _reference(x: np.ndarray, t: np.ndarray, confidence: float, method: str) -> tuple[float, float, float]:
    """The interval from its definition (paired.ratio_bounds' docstring), written without its shortcuts."""
    n = len(x)
    estimate = x.sum() / t.sum()
    z = (x - estimate * t) / t.mean()  # the delta method's residuals
    s = float(np.std(z, ddof=1))
    q = t_dist.ppf(0.5 + confidence / 2, n - 1)
    low, high = estimate - q * s / math.sqrt(n), estimate + q * s / math.sqrt(n)
    if method == "t" or n < 3:
        return estimate, low, high
    g = float(skew(z, bias=False))  # the adjusted Fisher-Pearson G1: m3 / m2^1.5 * sqrt(n (n - 1)) / (n - 2)

    def hall(w: float) -> float:  # Hall's transformation of W = (estimate - truth) / s
        return w + g * w**2 / 3 + g**2 * w**3 / 27 + g / (6 * n)

    def solve(y: float) -> float:  # the W with hall(W) = y; hall is increasing (its derivative (1 + gW/3)^2)
        return brentq(lambda w: hall(w) - y, -1e3, 1e3, xtol=1e-14, rtol=1e-14)

    hall_low = estimate - s * solve(q / math.sqrt(n))
    hall_high = estimate - s * solve(-q / math.sqrt(n))
    return estimate, min(low, hall_low), max(high, hall_high)


def _skewed(n: int, seed: int, sign: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Per-example loss changes with a long tail (a few examples much worse, or much better with ``sign`` -1),
    over examples of very unequal length: what an eval set's differences look like."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(8, 120, size=n).astype(float)
    per_token = sign * (rng.lognormal(-2.0, 1.2, size=n) - 0.1)
    return per_token * tokens, tokens


@pytest.mark.parametrize(("n", "seed", "sign"), [(12, 0, 1.0), (30, 1, 1.0), (30, 2, -1.0), (3, 4, 1.0)])
def test_the_skew_corrected_interval_is_halls_bound_or_the_t_bound_whichever_is_wider(
    n: int, seed: int, sign: float
) -> None:
    x, t = _skewed(n, seed, sign)
    for confidence in (0.9, 0.95):
        expected = _reference(x, t, confidence, "skew_t")
        assert ratio_bounds(x, t, confidence, "skew_t") == pytest.approx(expected, rel=1e-9, abs=1e-12)
        assert ratio_bounds(x, t, confidence, "t") == pytest.approx(
            _reference(x, t, confidence, "t"), rel=1e-12
        )
    # the long tail's side reaches further than the plain t's, the other side is the t's (the wider of the two)
    _, t_low, t_high = ratio_bounds(x, t, 0.95, "t")
    _, low, high = ratio_bounds(x, t, 0.95, "skew_t")
    if sign > 0:
        assert high > t_high and low == pytest.approx(t_low, rel=1e-12)
    else:
        assert low < t_low and high == pytest.approx(t_high, rel=1e-12)


def test_a_mildly_skewed_sample_is_corrected_too() -> None:
    """Hall's correction applies to any skewness the sample shows, not only a large one (|G1| < 1 here)."""
    rng = np.random.default_rng(7)
    x, t = rng.gamma(20.0, 0.05, size=40) - 1.0, np.ones(40)
    g = skew(x, bias=False)
    assert 0.05 < g < 1
    expected = _reference(x, t, 0.95, "skew_t")
    assert expected[2] > _reference(x, t, 0.95, "t")[2]
    assert ratio_bounds(x, t, 0.95, "skew_t") == pytest.approx(expected, rel=1e-9)


def test_the_smallest_samples_two_pairs_give_the_t_interval_one_none() -> None:
    x, t = np.array([0.3, -0.1]), np.array([10.0, 30.0])
    estimate, low, high = ratio_bounds(x, t, 0.95, "skew_t")
    assert (estimate, low, high) == pytest.approx(_reference(x, t, 0.95, "t"), rel=1e-12)
    assert math.isfinite(low) and math.isfinite(high)
    one = ratio_bounds(np.array([[0.3], [0.2], [0.1]]), np.ones((3, 1)), 0.95)
    assert one[0].shape == one[1].shape == one[2].shape == (3,)
    assert (one[1] == -np.inf).all() and (one[2] == np.inf).all()


def test_the_bounds_of_many_eval_sets_at_once_are_each_one_s_and_in_float64_whatever_the_input() -> None:
    """The simulations compute thousands of eval sets' bounds in one call; each row is that eval set's interval,
    and float32 input (a loss array as a framework returns it) is summed in float64, as a list would be."""
    rows = [_skewed(25, seed) for seed in range(4)]
    x, t = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
    many = ratio_bounds(x, t, 0.95)
    for i, (xi, ti) in enumerate(rows):
        assert [float(b[i]) for b in many] == pytest.approx(list(ratio_bounds(xi, ti, 0.95)), rel=1e-12)
    x32, t32 = x.astype(np.float32), t.astype(np.float32)
    as_float64 = ratio_bounds(x32.astype(np.float64), t32.astype(np.float64), 0.95)
    assert all(np.array_equal(a, b) for a, b in zip(ratio_bounds(x32, t32, 0.95), as_float64, strict=True))


def test_no_spread_gives_the_point_without_a_numpy_warning() -> None:
    """Every example changed by the same per-token amount: no spread, so the interval is the point, and the
    skewness (0 / 0) is no warning in the run's log."""
    t = np.array([10.0, 20.0, 30.0, 40.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        estimate, low, high = ratio_bounds(0.2 * t, t, 0.95, "skew_t")
    assert estimate == pytest.approx(0.2) and low == pytest.approx(0.2) and high == pytest.approx(0.2)


@pytest.mark.parametrize("confidence", [0.0, 1.0, 1.5, -0.1])
def test_a_confidence_outside_0_1_is_refused_naming_it(confidence: float) -> None:
    with pytest.raises(ValueError, match=rf"confidence must be in \(0, 1\), got {confidence}"):
        ratio_bounds(np.ones(5), np.ones(5), confidence)


def test_an_unknown_method_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="ratio_bounds computes the t and skew_t intervals, not 'bca'"):
        ratio_bounds(np.ones(5), np.ones(5), 0.95, "bca")


# -- the paired loss difference ------------------------------------------------------------------------------------
def test_the_paired_difference_is_the_ratio_interval_of_the_differences_with_the_method_asked_for() -> None:
    x, tokens = _skewed(40, 3)
    production = np.random.default_rng(5).uniform(2.0, 4.0, size=40) * tokens
    candidate = production + x
    for method in ("t", "skew_t"):
        paired = paired_loss_difference(candidate, production, tokens, method=method)
        assert paired.method == method
        assert paired.difference == ratio_interval(candidate - production, tokens, 0.95, method)
    with pytest.raises(
        ValueError, match=r"interval method must be one of \['bootstrap', 'skew_t', 't'\], not 'z'"
    ):
        paired_loss_difference(candidate, production, tokens, method="z")


def test_the_bootstrap_difference_resamples_whole_examples_2000_times_from_seed_0() -> None:
    """The percentile bootstrap of the token-weighted difference, each resample drawing examples (both models'
    losses and tokens together) with replacement; by default 2000 resamples from seed 0, so a report can be
    recomputed."""
    x, tokens = _skewed(30, 6)
    production = np.random.default_rng(8).uniform(2.0, 4.0, size=30) * tokens
    candidate = production + x
    paired = paired_loss_difference(candidate, production, tokens, method="bootstrap")
    assert paired.method == "bootstrap" and paired.examples == 30 and paired.tokens == int(tokens.sum())
    idx = np.random.default_rng(0).integers(0, 30, size=(2000, 30))
    diffs = (candidate[idx].sum(axis=1) - production[idx].sum(axis=1)) / tokens[idx].sum(axis=1)
    low, high = np.quantile(diffs, [0.025, 0.975])
    mean_difference = candidate.sum() / tokens.sum() - production.sum() / tokens.sum()
    assert paired.difference.estimate == pytest.approx(mean_difference, rel=1e-12)
    assert (paired.difference.low, paired.difference.high) == pytest.approx((low, high), rel=1e-12)
