"""The eval-set loss gate's own rule, on given intervals: the interval's high end (or, where a lab asks for it, the
point estimate) must be below minus the margin, strictly; the rule and the reason say which, and a production
model that could not be scored is nothing to compare with."""

from __future__ import annotations

from nexa_dagster.core.evaluation.paired import Interval, PairedLoss
from nexa_dagster.core.evaluation.promotion import ProductionEntry, PromotionPolicy, decide

PRODUCTION = ProductionEntry(checkpoint_id="prod", checkpoint_path="checkpoints/prod", metric="eval_loss")


def _loss(estimate: float, low: float, high: float) -> PairedLoss:
    return PairedLoss(3.0 + estimate, 3.0, Interval(estimate, low, high, 0.95), examples=107, tokens=4000)


def test_the_interval_must_clear_the_margin_not_just_no_difference() -> None:
    policy = PromotionPolicy(margin=0.05)
    held = decide("cand", PRODUCTION, policy, _loss(-0.06, -0.09, -0.03))
    assert not held.passed and held.rule == "interval high < -0.05"
    assert held.reason.endswith("[-0.0900, -0.0300] over n = 107 examples; the interval is not below -0.05")
    passed = decide("cand", PRODUCTION, policy, _loss(-0.10, -0.13, -0.07))
    assert passed.passed and passed.outcome == "promote" and " is below -0.05" in passed.reason
    # both models' losses and the difference go with the decision (the report and the UI show them)
    assert (passed.candidate, passed.production, passed.difference) == (2.9, 3.0, -0.10)
    assert passed.interval == (-0.13, -0.07) and passed.n == 107


def test_an_interval_ending_exactly_at_the_margin_does_not_clear_it() -> None:
    policy = PromotionPolicy(margin=0.05)
    assert not decide("cand", PRODUCTION, policy, _loss(-0.08, -0.11, -0.05)).passed


def test_a_lab_that_drops_the_interval_requirement_decides_on_the_estimate_and_is_told_so() -> None:
    policy = PromotionPolicy(require_interval=False)
    decision = decide("cand", PRODUCTION, policy, _loss(-0.04, -0.09, 0.01))
    assert decision.passed and decision.rule == "difference < -0.0"
    assert decision.reason.endswith("is below -0.0")
    strict = decide("cand", PRODUCTION, PromotionPolicy(), _loss(-0.04, -0.09, 0.01))
    assert not strict.passed and strict.rule == "interval high < -0.0"


def test_a_production_model_that_could_not_be_scored_is_nothing_to_compare_with() -> None:
    decision = decide("cand", PRODUCTION, PromotionPolicy(), None)
    assert decision.passed is False and decision.outcome == "hold back"
    assert (
        "production prod was not scored on the same eval set (its checkpoint is not readable here): "
        "nothing to compare with" in decision.reason
    )
