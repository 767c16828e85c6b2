"""Each guard's finding exactly as a person reads it and as the gate folds it: its verdict (one of the two a
``GateDecision`` knows), the figure it names, the boundary on which it changes, and the settings that reach it.

The rules themselves are tested on realistic differences in ``test_guards.py``; here each finding is built at the
boundary where a wrong comparison or a dropped argument would change it (the survivors of ``make mutation``:
docs/testing.md)."""

from __future__ import annotations

import math
import typing
import warnings

import numpy as np
import pytest

from nexa_dagster.core.evaluation.benchmarks import BenchmarkComparison
from nexa_dagster.core.evaluation.guards import (
    GuardPolicy,
    SliceResult,
    Verdict,
    detectable_examples,
    guard_report,
    paired_guards,
    regressed_bounds,
    required_examples,
    skew_refuses,
    skewness,
)
from nexa_dagster.core.evaluation.paired import Interval, WinRate
from nexa_dagster.core.evaluation.promotion import (
    ProductionEntry,
    PromotionPolicy,
    decide,
    eval_loss_guard,
    unreliable_judge,
)
from nexa_dagster.core.evaluation.reward_gate import reward_guards

VERDICTS = set(typing.get_args(Verdict))
# only the guard under test: the skew rule, the regressed share and the detectable share switched off as needed
ONLY_SKEW = GuardPolicy(max_regressed_share=None, min_detectable_regressed_share=None, slice_by=None)
ONLY_SHARE = GuardPolicy(skew_rule=False, min_detectable_regressed_share=None, slice_by=None)
ONLY_DETECTABLE = GuardPolicy(skew_rule=False, max_regressed_share=None, slice_by=None)
PRODUCTION = ProductionEntry(checkpoint_id="prod", checkpoint_path="checkpoints/prod", metric="eval_loss")


def _only(report, verdict: str) -> str:
    """The one finding of ``report``, checked to carry ``verdict`` itself (not just to make the report's verdict)."""
    assert len(report.findings) == 1, report.findings
    kind, text = report.findings[0]
    assert kind in VERDICTS and kind == verdict
    return text


@pytest.mark.parametrize("g1", [1.0, 0.5, 1.5, 2.2])
def test_the_skew_finding_names_the_n_cochrans_rule_needs_and_is_insufficient_evidence(g1: float) -> None:
    text = _only(guard_report(5, g1, 0, ONLY_SKEW), "insufficient evidence")  # 5 <= 25 G1^2 for each
    # "n > 25 G1^2 = X": X the bound itself, floor(25 G1^2)
    assert f"(Cochran's rule needs n > 25 G1^2 = {math.floor(25 * g1 * g1)})" in text
    assert f"(G1 = {g1:+.2f})" in text and "n = 5" in text


@pytest.mark.parametrize("g1", [0.5, 0.6, 1.0, 1.5, 2.2])
def test_skew_needs_is_the_smallest_n_cochrans_rule_accepts(g1: float) -> None:
    needs = guard_report(5, g1, 0, ONLY_SKEW).skew_needs
    assert bool(skew_refuses(np.array(g1), needs - 1)) and not bool(skew_refuses(np.array(g1), needs))


@pytest.mark.parametrize("g1", [0.0, -0.5, -2.0])
def test_no_skew_toward_worse_needs_no_n(g1: float) -> None:
    report = guard_report(5, g1, 0, ONLY_SKEW)
    assert report.skew_needs == 0 and report.findings == ()
    assert "toward better: no limit" in report.summary()


def test_a_lower_bound_exactly_at_the_tolerated_share_is_not_proof_of_too_many_regressions() -> None:
    low, _ = regressed_bounds(np.array(20), 50, 0.95)
    at_low = ONLY_SHARE.model_copy(update={"max_regressed_share": float(low)})
    text = _only(guard_report(50, 0.0, 20, at_low), "insufficient evidence")
    assert text.startswith("insufficient evidence on regressions: 20 of 50 examples worse by > 0.5 (40.0%")
    just_below = ONLY_SHARE.model_copy(update={"max_regressed_share": float(np.nextafter(low, 0))})
    _only(guard_report(50, 0.0, 20, just_below), "hold back")


def test_a_high_end_exactly_at_the_tolerated_share_does_not_rule_it_out() -> None:
    _, high = regressed_bounds(np.array(0), 100, 0.95)
    at_high = ONLY_SHARE.model_copy(update={"max_regressed_share": float(high)})
    text = _only(guard_report(100, 0.0, 0, at_high), "insufficient evidence")
    assert "cannot rule out max_regressed_share" in text
    just_above = ONLY_SHARE.model_copy(update={"max_regressed_share": float(np.nextafter(high, 1))})
    assert guard_report(100, 0.0, 0, just_above).findings == ()


def test_the_regressed_share_finding_names_the_n_needed_with_the_regressions_the_sample_holds() -> None:
    text = _only(guard_report(50, 0.0, 3, ONLY_SHARE), "insufficient evidence")
    needed = required_examples(0.10, 0.95, 3)
    assert text.endswith(f"(n >= {needed} needed with 3 regressed)")
    # that n is where 3 regressed examples first pass, and more than with none regressed
    assert (
        regressed_bounds(np.array(3), needed, 0.95)[1]
        < 0.10
        <= regressed_bounds(np.array(3), needed - 1, 0.95)[1]
    )
    assert needed > required_examples(0.10, 0.95, 0)


def test_the_detectable_share_rule_uses_the_gates_confidence() -> None:
    """At 80 % the rule needs (1 - 0.05)^n <= 5 %: n >= 59, not the 86 it needs at 95 %."""
    assert (detectable_examples(0.05, 0.8), detectable_examples(0.05, 0.95)) == (59, 86)
    assert guard_report(70, 0.0, 0, ONLY_DETECTABLE, confidence=0.8).findings == ()
    text = _only(guard_report(50, 0.0, 0, ONLY_DETECTABLE, confidence=0.8), "insufficient evidence")
    assert text.endswith("(n >= 59 needed)") and "> 5.00%" in text
    _only(guard_report(70, 0.0, 0, ONLY_DETECTABLE), "insufficient evidence")


def test_a_report_built_without_a_confidence_or_unit_is_at_95_percent_with_no_unit() -> None:
    report = guard_report(50, 0.0, 3, ONLY_SHARE)
    assert report.confidence == 0.95
    assert "worse by > 0.5 (6.0%, 95% CI [" in _only(report, "insufficient evidence")


def test_the_report_carries_the_detectable_share_it_decided_with() -> None:
    policy = GuardPolicy(min_detectable_regressed_share=0.02)
    report = guard_report(500, 0.0, 0, policy)
    assert report.min_detectable_share == 0.02
    assert report.metadata()["guard_min_detectable_share"] == 0.02
    assert guard_report(500, 0.0, 0, ONLY_SHARE).metadata()["guard_min_detectable_share"] is None


def test_a_slice_finding_names_the_field_or_label_and_the_family_wise_level() -> None:
    worse = SliceResult("2026-11-30", 12, 0.8, 0.0001, 0.0003, True)
    clean = SliceResult("2026-12-01", 40, -0.1, 0.9, 0.9, False)
    unnamed = GuardPolicy(
        skew_rule=False, max_regressed_share=None, min_detectable_regressed_share=None, slice_by=None
    )
    text = _only(guard_report(52, 0.0, 0, unnamed, 0.95, (worse, clean), "nats/token"), "hold back")
    assert text.startswith(
        "slice label=2026-11-30 worse: mean change +0.8000 nats/token toward worse over n = 12"
    )
    assert text.endswith("(Holm-adjusted 0.0003 <= 0.05 over 2 slices)")
    by_day = unnamed.model_copy(update={"slice_by": "day"})
    assert _only(guard_report(52, 0.0, 0, by_day, 0.9, (worse, clean)), "hold back").startswith(
        "slice day=2026-11-30 worse"
    )
    assert "<= 0.1 over 2 slices" in guard_report(52, 0.0, 0, by_day, 0.9, (worse, clean)).reasons[0]


def test_every_finding_of_every_guard_carries_a_verdict_the_gate_knows() -> None:
    rng = np.random.default_rng(0)
    skewed = np.where(rng.random(40) < 0.1, -3.0, 0.05)  # rare large regressions of a reward
    report = paired_guards(skewed, higher_is_better=True, slices=["a"] * 20 + ["b"] * 20)
    kinds = [kind for kind, _ in report.findings]
    assert len(kinds) >= 3 and set(kinds) <= VERDICTS  # skew, regressed share, detectable share at least


def test_a_difference_exactly_at_the_margin_is_not_a_regression() -> None:
    d = np.array([0.5] * 5 + [0.51] * 2 + [-0.2] * 13)
    report = paired_guards(d, higher_is_better=False, policy=ONLY_SHARE)
    assert (report.regressed, report.n) == (2, 20)


def test_skewness_of_many_eval_sets_at_once_is_each_sets_own() -> None:
    rng = np.random.default_rng(1)
    sets, weights = rng.lognormal(size=(4, 4)), rng.integers(1, 50, size=(4, 4)).astype(float)
    together = skewness(sets, weights)
    assert together.shape == (4,)
    assert together == pytest.approx([float(skewness(s, w)) for s, w in zip(sets, weights, strict=True)])
    assert skewness(np.ones((3, 2)), np.ones((3, 2))).shape == (3,)  # too few examples: 0, one per set


def test_skewness_without_spread_is_zero_and_silent() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert float(skewness(np.full(10, 0.3), np.ones(10))) == 0.0


def test_the_eval_loss_and_reward_guards_decide_at_the_gates_confidence() -> None:
    policy = PromotionPolicy(confidence=0.9)
    nll = np.linspace(2.0, 3.0, 40)
    loss = eval_loss_guard(nll - 0.01, nll, np.full(40, 10), policy)
    reward = reward_guards(np.linspace(-0.1, 0.3, 40).tolist(), policy)
    assert loss.confidence == reward.confidence == 0.9
    assert "90% CI" in loss.summary() and "90% CI" in reward.summary()


def _pairwise(inconsistent: int, judged: int = 20) -> WinRate:
    wins = judged - inconsistent
    return WinRate(wins=wins, losses=0, inconsistent=inconsistent, rate=Interval(1.0, 0.8, 1.0, 0.95))


def test_the_judge_is_unreliable_only_above_the_flipped_share_and_only_for_a_win_rate_gate() -> None:
    gate = PromotionPolicy(metric="win_rate")
    assert unreliable_judge(gate, None) is None
    assert unreliable_judge(gate, _pairwise(8)) is None  # 8 of 20 = 0.4: at max_inconsistent_share, allowed
    assert unreliable_judge(gate, _pairwise(9)).startswith("judge unreliable: 9 of 20 judged prompts (45%)")
    assert unreliable_judge(PromotionPolicy(), _pairwise(15)) is None  # a loss gate does not read the judge


def test_too_few_benchmark_samples_name_the_setting_that_asks_for_more() -> None:
    few = BenchmarkComparison("arc/acc", 0.62, 0.55, 0.07, 0.03, 0.11, 0.95, True, 10)
    decision = decide(
        "cand", PRODUCTION, PromotionPolicy(metric="benchmark:arc/acc", margin=0.01), benchmark=few
    )
    assert decision.outcome == "insufficient evidence"
    assert decision.reason.startswith(
        "insufficient evidence: n = 10 < 30 (benchmark samples, min_benchmark_samples); arc/acc"
    )
