"""Which checkpoint is in production, the rule that decides a promotion, and rollback.

The production pointer is a small JSON file (``<data_root>/serving/production.json``) holding the current
production checkpoint and the history of earlier ones, written atomically; the MLflow registry alias
``production`` is moved alongside it by the Dagster layer. Rolling back pops the history.

The pointer names each checkpoint by its place in the data root (``checkpoints/ckpt-1``), so a data root that is
moved, copied or restored keeps its production model; a pointer written before (absolute paths) is read under the
root as it is now (``core.common.roots``). Entries handed out carry the checkpoint's path as it is now.

Besides the mean, every gate looks at the examples that got worse through ONE generic function over per-example
paired differences, ``core.evaluation.guards.paired_guards`` (skewness by Cochran's rule, the regressed share
against ``guards.max_regressed_share``, slices with Holm's correction). Every gate (``decide``,
``decide_preference``, ``reward_gate.decide_reward``) ends in ONE function, ``conclude``, with what it measured and
its ``Evidence``: the contamination refusal, the evidence minimum, that ``GuardReport`` (``apply_guards``), the
non-inferiority guards (``non_regression_findings``: eval-set loss, benchmarks, length control) and the lab's waiver
of too little evidence, which never promotes a candidate the evidence shows worse. The adapters here build the
report for the two gates of this module: ``eval_loss_guard`` (per-example loss differences, token-weighted) and
``judge_score_guard`` (the pointwise judge's per-prompt scores); a reward gate's is ``reward_gate.reward_guards``.
A later attempt on the same eval set against the same production model decides at a stricter confidence
(``PromotionPolicy.for_attempt``, ``core.evaluation.attempts``).
"""

from __future__ import annotations

import datetime as dt
import math
import posixpath
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from nexa_dagster.core.common import roots, storage
from nexa_dagster.core.common.config import load_validated
from nexa_dagster.core.evaluation.attempts import Attempt, attempt_confidence
from nexa_dagster.core.evaluation.benchmarks import BENCHMARK_METRIC_PREFIX, BenchmarkComparison, parse_metric
from nexa_dagster.core.evaluation.guards import GuardPolicy, GuardReport, Verdict, paired_guards
from nexa_dagster.core.evaluation.paired import INTERVAL_METHODS, LengthControlled, PairedLoss, WinRate


class PreferenceGate(BaseModel):
    """``preference`` of promotion.yaml: a preference checkpoint is promoted on the judge's win rate against
    production; eval-set loss and the benchmarks only guard against a regression."""

    model_config = ConfigDict(extra="forbid")

    margin: float = Field(default=0.0, ge=0, description="the win rate's interval must clear 0.5 + margin")
    judge_mode: Literal["pointwise", "pairwise"] = Field(
        default="pointwise",
        description="how the judge's win rate is measured: pointwise (each answer scored alone with the judge's "
        "1-5 score prompt, the higher score wins; no answer order to be biased by) or pairwise (both answers "
        "shown, in both orders; only verdicts that survive the swap count)",
    )
    tie_epsilon: float = Field(
        default=0.0,
        ge=0,
        description="pointwise: scores that differ by this much or less are a tie (counted apart, not in n)",
    )
    max_inconsistent_share: float = Field(
        default=0.4,
        ge=0,
        le=1,
        description="pairwise: above this share of the judged prompts whose verdict flips when the answers swap "
        "places, the judge is unreliable and the candidate is held back, naming it",
    )
    max_eval_loss_regression: float = Field(
        default=0.05,
        ge=0,
        description="non-inferiority margin: held back unless the eval-set loss's interval shows it worse by no "
        "more than this (nats per token; the interval's high end within it)",
    )
    max_benchmark_regression: float = Field(
        default=0.05,
        ge=0,
        description="non-inferiority margin: held back unless each benchmark's interval shows it lower by no "
        "more than this (the interval's low end within it)",
    )
    score_regression_margin: float = Field(
        default=1.0,
        ge=0,
        description="pointwise: a prompt whose answer the judge scored more than this lower than production's is "
        "regressed (the guards' regression_margin for the win rate, in judge points on the 1-5 scale)",
    )
    min_length_controlled_win_rate: float | None = Field(
        default=0.5,
        ge=0,
        le=1,
        description="held back when the length-controlled win rate (the judge's verdicts with the answers' "
        "length difference regressed out) is not above this: a win that comes from longer answers alone is no "
        "win; null turns the guard off",
    )

    def limits(self) -> dict[str, float | None]:
        """The non-inferiority guards' margins (``Evidence``'s limits)."""
        return {
            "loss_limit": self.max_eval_loss_regression,
            "benchmark_limit": self.max_benchmark_regression,
            "length_limit": self.min_length_controlled_win_rate,
        }


class RewardGate(BaseModel):
    """``rl`` of promotion.yaml: an RL checkpoint is promoted on the paired per-prompt reward difference (candidate -
    production, greedy answers to the frozen held-out RL prompts, the same reward) with the policy's interval
    (``core.evaluation.reward_gate``); the eval-set loss only guards."""

    model_config = ConfigDict(extra="forbid")

    margin: float = Field(default=0.0, ge=0, description="required mean reward gain per prompt")
    min_prompts: int = Field(default=30, ge=2, description="fewer held-out prompts decide nothing")
    max_eval_loss_regression: float = Field(
        default=0.05,
        ge=0,
        description="non-inferiority margin: held back unless the eval-set loss's interval shows it worse by no "
        "more than this (nats per token; the interval's high end within it); not measured: insufficient evidence",
    )
    max_benchmark_regression: float = Field(
        default=0.05,
        ge=0,
        description="non-inferiority margin of each benchmark both models were scored on, as preference's",
    )
    min_length_controlled_win_rate: float | None = Field(
        default=0.5,
        ge=0,
        le=1,
        description="held back when the prompts' reward verdicts (candidate's reward higher, lower) with the "
        "answers' length difference regressed out win at most this often: a reward gained by longer answers "
        "alone is no gain (as preference's judge win rate); null turns the guard off",
    )
    regression_margin: float = Field(
        default=0.5,
        gt=0,
        description="a held-out prompt whose reward fell by more than this counts as regressed (the guards' "
        "regressed share): with the 0/1 exact-answer reward, a prompt that went from right to wrong; with a "
        "similarity reward in [0, 1], one that lost half of it",
    )

    def limits(self) -> dict[str, float | None]:
        """The non-inferiority guards' margins (``Evidence``'s limits): the same guards as preference's."""
        return {
            "loss_limit": self.max_eval_loss_regression,
            "benchmark_limit": self.max_benchmark_regression,
            "length_limit": self.min_length_controlled_win_rate,
        }


class PromotionPolicy(BaseModel):
    """``configs/promotion.yaml``: what the gate compares, how sure it must be, and how much evidence it needs."""

    model_config = ConfigDict(extra="forbid")  # a misspelt `margin` must not silently promote at margin 0

    metric: str = Field(
        default="eval_loss",
        description="eval_loss: paired per-example loss difference on the frozen eval set "
        "(lower is better); win_rate: the judge's order-consistent preference; "
        "benchmark:<task>/<metric>: an lm-evaluation-harness score "
        "(evaluation.benchmarks of the scale preset)",
    )
    margin: float = Field(
        default=0.0,
        ge=0,
        description="required improvement: nats per token for eval_loss, "
        "win rate above 0.5 for win_rate, the metric's own unit "
        "for a benchmark",
    )
    require_interval: bool = Field(
        default=True,
        description="the whole confidence interval must clear the margin, not just the point estimate",
    )
    confidence: float = Field(default=0.95, gt=0, lt=1)
    interval_method: Literal["skew_t", "t", "bootstrap"] = Field(
        default="skew_t",
        description="eval_loss's interval: skew_t (Hall's skew-corrected t, never narrower than t; holds its "
        "coverage on skewed per-example differences), t (studentized; too narrow on the side of a long tail) or "
        "bootstrap (percentile; too narrow at small n)",
    )
    bootstrap_resamples: int = Field(
        default=2000, ge=100, description="resamples of interval_method: bootstrap"
    )
    min_examples: int = Field(
        default=30, ge=2, description="eval_loss: fewer eval-set examples decide nothing"
    )
    min_consistent_verdicts: int = Field(
        default=20,
        ge=1,
        description="win_rate: fewer usable judge verdicts (order-consistent pairwise, decisive pointwise) decide "
        "nothing",
    )
    min_benchmark_samples: int = Field(
        default=30, ge=1, description="benchmark:<task>/<metric>: fewer harness samples decide nothing"
    )
    on_insufficient_evidence: Literal["hold back", "promote"] = Field(
        default="hold back",
        description="below the minimum evidence: hold the candidate back (decision 'insufficient evidence'), or "
        "promote it with a warning naming the shortfall (only where this file says so)",
    )
    max_contamination: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="the share of eval examples (or benchmark items) whose n-grams occur in the candidate's training "
        "data above which the gate holds it back",
    )
    registered_model: str = "nexa-moe"
    canary: dict[str, Any] | None = Field(
        default=None,
        description="deploy a promoted checkpoint as a canary first (core/serving/canary.py CanaryPolicy's fields: "
        "share, margins, confidence, max_duration_s): it takes the endpoint only once shown non-inferior on live "
        "traffic; none: switch at once",
    )
    guards: GuardPolicy = Field(default_factory=GuardPolicy)
    preference: PreferenceGate = Field(default_factory=PreferenceGate)
    rl: RewardGate = Field(default_factory=RewardGate)

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, metric: str) -> str:
        if metric.startswith(BENCHMARK_METRIC_PREFIX):
            parse_metric(metric)
        elif metric not in ("eval_loss", "win_rate"):
            raise ValueError(
                f"metric must be eval_loss, win_rate or {BENCHMARK_METRIC_PREFIX}<task>/<metric>, "
                f"not {metric!r}"
            )
        return metric

    @property
    def benchmark(self) -> bool:
        return self.metric.startswith(BENCHMARK_METRIC_PREFIX)

    def for_attempt(self, number: int) -> PromotionPolicy:
        """This policy as attempt ``number`` of its family decides (``core.evaluation.attempts``): every interval
        and guard at the confidence whose one-sided error is halved for each earlier attempt."""
        return self.model_copy(update={"confidence": attempt_confidence(self.confidence, number)})

    def for_preference(self) -> PromotionPolicy:
        """This policy as the preference stage's gate: the win rate decides, with the preference margin."""
        return self.model_copy(update={"metric": "win_rate", "margin": self.preference.margin})

    def minimum_evidence(self) -> int:
        """The n the configured metric needs: examples, consistent verdicts or harness samples."""
        if self.metric == "eval_loss":
            return self.min_examples
        if self.metric == "win_rate":
            return self.min_consistent_verdicts
        return self.min_benchmark_samples


def load_policy(name: str = "promotion.yaml") -> PromotionPolicy:
    """``configs/<name>``, checked: an unknown or missing key fails naming the file and the key."""
    return load_validated(PromotionPolicy, name)


class ProductionEntry(BaseModel):
    checkpoint_id: str
    checkpoint_path: str
    metric: str
    value: float | None = None  # its eval_loss on eval_set_version when it was promoted (for reference)
    eval_set_version: int | None = None
    promoted_at: str = Field(default_factory=lambda: dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))
    mlflow_version: str | None = None


class ProductionState(BaseModel):
    current: ProductionEntry | None = None
    history: list[ProductionEntry] = Field(default_factory=list)  # earlier production models, oldest first


Decision = Literal["promote", "hold back", "insufficient evidence"]


@dataclass(frozen=True)
class GateDecision:
    """The gate's verdict and what it rests on: both models' values on the same eval set, the difference
    (candidate - production for eval_loss, the win rate for win_rate, the gain for a benchmark), its interval, the
    n behind it, the interval's method and the rule that decided."""

    passed: bool
    reason: str
    candidate: float | None = None
    production: float | None = None
    difference: float | None = None
    interval: tuple[float, float] | None = None
    decision: Decision | None = None  # None: "promote" when passed, else "hold back"
    n: int | None = None
    method: str = ""
    rule: str = ""
    guards: tuple[str, ...] = ()  # the guards that held it back: non-regression, skew, regressions, slices
    guard: GuardReport | None = None  # what core.evaluation.guards found, whatever it decided
    worse: bool = False  # the whole interval on the worse side of no difference: the waiver never promotes it
    # its place among the decisions on its eval set against its production model (core.evaluation.attempts)
    attempt: Attempt | None = None

    @property
    def outcome(self) -> Decision:
        return self.decision or ("promote" if self.passed else "hold back")

    def metadata(self) -> dict[str, Any]:
        low, high = self.interval if self.interval else (None, None)
        return {
            "decision": self.outcome,
            "reason": self.reason,
            "candidate": self.candidate,
            "production": self.production,
            "difference": self.difference,
            "interval_low": _finite(low),
            "interval_high": _finite(high),
            "n": self.n,
            "method": self.method,
            "rule": self.rule,
            **(self.guard.metadata() if self.guard else {}),
            **(self.attempt.metadata() if self.attempt else {}),
        }


def _finite(value: float | None) -> float | None:
    """JSON and the leaderboard have no infinity: an unbounded interval end is written as null."""
    return value if value is None or math.isfinite(value) else None


def _not_a_comparison(checkpoint_id: str, production: ProductionEntry | None) -> GateDecision | None:
    """The decisions that compare nothing: no production model yet, or this checkpoint is production."""
    if production is None:
        return GateDecision(True, "no production model yet", decision="promote", rule="first model")
    if production.checkpoint_id == checkpoint_id:
        return GateDecision(
            True,
            f"{checkpoint_id} is the production model (re-evaluation)",
            decision="promote",
            rule="already production",
        )
    return None


def decide(
    checkpoint_id: str,
    production: ProductionEntry | None,
    policy: PromotionPolicy,
    paired_loss: PairedLoss | None = None,
    win_rate: WinRate | None = None,
    benchmark: BenchmarkComparison | None = None,
    contamination: float | None = None,
    guard: GuardReport | None = None,
) -> GateDecision:
    """Promote iff there is no production model, or the candidate beats it on the same eval set by the margin
    with enough evidence; with ``require_interval`` the whole confidence interval must clear the margin (a tie,
    or an improvement smaller than the noise of the eval set, is held back). Below the policy's minimum n the
    decision is "insufficient evidence" (held back; promoted with a warning only where the policy says so and
    nothing shows the candidate worse); a candidate whose training data holds more of the eval set than
    ``max_contamination`` is held back, naming it, and so is one judged by a pairwise judge whose verdicts flip
    with the answer order too often (``unreliable_judge``). ``guard`` (``paired_guards`` on the same per-example
    differences) can only hold a candidate back. Every gate ends in ``conclude``: one set of guards."""
    early = _not_a_comparison(checkpoint_id, production)
    if early is not None:
        return early
    assert production is not None
    measured = _measure(checkpoint_id, production, policy, paired_loss, win_rate, benchmark)
    if measured.n is None:  # nothing was compared: the reason says why
        return measured
    evidence = Evidence(contamination=contamination, win_rate=win_rate, guard=guard)
    return conclude(measured, policy, (policy.minimum_evidence(), _evidence_name(policy)), evidence)


@dataclass(frozen=True)
class Evidence:
    """What every gate's guards look at beside the statistic it decides on (``conclude``: one set of guards for the
    eval-loss, judge and reward gates). A limit left None is a guard that gate has no use for (the eval-loss gate
    has no eval-loss guard: the loss is what it decides on); a measurement left None under a limit is a guard that
    could not look, which is "insufficient evidence" for the loss (it is measured whenever production was scored)
    and nothing for a benchmark (a scale runs benchmarks only where it says so) or the length control."""

    contamination: float | None = None  # the share of the eval set its training data holds
    win_rate: WinRate | None = None  # the judge's, for the unreliable-judge refusal
    guard: GuardReport | None = None  # paired_guards on the per-example differences the gate decides on
    paired_loss: PairedLoss | None = None
    loss_limit: float | None = None  # non-inferiority margin of the eval-set loss, nats per token
    benchmarks: tuple[BenchmarkComparison, ...] = ()
    benchmark_limit: float | None = None  # non-inferiority margin of each benchmark, the metric's unit
    length_controlled: LengthControlled | None = None
    length_limit: float | None = None  # the length-controlled win rate must be above this


def non_regression_findings(evidence: Evidence) -> list[tuple[Verdict, str]]:
    """The non-inferiority guards: the eval-set loss and every benchmark must be shown no worse than their margin
    (the interval's worse end within it: the standard non-inferiority test, so a small or noisy eval set cannot
    pass for harmless), and a win with longer answers must survive controlling for the answers' length. Each
    finding with its verdict; none when all hold."""
    found: list[tuple[Verdict, str]] = []
    limit = evidence.loss_limit
    if limit is not None and evidence.paired_loss is None:
        found.append(("insufficient evidence", f"eval_loss not measured: cannot show it worse by <= {limit}"))
    elif (
        limit is not None
        and evidence.paired_loss is not None
        and evidence.paired_loss.difference.high > limit
    ):
        d = evidence.paired_loss.difference
        found.append(
            (
                "hold back",
                f"eval_loss worse by {d.estimate:+.4f} nats/token, interval high {d.high:+.4f} > {limit}",
            )
        )
    limit = evidence.benchmark_limit
    for b in evidence.benchmarks if limit is not None else ():
        if b.low < -limit:
            found.append(
                (
                    "hold back",
                    f"{b.metric} lower by {-b.difference:.4f}, interval low {b.low:+.4f} < -{limit}",
                )
            )
    lc, limit = evidence.length_controlled, evidence.length_limit
    # one-sided, as the guard is meant: a win that longer answers explain; a candidate whose answers got shorter
    # (a right answer is often a short one) is not talking its way to a win, whatever the fit reads at zero
    if limit is not None and lc is not None and lc.win_rate <= limit and lc.mean_length_change > 0:
        found.append(
            (
                "hold back",
                f"length-controlled win rate {lc.win_rate:.3f} <= {limit} (answers longer by "
                f"{lc.mean_length_change:+.0f} characters on average; logistic fit on {lc.verdicts} verdicts)",
            )
        )
    return found


def _guard_names(evidence: Evidence) -> str:
    """The non-inferiority guards a gate runs, as its rule names them ("" when none)."""
    names = [
        f"eval_loss regression <= {evidence.loss_limit}" if evidence.loss_limit is not None else "",
        f"benchmarks regression <= {evidence.benchmark_limit}"
        if evidence.benchmark_limit is not None
        else "",
        f"length-controlled win rate > {evidence.length_limit}" if evidence.length_limit is not None else "",
    ]
    named = ", ".join(n for n in names if n)
    return f"; guards {named}" if named else ""


def conclude(
    measured: GateDecision, policy: PromotionPolicy, need: tuple[int, str], evidence: Evidence
) -> GateDecision:
    """Every gate's decision from its measured comparison (``measured``: the interval against the margin, its n),
    the evidence it needs (``need``: the minimum n and what it counts) and its ``evidence``: refused when
    contaminated or judged by an unreliable judge; "insufficient evidence" below the minimum n; then the guards on
    the examples that got worse and the non-inferiority guards, each of which can only hold a candidate back; and
    last the lab's waiver (``on_insufficient_evidence: promote``), which turns "insufficient evidence" into a
    warned promotion only when nothing shows the candidate worse (``_waived``)."""
    refused = _refused(measured, policy, evidence.contamination, evidence.win_rate)
    if refused is not None:
        return refused
    decision = apply_guards(_short_of_evidence(measured, need), evidence.guard)
    findings = non_regression_findings(evidence)
    decision = _with_findings(replace(decision, rule=decision.rule + _guard_names(evidence)), findings)
    return _waived(decision, measured, policy)


def _short_of_evidence(measured: GateDecision, need: tuple[int, str]) -> GateDecision:
    """Below the minimum n: "insufficient evidence" (held back whatever the interval says); else ``measured``."""
    minimum, what = need
    if measured.n is None or measured.n >= minimum:
        return measured
    return replace(
        measured,
        passed=False,
        decision="insufficient evidence",
        reason=f"insufficient evidence: n = {measured.n} < {minimum} ({what}); {measured.reason}",
        rule=f"n >= {minimum}",
    )


def _with_findings(decision: GateDecision, findings: list[tuple[Verdict, str]]) -> GateDecision:
    """``decision`` held back by the non-inferiority guards' findings, each named: a "hold back" finding makes any
    decision "hold back"; an "insufficient evidence" one turns a promotion into "insufficient evidence"."""
    if not findings:
        return decision
    texts = tuple(text for _, text in findings)
    worst = _worst([decision.outcome, *(kind for kind, _ in findings)])
    return replace(
        decision,
        passed=False,
        decision=worst,
        guards=decision.guards + texts,
        reason=f"non-regression guard: {'; '.join(texts)}; {decision.reason}",
    )


def _worst(outcomes: list[Decision]) -> Decision:
    """The more severe of the outcomes of a decision held back (each caller passes at least one that is not
    "promote"): "hold back" when any is, else "insufficient evidence"."""
    return "hold back" if "hold back" in outcomes else "insufficient evidence"


def _waived(decision: GateDecision, measured: GateDecision, policy: PromotionPolicy) -> GateDecision:
    """The lab's waiver (``on_insufficient_evidence: promote``): "insufficient evidence" becomes a promotion with a
    WARN naming the shortfall, and only that: not when the interval lies wholly on the worse side of no difference
    (``measured.worse``), not when any guard held the candidate back (the decision is then "hold back")."""
    if (
        policy.on_insufficient_evidence != "promote"
        or decision.outcome != "insufficient evidence"
        or measured.worse
    ):
        return decision
    return replace(
        decision,
        passed=True,
        decision="promote",
        reason=f"WARN {decision.reason}; promoted because on_insufficient_evidence: promote (nothing shows it "
        "worse)",
        rule=f"{decision.rule} (waived)",
    )


def _refused(
    measured: GateDecision, policy: PromotionPolicy, contamination: float | None, win_rate: WinRate | None
) -> GateDecision | None:
    """Held back whatever the figures say: training data holding too much of the eval set, or a pairwise judge
    whose verdicts flip with the answer order too often; None when neither."""
    if contamination is not None and contamination > policy.max_contamination:
        return replace(
            measured,
            passed=False,
            decision="hold back",
            reason=f"contaminated: {contamination:.1%} of the eval set occurs in its training data "
            f"(max_contamination {policy.max_contamination:.1%}); {measured.reason}",
            rule=f"contamination <= {policy.max_contamination}",
        )
    unreliable = unreliable_judge(policy, win_rate)
    if unreliable:
        return replace(
            measured,
            passed=False,
            decision="hold back",
            reason=f"{unreliable}; {measured.reason}",
            rule=f"flipped share <= {policy.preference.max_inconsistent_share}",
        )
    return None


def apply_guards(decision: GateDecision, guard: GuardReport | None) -> GateDecision:
    """``decision`` with what the guards found: a candidate the mean would promote is held back ("hold back", or
    "insufficient evidence" when a guard only says the sample cannot tell), each reason named; one already held
    back names the guards' findings too, and a guard's "hold back" makes its "insufficient evidence" a "hold back"
    (the lab's waiver must not promote what a guard found worse). The figures go with it either way."""
    if guard is None:  # (a comparison of nothing, no production yet, never reaches the guards: conclude)
        return decision
    if guard.verdict is None:
        return replace(decision, guard=guard, reason=f"{decision.reason}; guards pass: {guard.summary()}")
    findings = "; ".join(guard.reasons)
    if not decision.passed:
        return replace(
            decision,
            guard=guard,
            decision=_worst([decision.outcome, guard.verdict]),
            guards=decision.guards + tuple(guard.reasons),
            reason=f"{decision.reason}; guards: {findings}",
        )
    return replace(
        decision,
        guard=guard,
        passed=False,
        decision=guard.verdict,
        guards=decision.guards + tuple(guard.reasons),
        reason=f"{findings}; {decision.reason}",
        rule=f"{decision.rule}; guards",
    )


def eval_loss_guard(
    candidate_nll: Any, production_nll: Any, tokens: Any, policy: PromotionPolicy, slices: Any = None
) -> GuardReport:
    """``paired_guards`` on the eval set's per-example loss differences (nats per token, weighted by the
    example's tokens: the gate's token-weighted mean), with the eval set's ``slices`` (one label an example)."""
    t = np.asarray(tokens, dtype=np.float64)
    d = (np.asarray(candidate_nll, dtype=np.float64) - np.asarray(production_nll, dtype=np.float64)) / t
    return paired_guards(
        d,
        higher_is_better=False,
        policy=policy.guards,
        weights=t,
        slices=slices,
        confidence=policy.confidence,
        unit="nats/token",
    )


def judge_score_guard(
    candidate_scores: Any, production_scores: Any, policy: PromotionPolicy, slices: Any = None
) -> GuardReport | None:
    """``paired_guards`` on the pointwise judge's per-prompt score differences (judge points; a prompt either
    answer of which has no score is left out, with its slice label): the win rate's trap is a rate near 0.5 built
    from a few large losses and many small wins. None with fewer than two scored prompts."""
    keep = [
        i
        for i, (c, p) in enumerate(zip(candidate_scores, production_scores, strict=True))
        if c is not None and p is not None and math.isfinite(c) and math.isfinite(p)
    ]
    if len(keep) < 2:
        return None
    guards = policy.guards.model_copy(update={"regression_margin": policy.preference.score_regression_margin})
    return paired_guards(
        [candidate_scores[i] - production_scores[i] for i in keep],
        higher_is_better=True,
        policy=guards,
        slices=[slices[i] for i in keep] if slices is not None else None,
        confidence=policy.confidence,
        unit="judge points",
    )


def decide_preference(
    checkpoint_id: str,
    production: ProductionEntry | None,
    policy: PromotionPolicy,
    paired_loss: PairedLoss | None,
    win_rate: WinRate | None,
    benchmarks: list[BenchmarkComparison],
    contamination: float | None = None,
    length_controlled: LengthControlled | None = None,
    guard: GuardReport | None = None,
) -> GateDecision:
    """A preference checkpoint's gate: the judge's order-consistent win rate against production decides (its
    interval must clear 0.5 + the preference margin, on enough verdicts); the non-inferiority guards
    (``non_regression_findings``: the eval-set loss and every benchmark shown no worse than ``max_*_regression``,
    the win surviving the length control) and the guards on the judge's per-prompt scores (``judge_score_guard``)
    can each hold it back, naming the guard."""
    early = _not_a_comparison(checkpoint_id, production)
    if early is not None:
        return early
    assert production is not None
    gate = policy.for_preference()
    measured = _measure(checkpoint_id, production, gate, paired_loss, win_rate, None)
    if measured.n is None:
        return measured
    evidence = Evidence(
        contamination,
        win_rate,
        guard,
        **policy.preference.limits(),
        paired_loss=paired_loss,
        benchmarks=tuple(benchmarks),
        length_controlled=length_controlled,
    )
    return conclude(measured, gate, (gate.minimum_evidence(), _evidence_name(gate)), evidence)


def unreliable_judge(policy: PromotionPolicy, win_rate: WinRate | None) -> str | None:
    """Why the judge's verdicts cannot be evidence, or None: in pairwise mode, more of the judged prompts flipped
    their verdict when the answers swapped places than ``max_inconsistent_share`` allows (a judge that follows the
    position, not the answer). Unreadable replies are not flips: too many of them leave too few verdicts instead."""
    if policy.metric != "win_rate" or win_rate is None or win_rate.mode != "pairwise" or not win_rate.judged:
        return None
    share, limit = win_rate.inconsistent / win_rate.judged, policy.preference.max_inconsistent_share
    if share <= limit:
        return None
    return (
        f"judge unreliable: {win_rate.inconsistent} of {win_rate.judged} judged prompts ({share:.0%}) flipped their "
        f"verdict when the answers swapped places (order consistency {win_rate.order_consistency:.0%}; "
        f"max_inconsistent_share {limit:.0%}); {win_rate.unreadable} unreadable"
    )


def _evidence_name(policy: PromotionPolicy) -> str:
    if policy.metric == "eval_loss":
        return "eval-set examples, min_examples"
    if policy.metric == "win_rate":
        return "usable judge verdicts, min_consistent_verdicts"
    return "benchmark samples, min_benchmark_samples"


def _measure(
    checkpoint_id: str,
    production: ProductionEntry,
    policy: PromotionPolicy,
    paired_loss: PairedLoss | None,
    win_rate: WinRate | None,
    benchmark: BenchmarkComparison | None,
) -> GateDecision:
    """The configured metric's comparison against the margin, with its n (None when nothing was compared)."""
    if policy.benchmark:
        return _benchmark_decision(checkpoint_id, production, policy, benchmark)
    if policy.metric == "eval_loss":
        return _loss_decision(production, policy, paired_loss)
    return _win_rate_decision(checkpoint_id, production, policy, win_rate)


def _need_and_level(policy: PromotionPolicy) -> tuple[str, str]:
    """What the rule compares (the interval's bound or the point estimate) and the interval's level, as words."""
    return ("interval" if policy.require_interval else "point estimate"), f"{policy.confidence:.0%}"


def _benchmark_decision(
    checkpoint_id: str,
    production: ProductionEntry,
    policy: PromotionPolicy,
    benchmark: BenchmarkComparison | None,
) -> GateDecision:
    """A benchmark metric (higher or lower is better, the harness's standard errors) against the margin."""
    need, level = _need_and_level(policy)
    if benchmark is None:
        return GateDecision(
            False,
            f"{policy.metric} was not measured on both {checkpoint_id} and production "
            f"{production.checkpoint_id}: nothing to compare with",
        )
    b = benchmark
    worst = b.low if policy.require_interval else b.difference  # better is positive
    passed = worst > policy.margin
    rule = f"{'interval low' if policy.require_interval else 'gain'} > {policy.margin}"
    reason = (
        f"{b.metric} {b.candidate:.4f} vs production {production.checkpoint_id} {b.production:.4f}: "
        f"{'gain' if b.higher_is_better else 'reduction'} {b.difference:+.4f}, {level} interval "
        f"[{b.low:+.4f}, {b.high:+.4f}] (the harness's standard errors, n = {b.samples}); the {need} "
        f"{'is' if passed else 'is not'} above {policy.margin}"
    )
    return GateDecision(
        passed,
        reason,
        b.candidate,
        b.production,
        b.difference,
        (b.low, b.high),
        n=b.samples,
        method="normal interval from the harness's standard errors",
        rule=rule,
        worse=b.high < 0,
    )


def _loss_decision(
    production: ProductionEntry, policy: PromotionPolicy, paired_loss: PairedLoss | None
) -> GateDecision:
    """The paired eval-set loss difference (candidate - production, negative is better) against the margin."""
    need, level = _need_and_level(policy)
    if paired_loss is None:
        return GateDecision(
            False,
            f"production {production.checkpoint_id} was not scored on the same eval set "
            "(its checkpoint is not readable here): nothing to compare with",
        )
    d = paired_loss.difference
    worst = d.high if policy.require_interval else d.estimate  # candidate - production: negative is better
    passed = worst < -policy.margin
    rule = f"{'interval high' if policy.require_interval else 'difference'} < -{policy.margin}"
    reason = (
        f"eval_loss {paired_loss.candidate:.4f} vs production {production.checkpoint_id} "
        f"{paired_loss.production:.4f}: difference {d.estimate:+.4f}, {level} {paired_loss.method}-interval "
        f"[{d.low:+.4f}, {d.high:+.4f}] over n = {paired_loss.examples} examples; the {need} "
        f"{'is' if passed else 'is not'} below -{policy.margin}"
    )
    return GateDecision(
        passed,
        reason,
        paired_loss.candidate,
        paired_loss.production,
        d.estimate,
        (d.low, d.high),
        n=paired_loss.examples,
        method=INTERVAL_METHODS[paired_loss.method],
        rule=rule,
        worse=d.low > 0,
    )


def _win_rate_decision(
    checkpoint_id: str, production: ProductionEntry, policy: PromotionPolicy, win_rate: WinRate | None
) -> GateDecision:
    """The judge's win rate over production (Wilson interval) against 0.5 + the margin."""
    need, level = _need_and_level(policy)
    if win_rate is None:
        return GateDecision(
            False,
            f"the judge did not compare {checkpoint_id} with production "
            f"{production.checkpoint_id}: nothing to compare with",
        )
    r = win_rate.rate
    worst = r.low if policy.require_interval else r.estimate
    passed = worst > 0.5 + policy.margin
    rule = f"{'interval low' if policy.require_interval else 'win rate'} > {0.5 + policy.margin}"
    w = win_rate
    apart = (
        f"{w.inconsistent} flipped with the answer order, order consistency "
        + (f"{w.order_consistency:.0%}" if w.order_consistency is not None else "n/a")
        if w.mode == "pairwise"
        else f"{w.ties} ties"
    )
    usable = "order-consistent" if w.mode == "pairwise" else "decisive pointwise"
    reason = (
        f"{w.mode} judge: win_rate {r.estimate:.3f} over production {production.checkpoint_id} ({w.wins} wins, "
        f"{w.losses} losses; {apart}; {w.unreadable} unreadable; headline {w.headline:.3f} with those as ties), "
        f"{level} Wilson interval [{r.low:.3f}, {r.high:.3f}] over n = {w.consistent} {usable} verdicts of "
        f"{w.prompts} prompts; the {need} {'is' if passed else 'is not'} above {0.5 + policy.margin}"
    )
    return GateDecision(
        passed,
        reason,
        r.estimate,
        1 - r.estimate,
        r.estimate - 0.5,
        (r.low, r.high),
        n=w.consistent,
        method=w.method,
        rule=rule,
        worse=r.high < 0.5,
    )


NO_BASE_MODEL_YET = (
    "trained from scratch: no base model yet (init_from: {asked}, but neither a production nor a base model "
    "existed when it trained); pretrain one with pretraining_job, then train again"
)


def trained_from_scratch_without_base(report: Any) -> str | None:
    """Why a checkpoint is not served when its training asked for the base or the production model (``init_from:
    base`` or ``production``, the presets' defaults) and fell back to random weights because neither existed (a
    fresh instance's first training): a few steps from scratch teach the student nothing (its answer is empty), so
    serving it would fail its smoke test. None for anything else, a training asked to start from scratch included."""
    asked = getattr(report, "init_requested", None)
    if getattr(report, "parent", None) == "scratch" and asked in ("base", "production"):
        return NO_BASE_MODEL_YET.format(asked=asked)
    return None


def held_back_because(checkpoint_id: str, report: Any, production: ProductionEntry | None) -> str | None:
    """Why serving must not deploy a checkpoint whose evaluation ``report`` (an ``EvalReport``) recorded the gate's
    decision, or None to deploy. The decision holds only against the production model it was made against: when
    production has changed since, the checkpoint is evaluated again, not deployed on an old comparison."""
    if report.gate_decision is None:
        return "its evaluation predates the paired promotion gate; evaluate it again"
    scratch = trained_from_scratch_without_base(report)
    if scratch:
        return scratch
    if report.gate_decision != "promote":
        return f"the promotion gate held it back ({report.gate_reason or report.gate_decision})"
    if production is not None and production.checkpoint_id not in (
        checkpoint_id,
        report.production_checkpoint_id,
    ):
        return (
            f"production is now {production.checkpoint_id}, not {report.production_checkpoint_id or 'none'} as "
            "when it was evaluated; evaluate it again to compare it with the current production model"
        )
    return None


class ProductionRegistry:
    """The pointer at ``path``; ``data_root`` (default: the pointer's grandparent, as in
    ``<data_root>/serving/production.json``) is what its checkpoint paths are relative to."""

    def __init__(self, path: str | Path, data_root: str | Path | None = None) -> None:
        self.path = str(path)
        self.data_root = (
            str(data_root) if data_root is not None else posixpath.dirname(posixpath.dirname(self.path))
        )

    def _here(self, entry: ProductionEntry) -> ProductionEntry:
        return entry.model_copy(
            update={"checkpoint_path": roots.resolve_under(entry.checkpoint_path, self.data_root)}
        )

    def _stored(self, entry: ProductionEntry) -> dict[str, Any]:
        return {
            **entry.model_dump(),
            "checkpoint_path": roots.relative_to(entry.checkpoint_path, self.data_root),
        }

    def state(self) -> ProductionState:
        """The pointer with every checkpoint path where it is now (under the data root as it is now)."""
        if not storage.exists(self.path):
            return ProductionState()
        state = ProductionState.model_validate(storage.read_json(self.path))
        return ProductionState(
            current=self._here(state.current) if state.current else None,
            history=[self._here(h) for h in state.history],
        )

    def current(self) -> ProductionEntry | None:
        return self.state().current

    def _write(self, state: ProductionState) -> None:
        storage.write_json(
            {
                "current": self._stored(state.current) if state.current else None,
                "history": [self._stored(h) for h in state.history],
            },
            self.path,
        )

    def promote(self, entry: ProductionEntry) -> ProductionState:
        state = self.state()
        if state.current is not None and state.current.checkpoint_id != entry.checkpoint_id:
            state.history.append(state.current)
        state.current = entry
        self._write(state)
        return state

    def rollback(self) -> ProductionState:
        """Make the previous production model current again."""
        state = self.state()
        if not state.history:
            raise RuntimeError(f"nothing to roll back to: {self.path} has no earlier production model")
        state.current = state.history.pop()
        self._write(state)
        return state
