"""Paired comparison of two models on the same examples: the statistics behind the promotion gate.

Two models measured on the *same* eval set differ example by example; pairing removes the variance of the examples
themselves (a hard question is hard for both), so a small eval set can still tell a real improvement from noise.

* ``paired_loss_difference``: per-example summed NLL and token counts of both models on the same examples; the
  statistic is the difference of their token-weighted mean losses (what training optimises), a ratio of sums. Its
  default interval (``skew_t``, ``ratio_interval``) is Hall's (1992) skew-corrected t on the ratio estimator's
  delta-method residuals, never narrower than the plain studentized t (``t``): per-example loss differences are
  skewed (a few examples improve a lot, most move a little), and a symmetric t-interval then misses on the side of
  the long tail (87 % coverage at n = 30 where 95 % is claimed). A percentile bootstrap of n examples understates
  the uncertainty when n is small (with one example it resamples that example every time: a zero-width "95 %"
  interval); the t-intervals widen as n shrinks and do not exist below two examples.
  ``core/evaluation/interval_coverage.py`` measures every method's coverage on symmetric, skewed and heavy-tailed
  simulated eval sets (``tests/unit/core/evaluation/test_paired.py`` asserts it).
* ``order_consistent_win_rate``: the judge compares the two answers twice, once in each order; only verdicts that
  agree across the orders count (a judge that always picks "A" contributes nothing), and the win rate among them
  gets a Wilson score interval; flips and unreadable replies are counted apart, and the headline rate counts a
  flip as a tie. ``pointwise_win_rate``: each answer scored on its own (1-5), the higher score wins a prompt: no
  answer order for a judge to be biased by.

Dagster-free and model-free (``bench/learning.py`` reuses it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from statistics import NormalDist
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
    "skew_t": "skew-corrected t-interval (Hall's 1992 transformation of the studentized ratio of sums, delta-method "
    "residuals, n - 1 df; never narrower than the plain t)",
    "t": "studentized t-interval (delta-method standard error of the token-weighted mean, n - 1 df)",
    "bootstrap": "percentile bootstrap over examples",
}
DEFAULT_INTERVAL_METHOD = "skew_t"


@dataclass(frozen=True)
class PairedLoss:
    """Both models' mean loss on the same examples and the difference candidate - production with its interval.

    ``examples`` is the n the interval rests on; ``method`` how the interval was computed (``INTERVAL_METHODS``)."""

    candidate: float
    production: float
    difference: Interval
    examples: int
    tokens: int
    method: str = DEFAULT_INTERVAL_METHOD

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "difference": asdict(self.difference)}


def mean_loss(nll_sums: Sequence[float], tokens: Sequence[int]) -> float:
    """Token-weighted mean NLL over examples (sum of NLL over sum of tokens)."""
    total = float(np.sum(tokens))
    if total <= 0:
        raise ValueError("no scored tokens")
    return float(np.sum(nll_sums)) / total


def ratio_bounds(
    numerators: np.ndarray, denominators: np.ndarray, confidence: float, method: str = DEFAULT_INTERVAL_METHOD
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``sum(numerators) / sum(denominators)`` over the last axis, with the ``t`` or ``skew_t`` interval's bounds:
    ``(estimate, low, high)``, each of the leading shape (one eval set, or many simulated ones at once).

    The ratio estimator R = sum(x) / sum(t) has, to first order, the standard error of the mean of the residuals
    ``z_i = (x_i - R t_i) / mean(t)`` (the delta method); ``t`` is R +- t_{n-1} * SE. ``skew_t`` corrects for the
    residuals' skewness g (third central moment over the cubed standard deviation s, with the usual small-sample
    factor sqrt(n (n - 1)) / (n - 2)) by Hall's monotone transformation of the studentized statistic,
    f(W) = W + g W^2 / 3 + g^2 W^3 / 27 + g / (6 n) with W = (R - true) / s, whose distribution is Student's at
    order 1/n: the interval reaches further on the side of the long tail. Hall's interval alone is too narrow on
    symmetric heavy-tailed data (its skewness estimate is noise there: 90 % at n = 30 on Student's t with 3 df), so
    each bound is the wider of Hall's and the plain t's. Below two pairs there is no spread: (-inf, inf).
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if method not in ("t", "skew_t"):
        raise ValueError(f"ratio_bounds computes the t and skew_t intervals, not {method!r}")
    x, t = np.asarray(numerators, dtype=np.float64), np.asarray(denominators, dtype=np.float64)
    n = x.shape[-1]
    estimate = x.sum(axis=-1) / t.sum(axis=-1)
    if n < 2:
        infinite = np.full_like(estimate, math.inf)
        return estimate, -infinite, infinite
    from scipy.special import stdtrit  # Student's t quantile; ~1 s to import: not at the code location's load

    q = float(stdtrit(n - 1, 0.5 + confidence / 2))
    residuals = (x - estimate[..., None] * t) / t.mean(axis=-1, keepdims=True)
    s = np.sqrt(np.sum(residuals**2, axis=-1) / (n - 1))  # residuals sum to zero: no mean to subtract
    low, high = estimate - q * s / math.sqrt(n), estimate + q * s / math.sqrt(n)
    if method == "t" or n < 3:
        return estimate, low, high
    m2, m3 = np.mean(residuals**2, axis=-1), np.mean(residuals**3, axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        g = m3 / m2**1.5 * math.sqrt(n * (n - 1)) / (n - 2)
        skewed = np.isfinite(g) & (np.abs(g) > 1e-6)  # else no spread or no skew: the plain t
        g = np.where(skewed, g, 1.0)

        def inverse(y: float) -> np.ndarray:  # W = f^-1(y), f(W) = ((1 + g W / 3)^3 - 1) / g + g / (6 n)
            return np.where(skewed, 3 / g * (np.cbrt(1 + g * (y - g / (6 * n))) - 1), y)

        hall_low = estimate - s * inverse(q / math.sqrt(n))
        hall_high = estimate - s * inverse(-q / math.sqrt(n))
    return estimate, np.minimum(low, hall_low), np.maximum(high, hall_high)


def ratio_interval(
    numerators: np.ndarray, denominators: np.ndarray, confidence: float, method: str = DEFAULT_INTERVAL_METHOD
) -> Interval:
    """One eval set's ``ratio_bounds`` as an ``Interval``."""
    estimate, low, high = ratio_bounds(numerators, denominators, confidence, method)
    return Interval(float(estimate), float(low), float(high), confidence)


def mean_loss_interval(
    nll_sums: Sequence[float],
    tokens: Sequence[int],
    confidence: float = 0.95,
    method: str = DEFAULT_INTERVAL_METHOD,
    resamples: int = 2000,
    seed: int = 0,
) -> Interval:
    """One model's token-weighted mean loss with its interval over examples (``method``: ``INTERVAL_METHODS``)."""
    nll, tok = _arrays(nll_sums, tokens)
    if method != "bootstrap":
        return ratio_interval(nll, tok, confidence, method)
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
    method: str = DEFAULT_INTERVAL_METHOD,
) -> PairedLoss:
    """Difference of the two models' token-weighted mean losses on the same examples (negative: the candidate is
    better), with an interval over examples that keeps each example's pair together: ``"skew_t"`` (default) or
    ``"t"``, ``ratio_interval`` of the per-example differences; ``"bootstrap"`` a percentile bootstrap.

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
    if method != "bootstrap":
        interval = ratio_interval(cand - prod, tok, confidence, method)
    else:
        idx = _resample_indices(len(cand), resamples, seed)
        diffs = (cand[idx].sum(axis=1) - prod[idx].sum(axis=1)) / tok[idx].sum(axis=1)
        interval = _percentile_interval(c - p, diffs, confidence)
    return PairedLoss(c, p, interval, len(cand), int(tok.sum()), method)


JUDGE_MODES = {
    "pairwise": "Wilson score interval over order-consistent pairwise verdicts (both answer orders)",
    "pointwise": "Wilson score interval over decisive pointwise verdicts (each answer scored alone)",
}


@dataclass(frozen=True)
class WinRate:
    """The judge's preference for the candidate over production, prompt by prompt.

    ``rate`` is the *conditional* win rate, wins / (wins + losses), with a Wilson interval: what the gate decides on,
    ``usable`` (wins + losses) its n. Besides it, the *headline* win rate counts an order-inconsistent verdict (and
    a pointwise tie) as half a win (MT-Bench and Arena-Hard do), so a judge that only follows the answers' order
    reads 0.5, not a win; and ``order_consistency``, the share of the judged prompts whose verdict survived the
    swap (pairwise mode). An unreadable reply (in either order, or for either answer) is counted apart from the
    flips: it says nothing about the judge's position bias."""

    wins: int
    losses: int
    inconsistent: int  # pairwise: a readable verdict in both orders, but a different winner (position bias)
    rate: Interval
    method: str = JUDGE_MODES["pairwise"]
    unreadable: int = 0  # prompts with no readable verdict (either order, or either answer's score)
    ties: int = 0  # pointwise: both answers scored the same, within the tie epsilon
    mode: str = "pairwise"

    @property
    def consistent(self) -> int:
        """The usable verdicts the conditional rate rests on (the decision's n)."""
        return self.wins + self.losses

    @property
    def judged(self) -> int:
        """Prompts with a readable verdict (both orders, or both scores)."""
        return self.wins + self.losses + self.inconsistent + self.ties

    @property
    def prompts(self) -> int:
        return self.judged + self.unreadable

    @property
    def order_consistency(self) -> float | None:
        """Share of the judged prompts whose verdict survived the answer swap; None in pointwise mode (no order)
        or when nothing was readable."""
        if self.mode != "pairwise" or self.judged == 0:
            return None
        return (self.judged - self.inconsistent) / self.judged

    @property
    def headline(self) -> float:
        """Wins plus half of the inconsistent verdicts and ties, over the judged prompts (0.5 with none)."""
        if self.judged == 0:
            return 0.5
        return (self.wins + 0.5 * (self.inconsistent + self.ties)) / self.judged

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "rate": asdict(self.rate),
            "usable": self.consistent,
            "prompts": self.prompts,
            "order_consistency": self.order_consistency,
            "headline": self.headline,
        }


def _win_rate(
    wins: int, losses: int, inconsistent: int, unreadable: int, ties: int, mode: str, confidence: float
) -> WinRate:
    low, high = wilson_interval(wins, wins + losses, confidence)
    rate = wins / (wins + losses) if wins + losses else 0.5
    return WinRate(
        wins,
        losses,
        inconsistent,
        Interval(rate, low, high, confidence),
        JUDGE_MODES[mode],
        unreadable,
        ties,
        mode,
    )


def order_consistent_win_rate(
    candidate_first: Sequence[Verdict], production_first: Sequence[Verdict], confidence: float = 0.95
) -> WinRate:
    """Win rate of the candidate over the prompts whose two verdicts (candidate shown first, production shown
    first) name the same winner. Each element names the preferred model, or ``None`` for no usable verdict
    (counted as unreadable, apart from the verdicts that flip with the order).

    With no consistent verdict at all the rate is 0.5 with the interval [0, 1]: nothing is known.
    """
    if len(candidate_first) != len(production_first):
        raise ValueError(
            f"both answer orders must be judged on the same prompts: {len(candidate_first)} vs "
            f"{len(production_first)} verdicts"
        )
    wins = losses = inconsistent = unreadable = 0
    for first, second in zip(candidate_first, production_first, strict=True):
        if first is None or second is None:
            unreadable += 1
        elif first == second:
            wins += first == "candidate"
            losses += first == "production"
        else:
            inconsistent += 1
    return _win_rate(wins, losses, inconsistent, unreadable, 0, "pairwise", confidence)


def pointwise_verdicts(
    candidate_scores: Sequence[float | None],
    production_scores: Sequence[float | None],
    tie_epsilon: float = 0.0,
) -> list[Verdict | Literal["tie"]]:
    """Each prompt's verdict from the two answers' own scores (as a reward model scores: no position to favour):
    the higher score wins; ``"tie"`` when they differ by ``tie_epsilon`` or less; ``None`` when either answer has
    no score (an unreadable verdict)."""
    if len(candidate_scores) != len(production_scores):
        raise ValueError(
            f"both models' answers must be scored on the same prompts: {len(candidate_scores)} vs "
            f"{len(production_scores)} scores"
        )
    if tie_epsilon < 0:
        raise ValueError(f"tie_epsilon must be >= 0, got {tie_epsilon}")
    out: list[Verdict | Literal["tie"]] = []
    for c, p in zip(candidate_scores, production_scores, strict=True):
        if c is None or p is None or not (math.isfinite(c) and math.isfinite(p)):
            out.append(None)
        elif abs(c - p) <= tie_epsilon:
            out.append("tie")
        else:
            out.append("candidate" if c > p else "production")
    return out


def pointwise_win_rate(
    candidate_scores: Sequence[float | None],
    production_scores: Sequence[float | None],
    tie_epsilon: float = 0.0,
    confidence: float = 0.95,
) -> WinRate:
    """Win rate of the candidate over the prompts where the two answers' scores differ by more than
    ``tie_epsilon`` (``pointwise_verdicts``); ties and unreadable scores are counted apart."""
    verdicts = pointwise_verdicts(candidate_scores, production_scores, tie_epsilon)
    return _win_rate(
        verdicts.count("candidate"),
        verdicts.count("production"),
        0,
        verdicts.count(None),
        verdicts.count("tie"),
        "pointwise",
        confidence,
    )


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
