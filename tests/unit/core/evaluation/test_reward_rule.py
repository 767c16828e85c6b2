"""The RL reward gate's own rule on given figures: the interval's low end strictly above the margin, the reason
stating n and how many prompts got better, worse and equal, and too few prompts named with the setting."""

from __future__ import annotations

import numpy as np

from nexa_dagster.core.evaluation.paired import Interval, PairedLoss
from nexa_dagster.core.evaluation.promotion import Evidence, ProductionEntry, PromotionPolicy
from nexa_dagster.core.evaluation.reward_gate import (
    decide_reward,
    mean_difference_interval,
    reward_decision,
    reward_guard_policy,
)

# the candidate's eval-set loss, measured and unchanged: its non-inferiority guard holds
UNCHANGED = PairedLoss(3.0, 3.0, Interval(0.0, -0.01, 0.01, 0.95), examples=125, tokens=4000)
POLICY = PromotionPolicy()


def _decide(low: float, counts: tuple[int, int, int] = (125, 30, 10)):
    d = Interval(low + 0.03, low, low + 0.06, 0.95)
    return reward_decision(POLICY, d, counts, Evidence(paired_loss=UNCHANGED, **POLICY.rl.limits()))


def test_a_reward_gain_whose_interval_clears_the_margin_is_promoted_with_its_counts_stated() -> None:
    margin = POLICY.rl.margin
    decision = _decide(margin + 0.02)
    assert decision.passed and decision.outcome == "promote"
    assert decision.reason.startswith(
        f"mean held-out reward difference {margin + 0.05:+.4f}, 95% interval [{margin + 0.02:+.4f}, "
        f"{margin + 0.08:+.4f}] over n = 125 prompts (30 better, 10 worse, 85 equal); the interval is above {margin}"
    )


def test_an_interval_starting_exactly_at_the_margin_does_not_clear_it() -> None:
    decision = _decide(POLICY.rl.margin)
    assert decision.passed is False
    assert f"the interval is not above {POLICY.rl.margin}" in decision.reason


def test_too_few_prompts_are_insufficient_evidence_naming_the_setting() -> None:
    few = POLICY.rl.min_prompts - 1
    decision = _decide(POLICY.rl.margin + 0.02, (few, 5, 1))
    assert decision.outcome == "insufficient evidence"
    assert f"n = {few} < {POLICY.rl.min_prompts} (held-out prompts, rl.min_prompts)" in decision.reason


def test_the_reward_guards_measure_regressions_against_the_rl_margin_not_the_loss_gates() -> None:
    policy = PromotionPolicy.model_validate(
        {"guards": {"regression_margin": 0.1}, "rl": {"regression_margin": 0.5}}
    )
    guards = reward_guard_policy(policy)
    assert guards.regression_margin == 0.5
    assert guards.model_dump(exclude={"regression_margin"}) == policy.guards.model_dump(
        exclude={"regression_margin"}
    )


def test_a_bootstrap_reward_interval_uses_the_policys_resamples() -> None:
    """``interval_method: bootstrap`` with the lab's ``bootstrap_resamples`` (seeded): the gate's interval is the one
    those resamples give, not the default count's."""
    rng = np.random.default_rng(7)
    differences = list(
        rng.choice([-1.0, 0.0, 0.0, 0.0, 1.0, 1.0], size=125)
    )  # skewed, ties: a reward's shape
    policy = PromotionPolicy(interval_method="bootstrap", bootstrap_resamples=300)
    production = ProductionEntry(checkpoint_id="prod", checkpoint_path="checkpoints/prod", metric="eval_loss")
    decision = decide_reward("rl-1", production, policy, differences, UNCHANGED)
    ours = mean_difference_interval(differences, 0.95, "bootstrap", 300)
    default = mean_difference_interval(differences, 0.95, "bootstrap")
    assert (ours.low, ours.high) != (default.low, default.high)  # else this test could not tell them apart
    assert decision.interval == (ours.low, ours.high)
