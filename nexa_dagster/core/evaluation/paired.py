"""Paired comparison of two models on the same examples: the statistics behind the promotion gate.

Two models measured on the *same* eval set differ example by example; pairing removes the variance of the examples
themselves (a hard question is hard for both), so a small eval set can still tell a real improvement from noise.

* ``paired_loss_difference``: per-example summed NLL and token counts of both models on the same examples; the
  statistic is the difference of their token-weighted mean losses (what training optimises). Its interval is a
  studentized one (``ratio_t_interval``): the ratio estimator's delta-method standard error over examples, with
  Student's t at n - 1 degrees of freedom. A percentile bootstrap of n examples understates the uncertainty when n
  is small (with one example it resamples that example every time: a zero-width "95 %" interval); the t-interval
  widens as n shrinks and does not exist below two examples. ``tests/unit/core/evaluation/test_paired.py``
  measures its coverage on simulated paired data (93-97 % of 1,000 draws at n = 30).
* ``order_consistent_win_rate``: the judge compares the two answers twice, once in each order; only verdicts that
  agree across the orders count (a judge that always picks "A" contributes nothing), and the win rate among them
  gets a Wilson score interval.

Dagster-free and model-free (``bench/learning.py`` reuses it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

Verdict = Literal["candidate", "production"] | None


@dataclass(frozen=True)
class Interval:
    """A point estimate with its confidence interval."""

    estimate: float
    low: float
    high: float
    confidence: float

    def excludes(self, value: float) -> bool:
        return not (self.low <= value <= self.high)


INTERVAL_METHODS = {
    "t": "studentized t-interval (delta-method standard error of the token-weighted mean, n - 1 df)",
    "bootstrap": "percentile bootstrap over examples",
}


@dataclass(frozen=True)
class PairedLoss:
    """Both models' mean loss on the same examples and the difference candidate - production with its interval.

    ``examples`` is the n the interval rests on; ``method`` how the interval was computed (``INTERVAL_METHODS``)."""

    candidate: float
    production: float
    difference: Interval
    examples: int
    tokens: int
    method: str = "t"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "difference": asdict(self.difference)}


def mean_loss(nll_sums: Sequence[float], tokens: Sequence[int]) -> float:
    """Token-weighted mean NLL over examples (sum of NLL over sum of tokens)."""
    total = float(np.sum(tokens))
    if total <= 0:
        raise ValueError("no scored tokens")
    return float(np.sum(nll_sums)) / total


def ratio_t_interval(numerators: np.ndarray, denominators: np.ndarray, confidence: float) -> Interval:
    """``sum(numerators) / sum(denominators)`` with a studentized interval over the n pairs.

    The ratio estimator R = sum(x) / sum(t) has, to first order, the standard error of the mean of the residuals
    ``x_i - R t_i`` divided by the mean of ``t`` (the delta method); the interval is R +- t_{n-1} * SE. With fewer
    than two pairs there is no estimate of the spread: the interval is (-inf, inf), which no gate can pass.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    x, t = np.asarray(numerators, dtype=np.float64), np.asarray(denominators, dtype=np.float64)
    n = len(x)
    estimate = float(x.sum() / t.sum())
    if n < 2:
        return Interval(estimate, -math.inf, math.inf, confidence)
    from scipy.special import stdtrit  # Student's t quantile; ~1 s to import: not at the code location's load

    residuals = x - estimate * t
    se = math.sqrt(float(np.sum(residuals**2)) / (n * (n - 1))) / float(t.mean())
    half = float(stdtrit(n - 1, 0.5 + confidence / 2)) * se
    return Interval(estimate, estimate - half, estimate + half, confidence)


def mean_loss_interval(
    nll_sums: Sequence[float],
    tokens: Sequence[int],
    confidence: float = 0.95,
    method: str = "t",
    resamples: int = 2000,
    seed: int = 0,
) -> Interval:
    """One model's token-weighted mean loss with its interval over examples (``method``: ``t`` or ``bootstrap``)."""
    nll, tok = _arrays(nll_sums, tokens)
    if method == "t":
        return ratio_t_interval(nll, tok, confidence)
    return bootstrap_mean_loss(nll, tok, confidence, resamples, seed)


def bootstrap_mean_loss(
    nll_sums: Sequence[float],
    tokens: Sequence[int],
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> Interval:
    """One model's token-weighted mean loss with a percentile bootstrap interval over examples."""
    nll, tok = _arrays(nll_sums, tokens)
    idx = _resample_indices(len(nll), resamples, seed)
    stats = nll[idx].sum(axis=1) / tok[idx].sum(axis=1)
    return _percentile_interval(mean_loss(nll, tok), stats, confidence)


def paired_loss_difference(
    candidate_nll: Sequence[float],
    production_nll: Sequence[float],
    tokens: Sequence[int],
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
    method: str = "t",
) -> PairedLoss:
    """Difference of the two models' token-weighted mean losses on the same examples (negative: the candidate is
    better), with an interval over examples that keeps each example's pair together: ``method="t"`` (default) the
    studentized ``ratio_t_interval`` of the per-example differences, ``"bootstrap"`` a percentile bootstrap.

    ``candidate_nll[i]`` and ``production_nll[i]`` are the summed NLL of example ``i``'s ``tokens[i]`` scored
    tokens under each model (both models see the same tokens: the eval set is tokenized once).
    """
    if len(candidate_nll) != len(production_nll):
        raise ValueError(
            f"paired comparison needs the same examples: {len(candidate_nll)} candidate vs "
            f"{len(production_nll)} production values"
        )
    if method not in INTERVAL_METHODS:
        raise ValueError(f"interval method must be one of {sorted(INTERVAL_METHODS)}, not {method!r}")
    cand, tok = _arrays(candidate_nll, tokens)
    prod, _ = _arrays(production_nll, tokens)
    c, p = mean_loss(cand, tok), mean_loss(prod, tok)
    if method == "t":
        interval = ratio_t_interval(cand - prod, tok, confidence)
    else:
        idx = _resample_indices(len(cand), resamples, seed)
        diffs = (cand[idx].sum(axis=1) - prod[idx].sum(axis=1)) / tok[idx].sum(axis=1)
        interval = _percentile_interval(c - p, diffs, confidence)
    return PairedLoss(c, p, interval, len(cand), int(tok.sum()), method)


@dataclass(frozen=True)
class WinRate:
    """The judge's preference for the candidate among order-consistent verdicts, with a Wilson interval.

    ``consistent`` (wins + losses) is the n the interval rests on."""

    wins: int
    losses: int
    inconsistent: int  # the verdict flipped with the answer order (position bias) or was unreadable
    rate: Interval
    method: str = "Wilson score interval over order-consistent verdicts"

    @property
    def consistent(self) -> int:
        return self.wins + self.losses

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "rate": asdict(self.rate)}


def order_consistent_win_rate(
    candidate_first: Sequence[Verdict], production_first: Sequence[Verdict], confidence: float = 0.95
) -> WinRate:
    """Win rate of the candidate over the prompts whose two verdicts (candidate shown first, production shown
    first) name the same winner. Each element names the preferred model, or ``None`` for no usable verdict.

    With no consistent verdict at all the rate is 0.5 with the interval [0, 1]: nothing is known.
    """
    if len(candidate_first) != len(production_first):
        raise ValueError(
            f"both answer orders must be judged on the same prompts: {len(candidate_first)} vs "
            f"{len(production_first)} verdicts"
        )
    wins = losses = inconsistent = 0
    for first, second in zip(candidate_first, production_first, strict=True):
        if first is not None and first == second:
            wins += first == "candidate"
            losses += first == "production"
        else:
            inconsistent += 1
    low, high = wilson_interval(wins, wins + losses, confidence)
    rate = wins / (wins + losses) if wins + losses else 0.5
    return WinRate(wins, losses, inconsistent, Interval(rate, low, high, confidence))


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (sound at small n and at 0 or n successes)."""
    if trials == 0:
        return 0.0, 1.0
    z = _normal_quantile(0.5 + confidence / 2)
    p = successes / trials
    denom = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def _normal_quantile(q: float) -> float:
    from statistics import NormalDist

    return NormalDist().inv_cdf(q)


def _arrays(nll_sums: Sequence[float], tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    nll = np.asarray(nll_sums, dtype=np.float64)
    tok = np.asarray(tokens, dtype=np.float64)
    if nll.ndim != 1 or nll.shape != tok.shape:
        raise ValueError(f"need one NLL sum and one token count per example, got {nll.shape} and {tok.shape}")
    if len(nll) == 0:
        raise ValueError("no examples to compare")
    if (tok <= 0).any():
        raise ValueError(f"example {int(np.argmax(tok <= 0))} has no scored tokens")
    if not np.isfinite(nll).all():
        raise ValueError(f"example {int(np.argmax(~np.isfinite(nll)))} has a non-finite loss")
    return nll, tok


def _resample_indices(n: int, resamples: int, seed: int) -> np.ndarray:
    if resamples < 100:
        raise ValueError(f"bootstrap needs at least 100 resamples, got {resamples}")
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def _percentile_interval(estimate: float, stats: np.ndarray, confidence: float) -> Interval:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    alpha = (1 - confidence) / 2
    low, high = np.quantile(stats, [alpha, 1 - alpha])
    return Interval(float(estimate), float(low), float(high), confidence)


@dataclass(frozen=True)
class LengthControlled:
    """AlpacaEval's length-controlled win rate: a logistic model of the judge's verdict on the (tanh-scaled) length
    difference of the two answers, read at a zero length difference; and how much longer the candidate's answers
    are on average (characters). A judge that prefers longer answers cannot hand a win to a model that only talks
    more."""

    win_rate: float
    length_coefficient: float
    mean_length_change: float
    verdicts: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def length_controlled_win_rate(
    candidate_first: Sequence[Verdict],
    production_first: Sequence[Verdict],
    candidate_lengths: Sequence[int],
    production_lengths: Sequence[int],
    iterations: int = 50,
) -> LengthControlled:
    """Fit ``P(candidate wins) = sigmoid(a + b * tanh(d / sd(d)))`` on the order-consistent verdicts (``d``: the
    length difference) by Newton's method with a small ridge on ``b``; the length-controlled win rate is
    ``sigmoid(a)``. With no consistent verdict it is 0.5; with every difference zero, the plain win rate."""
    wins, diffs = [], []
    for first, second, c, p in zip(
        candidate_first, production_first, candidate_lengths, production_lengths, strict=True
    ):
        if first is not None and first == second:
            wins.append(1.0 if first == "candidate" else 0.0)
            diffs.append(float(c - p))
    change = (
        float(np.mean(np.asarray(candidate_lengths, float) - np.asarray(production_lengths, float)))
        if len(candidate_lengths)
        else 0.0
    )
    if not wins:
        return LengthControlled(0.5, 0.0, change, 0)
    y, d = np.asarray(wins), np.asarray(diffs)
    scale = float(d.std()) or 1.0
    x = np.stack([np.ones_like(d), np.tanh(d / scale)], axis=1)
    beta = np.zeros(2)
    ridge = np.diag([1e-3, 1e-1])  # keeps the fit finite when every verdict agrees (separable data)
    for _ in range(iterations):
        p = 1 / (1 + np.exp(-(x @ beta)))
        gradient = x.T @ (y - p) - ridge @ beta
        hessian = x.T @ (x * (p * (1 - p))[:, None]) + ridge
        step = np.linalg.solve(hessian, gradient)
        beta = beta + step
        if np.abs(step).max() < 1e-10:
            break
    return LengthControlled(float(1 / (1 + math.exp(-beta[0]))), float(beta[1]), change, len(wins))
