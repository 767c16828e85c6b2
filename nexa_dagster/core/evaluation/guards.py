"""Guards against promoting a worse model: ONE function over per-example paired differences that every gate calls.

A mean can hide the common way a fine-tune goes wrong: better on most examples, much worse on a few. An interval
computed from a sample that barely holds those few (two of ten percent at n = 47 in 14 % of samples) promotes a
worse model far more often than it claims (8.4 % at n = 30 where 2.5 % is claimed: issue 40). So beside the mean,
every gate (eval-set loss, the judge's pointwise scores, an RL reward gate) hands its per-example differences to::

    from nexa_dagster.core.evaluation.guards import GuardPolicy, paired_guards

    report = paired_guards(
        differences,              # candidate - production, one value per example (or prompt)
        higher_is_better=False,   # loss: False; a reward, a judge's score, an accuracy: True
        policy=GuardPolicy(),     # promotion.yaml ``guards:`` (or its own: the margin is in the differences' unit)
        weights=tokens,           # optional: the gate's statistic is the weighted mean (the token-weighted loss)
        slices=days,              # optional: one label per example (source file, day, a tag of the eval set)
        confidence=0.95,          # the gate's
    )
    report.verdict    # None: nothing against promoting; "insufficient evidence" or "hold back"
    report.reasons    # one line per finding, each naming its n, its figures and its rule
    report.metadata() # flat figures for Dagster metadata (``guard_*``)

``promotion.apply_guards(decision, report)`` folds the verdict into a ``GateDecision``. The guards:

1. **Skewness (Cochran's rule).** The mean of n examples is close enough to normal for a t-type interval only when
   ``n > 25 * G1**2`` (Cochran 1977, *Sampling Techniques* 2.15), ``G1`` the sample skewness of what the interval is
   computed on (the ratio's delta-method residuals, as ``paired.ratio_bounds``). Applied one-sided: only a tail
   toward the *worse* side refuses ("insufficient evidence"), because a tail of rare regressions is what makes
   the interval promote a worse model, while a tail of rare gains makes it err toward holding a better one back
   (its coverage is reported beside: ``interval_coverage``). Why not Sugden, Smith & Jones's (2000) ``28 + 25 G1**2``:
   the sample skewness is itself noisy (standard error about sqrt(6 / n), 0.45 at n = 30), so the stricter rule
   refuses about a third of plainly normal samples at n = 30; Cochran's refuses about 1 %.
2. **Regressed share.** The share of examples worse by more than ``regression_margin`` (the differences' unit) with
   its Clopper-Pearson interval (exact: the guarantee below holds at every n), against ``max_regressed_share``, the
   share a lab accepts. Why not "the same share between two evaluations of production itself": the loss evaluation
   is deterministic, so production against itself changes no example (share 0) and any candidate with one worse
   example would be "significantly" worse; a seed-to-seed baseline would cost a second training per night. The
   tolerance is a stated number instead, and the test is one-sided in the safe direction: the candidate must show,
   with the gate's confidence, that fewer than ``max_regressed_share`` of examples regressed (interval high below
   it), else "insufficient evidence"; the whole interval above it is "hold back". So a candidate that regresses
   at least that share of the population is promoted in at most (1 - confidence) / 2 of evaluations, whatever the
   shape of its gains, and a lab reads off the n it needs (``required_examples``; docs/stages/evaluation.md).
3. **Slices.** Per slice label (at least ``min_slice_examples`` examples), the slice's weighted mean difference and
   a one-sided t p-value for "worse"; Holm's step-down over the tested slices (family-wise error ``1 - confidence``
   under any dependence, and never less powerful than Bonferroni): a slice significantly worse holds the
   candidate back even when the whole set improved.
4. **Detectable share.** A sample that holds none of the regressed examples looks like a clean gain to every
   statistic computed from it (mean, interval, skewness, regressed share), so none of the guards above can refuse
   it: with 5 % of examples 2.0 nats/token worse, the gate promoted 13 % of eval sets of 36 and 8 % of 47, close to
   the 16 % and 9 % of samples that hold none of them. The lab names the rarest regressions the gate must see,
   ``min_detectable_regressed_share`` p, and below the n at which a sample holds none of p with probability
   (1 - p)^n at most HALF the interval's one-sided error, (1 - confidence) / 4, the decision is "insufficient
   evidence" (``detectable_examples(p)``: 86 for 5 % at 95 %; the other half is the interval's own error on the
   samples that hold some: Bonferroni, so that a candidate regressing p of examples passes in at most the one-sided
   error in all; at 72, where the first alone spends it all, the gate promoted such candidates in up to 3 %). It
   depends on n alone, not on what the sample shows, which is the point: the samples that fool the gate are the
   ones that show nothing. Regressions rarer than p are the stated residual: a share q < p is missed by
   (1 - q)^n of samples, which the gate promotes as clean gains (``interval_coverage``, docs/stages/evaluation.md).

Everything is numpy over a leading axis too (``skew_refuses``, ``regressed_bounds``), so the simulation in
``interval_coverage`` runs the very code a gate runs on thousands of eval sets at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

Verdict = Literal["insufficient evidence", "hold back"]
COCHRAN = 25.0  # Cochran's rule: n > 25 * G1^2


class GuardPolicy(BaseModel):
    """``guards`` of promotion.yaml: how the gate looks at the examples that got worse (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    skew_rule: bool = Field(
        default=True,
        description="refuse (insufficient evidence) when the differences are skewed toward the worse side more "
        "than n carries: n <= 25 * G1^2 (Cochran)",
    )
    regression_margin: float = Field(
        default=0.5,
        ge=0,
        description="an example is regressed when it got worse by more than this, in the differences' unit",
    )
    max_regressed_share: float | None = Field(
        default=0.10,
        gt=0,
        lt=1,
        description="the share of regressed examples a lab accepts: the interval's high end must be below it "
        "(null turns the guard off)",
    )
    min_detectable_regressed_share: float | None = Field(
        default=0.05,
        gt=0,
        lt=1,
        description="the smallest share of regressed examples the gate must be able to see: insufficient "
        "evidence while a sample of n holds none of that share with probability (1 - share)^n above half the "
        "gate's one-sided error, (1 - confidence) / 4 (n >= 86 for 0.05 at 95%); null turns the rule off",
    )
    slice_by: str | None = Field(
        default="day",
        description="the eval set's field whose values are slices (samples.jsonl: day); null: no slices",
    )
    min_slice_examples: int = Field(
        default=10, ge=2, description="a slice with fewer examples is listed, not tested"
    )


@dataclass(frozen=True)
class SliceResult:
    """One slice: its n, its weighted mean difference oriented so that positive is worse, and its tests."""

    label: str
    n: int
    worse_by: float  # candidate's mean change in the worse direction (negative: better)
    p_value: float | None  # one-sided, "worse"; None: too few examples to test
    adjusted_p: float | None = None  # Holm
    significant: bool = False


@dataclass(frozen=True)
class GuardReport:
    """What the guards found on one comparison: the figures of each guard and the findings, each with its verdict."""

    n: int
    skewness: float  # toward the worse side when positive
    skew_needs: int  # the n Cochran's rule needs for this skewness (0 when skewed toward the better side)
    regressed: int
    regressed_share: float
    regressed_interval: tuple[float, float]
    margin: float
    max_regressed_share: float | None
    slices: tuple[SliceResult, ...] = ()
    findings: tuple[tuple[Verdict, str], ...] = field(default=())
    confidence: float = 0.95
    min_detectable_share: float | None = None  # guards.min_detectable_regressed_share

    @property
    def verdict(self) -> Verdict | None:
        kinds = {kind for kind, _ in self.findings}
        return "hold back" if "hold back" in kinds else ("insufficient evidence" if kinds else None)

    @property
    def reasons(self) -> list[str]:
        return [text for _, text in self.findings]

    def summary(self) -> str:
        """The guards' figures in one line, whether they found anything or not."""
        low, high = self.regressed_interval
        tested = [s for s in self.slices if s.p_value is not None]
        worst = max(tested, key=lambda s: s.worse_by, default=None)
        slices = (
            f"; {len(tested)} slices tested (Holm), worst {worst.label} worse by {worst.worse_by:+.4f}"
            if worst
            else ""
        )
        return (
            f"skewness toward worse {self.skewness:+.2f} ("
            + (
                f"Cochran's rule needs n >= {self.skew_needs}"
                if self.skew_needs
                else "toward better: no limit"
            )
            + f", n = {self.n}); "
            f"{self.regressed} of {self.n} examples worse by > {self.margin:g} ({self.regressed_share:.1%}, "
            f"{self.confidence:.0%} CI [{low:.1%}, {high:.1%}])" + slices
        )

    def metadata(self) -> dict[str, Any]:
        low, high = self.regressed_interval
        return {
            "guard_verdict": self.verdict or "pass",
            "guard_reasons": self.reasons,
            "guard_skewness": self.skewness,
            "guard_skew_needs_n": self.skew_needs,
            "guard_regressed": self.regressed,
            "guard_regressed_share": self.regressed_share,
            "guard_regressed_interval": [low, high],
            "guard_regression_margin": self.margin,
            "guard_max_regressed_share": self.max_regressed_share,
            "guard_min_detectable_share": self.min_detectable_share,
            "guard_slices": [asdict(s) for s in self.slices],
        }

    def to_json(self) -> dict[str, Any]:
        return {**self.metadata(), "n": self.n, "summary": self.summary()}


def _oriented(differences: Any, higher_is_better: bool) -> np.ndarray:
    """The differences as "how much worse the candidate is" (positive: worse)."""
    d = np.asarray(differences, dtype=np.float64)
    return d if not higher_is_better else -d


def _weights(weights: Any, shape: tuple[int, ...]) -> np.ndarray:
    w = np.ones(shape) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != shape:
        raise ValueError(f"need one weight per difference, got {w.shape} weights for {shape} differences")
    return w


def skewness(worse: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The adjusted sample skewness G1 (over the last axis) of the weighted mean's delta-method residuals
    ``w_i (d_i - R) / mean(w)`` (what ``paired.ratio_bounds`` computes its interval on); 0 with no spread."""
    n = worse.shape[-1]
    ratio = (worse * weights).sum(axis=-1, keepdims=True) / weights.sum(axis=-1, keepdims=True)
    z = weights * (worse - ratio) / weights.mean(axis=-1, keepdims=True)
    z = z - z.mean(axis=-1, keepdims=True)
    m2, m3 = np.mean(z**2, axis=-1), np.mean(z**3, axis=-1)
    if n < 3:
        return np.zeros_like(m2)
    with np.errstate(invalid="ignore", divide="ignore"):
        g = m3 / m2**1.5 * math.sqrt(n * (n - 1)) / (n - 2)
    return np.where(np.isfinite(g), g, 0.0)


def skew_refuses(g1: np.ndarray, n: int) -> np.ndarray:
    """Cochran's rule, one-sided: True where the skewness toward the worse side needs more than ``n`` examples."""
    return (g1 > 0) & (n <= COCHRAN * g1**2)


def regressed_bounds(regressed: np.ndarray, n: int, confidence: float) -> tuple[np.ndarray, np.ndarray]:
    """Clopper-Pearson (exact binomial) interval of the regressed share, at ``confidence`` two-sided."""
    from scipy.special import betaincinv  # the beta quantile; ~1 s to import: not at the code location's load

    k = np.asarray(regressed, dtype=np.float64)
    alpha = (1 - confidence) / 2
    with np.errstate(invalid="ignore"):
        low = np.where(k > 0, betaincinv(k, n - k + 1, alpha), 0.0)
        high = np.where(k < n, betaincinv(k + 1, n - k, 1 - alpha), 1.0)
    return low, high


@lru_cache(maxsize=1024)
def required_examples(max_regressed_share: float, confidence: float = 0.95, regressed: int = 0) -> int:
    """The smallest eval set on which a candidate with ``regressed`` regressed examples can pass the
    regressed-share guard (its Clopper-Pearson high end below ``max_regressed_share``). With none regressed that
    high end is ``1 - alpha^(1/n)`` (``alpha = (1 - confidence) / 2``), below a share p exactly when
    ``(1 - p)^n < alpha``: the smallest sample that holds at least one example of a share p but in ``alpha`` of
    draws (``unseen_probability``). The detectable-share rule asks for more, ``detectable_examples``: that bound at
    half of ``alpha``, the other half being the interval's."""
    n = regressed + 1
    while regressed_bounds(np.array(regressed), n, confidence)[1] >= max_regressed_share:
        n += 1
    return n


@lru_cache(maxsize=256)
def detectable_examples(share: float, confidence: float = 0.95) -> int:
    """The smallest n the detectable-share rule decides at: a sample of n holds none of a ``share`` of the
    population with probability ``(1 - share)^n`` at most HALF the gate's one-sided error, ``(1 - confidence) / 4``
    (1.25 % at 95 %: n = 86 for 5 %). Why half: a candidate whose regressions make up ``share`` passes the gate in
    two ways, the sample holding none of them (every statistic then sees a clean gain: probability
    ``unseen_probability``, known exactly) or the sample holding some that the interval and the other guards still
    let through (the interval's own one-sided error on such a sample). Bonferroni's bound splits the one-sided error
    between the two, equally for want of a reason to favour either, so that together they stay within it; at the
    n where the first alone uses the whole error (72 for 5 %: 0.95^72 = 2.49 %) the second comes on top (the gate
    promoted 2.65 % and 3.40 % of two such populations there, issue 47). ``interval_coverage`` measures the whole
    gate at every n on every population (docs/stages/evaluation.md)."""
    budget = (1 - confidence) / 4
    n = max(1, math.ceil(math.log(budget) / math.log1p(-share)))
    while unseen_probability(share, n) > budget:  # float rounding of the logarithms
        n += 1
    return n


def unseen_probability(share: float, n: int) -> float:
    """The probability that a sample of ``n`` examples holds none of a ``share`` of the population: such a sample
    looks like a clean improvement to every statistic computed from it (the mean, its interval, the skewness, the
    regressed share), so no guard can refuse it. The detectable-share rule keeps this at or below the gate's
    one-sided error for the share the lab names."""
    return (1.0 - share) ** n


def _slice_results(
    worse: np.ndarray, weights: np.ndarray, labels: Sequence[str], policy: GuardPolicy, confidence: float
) -> tuple[SliceResult, ...]:
    """Each slice's weighted mean change toward worse, its one-sided t p-value, and Holm's step-down at family-wise
    level ``1 - confidence`` over the slices with at least ``min_slice_examples`` examples."""
    from scipy.special import stdtr  # Student's t CDF

    if len(labels) != len(worse):
        raise ValueError(
            f"need one slice label per example, got {len(labels)} labels for {len(worse)} examples"
        )
    names = np.asarray([str(label) for label in labels])
    results = []
    for label in sorted(set(names.tolist())):
        mask = names == label
        d, w = worse[mask], weights[mask]
        n = int(mask.sum())
        mean = float((d * w).sum() / w.sum())
        if n < policy.min_slice_examples:
            results.append(SliceResult(label, n, mean, None))
            continue
        z = w * (d - mean) / w.mean()
        se = math.sqrt(float(np.sum(z**2)) / (n - 1) / n)
        # no spread: every example of the slice changed alike, worse for sure, better for sure, or not at all
        still = 0.0 if mean > 0 else (1.0 if mean < 0 else 0.5)
        p = float(1 - stdtr(n - 1, mean / se)) if se > 0 else still
        results.append(SliceResult(label, n, mean, p))
    tested = sorted((r for r in results if r.p_value is not None), key=lambda r: r.p_value or 0.0)
    alpha, m, adjusted, running, rejecting = 1 - confidence, len(tested), {}, 0.0, True
    for rank, r in enumerate(tested):
        running = max(running, min(1.0, (m - rank) * (r.p_value or 0.0)))  # Holm's adjusted p, monotone
        rejecting = rejecting and running <= alpha
        adjusted[r.label] = (running, rejecting and r.worse_by > 0)
    return tuple(
        SliceResult(r.label, r.n, r.worse_by, r.p_value, *adjusted[r.label]) if r.label in adjusted else r
        for r in results
    )


def paired_guards(
    differences: Any,
    *,
    higher_is_better: bool,
    policy: GuardPolicy | None = None,
    weights: Any = None,
    slices: Sequence[str] | None = None,
    confidence: float = 0.95,
    unit: str = "",
) -> GuardReport:
    """The guards (module docstring) on one comparison's per-example differences (candidate - production);
    ``unit`` names the differences' unit in the reasons ("nats/token", "judge points", "reward")."""
    policy = policy or GuardPolicy()
    worse = _oriented(differences, higher_is_better)
    if worse.ndim != 1 or len(worse) == 0 or not np.isfinite(worse).all():
        raise ValueError(f"need a finite difference per example, got shape {worse.shape}")
    w = _weights(weights, worse.shape)
    if (w <= 0).any():
        raise ValueError(f"example {int(np.argmax(w <= 0))} has a weight <= 0")
    sliced = _slice_results(worse, w, slices, policy, confidence) if slices is not None else ()
    return guard_report(
        len(worse),
        float(skewness(worse, w)),
        int(np.sum(worse > policy.regression_margin)),
        policy,
        confidence,
        sliced,
        unit,
    )


def guard_report(
    n: int,
    g1: float,
    regressed: int,
    policy: GuardPolicy,
    confidence: float = 0.95,
    slices: tuple[SliceResult, ...] = (),
    unit: str = "",
) -> GuardReport:
    """The report and its findings from one comparison's figures: its n, the skewness toward worse ``g1``
    (``skewness``), the number of examples worse by more than the margin. ``paired_guards`` computes them from the
    differences; ``interval_coverage`` computes them for thousands of simulated eval sets at once with the same
    vectorised functions and builds each one's report here, so the simulation decides with the gate's own rules."""
    needs = int(math.floor(COCHRAN * g1**2)) + 1 if g1 > 0 else 0
    low, high = _regressed_interval(regressed, n, confidence)
    report = GuardReport(
        n,
        g1,
        needs,
        regressed,
        regressed / n,
        (low, high),
        policy.regression_margin,
        policy.max_regressed_share,
        slices,
        confidence=confidence,
        min_detectable_share=policy.min_detectable_regressed_share,
    )
    return replace(report, findings=_findings(report, policy, " " + unit if unit else ""))


@lru_cache(maxsize=4096)
def _regressed_interval(regressed: int, n: int, confidence: float) -> tuple[float, float]:
    """``regressed_bounds`` of one eval set (cached: a simulation asks for the same few (k, n) many times)."""
    low, high = regressed_bounds(np.array(regressed), n, confidence)
    return float(low), float(high)


def _detectable_finding(n: int, share: float | None, confidence: float) -> list[tuple[Verdict, str]]:
    """The detectable-share rule: "insufficient evidence" while a sample of ``n`` holds none of ``share`` more often
    than the gate's one-sided error (the regressions the lab said it must catch would go unseen)."""
    if share is None or n >= detectable_examples(share, confidence):
        return []
    return [
        (
            "insufficient evidence",
            f"insufficient evidence: a sample of n = {n} holds none of a {share:.0%} share of regressed examples "
            f"with probability {1 - share:g}^{n} = {unseen_probability(share, n):.2%} > {(1 - confidence) / 4:.2%} "
            f"(half the one-sided error; the other half is the interval's on samples that hold some) and then "
            f"looks like a clean gain: it cannot see the regressions min_detectable_regressed_share says the gate "
            f"must catch (n >= {detectable_examples(share, confidence)} needed)",
        )
    ]


def _findings(report: GuardReport, policy: GuardPolicy, unit: str) -> tuple[tuple[Verdict, str], ...]:
    """Each guard's finding on ``report``, with its verdict, as the sentence the summary and the UI show."""
    n, g1, needs, regressed = report.n, report.skewness, report.skew_needs, report.regressed
    confidence, sliced, (low, high) = report.confidence, report.slices, report.regressed_interval
    findings: list[tuple[Verdict, str]] = []
    if policy.skew_rule and bool(skew_refuses(np.array(g1), n)):
        findings.append(
            (
                "insufficient evidence",
                f"insufficient evidence: the per-example differences are skewed toward worse (G1 = {g1:+.2f}): "
                f"a mean over n = {n} is not near normal (Cochran's rule needs n > 25 G1^2 = {needs - 1})",
            )
        )
    p0 = policy.max_regressed_share
    shares = (
        f"{regressed} of {n} examples worse by > {policy.regression_margin:g}{unit} ({regressed / n:.1%}, "
        f"{confidence:.0%} CI [{low:.1%}, {high:.1%}])"
    )
    if p0 is not None and low > p0:
        findings.append(("hold back", f"regressed: {shares}, above max_regressed_share {p0:.0%}"))
    elif p0 is not None and high >= p0:
        findings.append(
            (
                "insufficient evidence",
                f"insufficient evidence on regressions: {shares}: cannot rule out max_regressed_share {p0:.0%} "
                f"(n >= {required_examples(p0, confidence, regressed)} needed with {regressed} regressed)",
            )
        )
    findings.extend(_detectable_finding(n, policy.min_detectable_regressed_share, confidence))
    for s in sliced:
        if s.significant:
            findings.append(
                (
                    "hold back",
                    f"slice {policy.slice_by or 'label'}={s.label} worse: mean change {s.worse_by:+.4f}{unit} toward "
                    f"worse over n = {s.n}, one-sided p = {s.p_value:.2g} (Holm-adjusted {s.adjusted_p:.2g} <= "
                    f"{1 - confidence:.2g} over {sum(r.p_value is not None for r in sliced)} slices)",
                )
            )
    return tuple(findings)
