"""Every gate runs one set of guards (``promotion.conclude``), the non-inferiority guards are the standard test (the
interval's worse end within the margin), and the lab's waiver of too little evidence never promotes a candidate the
evidence shows worse (issue 47, points 1-3)."""

from __future__ import annotations

import numpy as np
import pytest

from nexa_dagster.core.evaluation.benchmarks import BenchmarkComparison
from nexa_dagster.core.evaluation.paired import (
    Interval,
    LengthControlled,
    PairedLoss,
    order_consistent_win_rate,
    paired_loss_difference,
)
from nexa_dagster.core.evaluation.promotion import ProductionEntry, PromotionPolicy, decide, decide_preference
from nexa_dagster.core.evaluation.reward_gate import decide_reward, reward_length_control

PRODUCTION = ProductionEntry(checkpoint_id="prod", checkpoint_path="checkpoints/prod", metric="eval_loss")
WAIVING = PromotionPolicy(on_insufficient_evidence="promote")
# the eval-set loss of a candidate that left the language model as it was: measured, well within 0.05
UNCHANGED = PairedLoss(3.0, 3.0, Interval(0.0, -0.01, 0.01, 0.95), examples=107, tokens=4000)
# make run's DPO candidate on the AMD EPYC machine: +0.043 [+0.033, +0.053] nats/token against a 0.05 margin
DEMO_DPO_LOSS = PairedLoss(3.573, 3.530, Interval(0.043, 0.033, 0.053, 0.95), examples=107, tokens=4000)


def _better_rewards(n: int = 100, seed: int = 1) -> np.ndarray:
    """Per-prompt exact-match reward differences of a candidate that learned the task (never worse on a prompt)."""
    rng = np.random.default_rng(seed)
    return (rng.uniform(0, 1, size=n) < 0.5).astype(float)


def _win_rate(wins: int, losses: int):
    verdicts = ["candidate"] * wins + ["production"] * losses
    return order_consistent_win_rate(verdicts, verdicts)


# --- 1. the waiver turns "insufficient evidence" into a warned promotion only when nothing shows it worse ---


def test_the_waiver_holds_back_twenty_reward_differences_around_minus_one() -> None:
    """Issue 47's case: 20 held-out prompts (< rl.min_prompts 30), every one about a whole reward worse
    (interval about [-1.06, -0.98]): with ``on_insufficient_evidence: promote`` the gate promoted it."""
    worse = -1.0 + np.random.default_rng(47).normal(0, 0.08, size=20)
    decision = decide_reward("rl-1", PRODUCTION, WAIVING, worse, UNCHANGED)
    assert decision.interval is not None and decision.interval[1] < 0
    assert not decision.passed and decision.outcome == "insufficient evidence", decision.reason
    assert "WARN" not in decision.reason and "n = 20 < 30" in decision.reason
    # the waiver itself still works where nothing shows the candidate worse: warned, named
    better = decide_reward("rl-1", PRODUCTION, WAIVING, _better_rewards(20), UNCHANGED)
    assert better.passed and better.reason.startswith("WARN insufficient evidence: n = 20 < 30")
    assert better.rule.endswith("(waived)")


def test_the_waiver_holds_back_an_eval_loss_candidate_worse_on_every_example() -> None:
    rng = np.random.default_rng(3)
    tokens = rng.integers(20, 60, size=5).astype(float)
    production = rng.uniform(3.0, 5.0, size=5) * tokens
    worse = paired_loss_difference(production + (0.5 + rng.normal(0, 0.01, 5)) * tokens, production, tokens)
    decision = decide("cand", PRODUCTION, WAIVING, worse)
    assert worse.difference.low > 0 and not decision.passed
    assert decision.outcome == "insufficient evidence" and decision.rule == "n >= 30", decision.reason


def test_the_waiver_leaves_every_guard_in_force() -> None:
    """A short sample the waiver would promote is still held back by a guard: the eval-set loss shown worse beyond
    its margin, a contaminated training set (the waiver promoted both before the guards ran)."""
    short = _better_rewards(20)
    worse_loss = PairedLoss(3.4, 3.0, Interval(0.4, 0.3, 0.5, 0.95), examples=107, tokens=4000)
    held = decide_reward("rl-1", PRODUCTION, WAIVING, short, worse_loss)
    assert held.outcome == "hold back" and "eval_loss worse by +0.4000" in held.reason
    dirty = decide_reward("rl-1", PRODUCTION, WAIVING, short, UNCHANGED, contamination=0.2)
    assert dirty.outcome == "hold back" and dirty.reason.startswith("contaminated: 20.0%")


# --- 2. the reward gate (RL, a reward-ranked DPO checkpoint) runs every guard the other gates run ---


def test_the_reward_gate_holds_back_a_contaminated_candidate() -> None:
    clean = decide_reward(
        "rl-1", PRODUCTION, PromotionPolicy(), _better_rewards(), UNCHANGED, contamination=0.0
    )
    assert clean.passed, clean.reason
    dirty = decide_reward(
        "rl-1", PRODUCTION, PromotionPolicy(), _better_rewards(), UNCHANGED, contamination=0.05
    )
    assert dirty.outcome == "hold back" and dirty.rule == "contamination <= 0.0"


def test_the_reward_gate_holds_back_a_candidate_not_shown_within_a_benchmark_margin() -> None:
    policy = PromotionPolicy()
    broken = BenchmarkComparison("stdlib/acc", 0.30, 0.50, -0.20, -0.30, -0.10, 0.95, True, 400)
    held = decide_reward("rl-1", PRODUCTION, policy, _better_rewards(), UNCHANGED, benchmarks=[broken])
    assert (
        held.outcome == "hold back"
        and "stdlib/acc lower by 0.2000, interval low -0.3000 < -0.05" in held.reason
    )
    level = BenchmarkComparison("stdlib/acc", 0.50, 0.50, 0.0, -0.03, 0.03, 0.95, True, 4000)
    assert decide_reward("rl-1", PRODUCTION, policy, _better_rewards(), UNCHANGED, benchmarks=[level]).passed


def test_the_reward_gate_holds_back_a_reward_won_by_longer_answers() -> None:
    """50 prompts won (+0.4 reward, a similarity reward) with answers 100 characters longer, 25 lost (-0.4, under
    the regression margin: no other guard objects) at the same length, 25 equal: the reward's mean gain is real, but
    at an unchanged length the candidate loses, so the length control holds it back, and only it."""
    candidate = np.r_[np.full(50, 0.9), np.full(25, 0.1), np.full(25, 0.5)]
    production = np.full(100, 0.5)
    lengths = np.r_[np.full(50, 140.0), np.full(50, 40.0)]
    lc = reward_length_control(candidate, production, lengths, np.full(100, 40.0))
    assert lc.win_rate < 0.5 and lc.verdicts == 75 and lc.mean_length_change == pytest.approx(50.0)
    held = decide_reward(
        "rl-1", PRODUCTION, PromotionPolicy(), candidate - production, UNCHANGED, length_controlled=lc
    )
    assert held.outcome == "hold back" and held.guard is not None and held.guard.verdict is None
    assert held.guards == (held.guards[0],) and held.guards[0].startswith("length-controlled win rate")
    assert decide_reward("rl-1", PRODUCTION, PromotionPolicy(), candidate - production, UNCHANGED).passed
    fair = reward_length_control(candidate, production, np.full(100, 40.0), np.full(100, 40.0))
    assert fair.win_rate == pytest.approx(50 / 75, abs=0.02)
    # the guard is one-sided: wins that came with *shorter* answers (a right answer is often a short one) are not
    # a length bias, whatever the fit reads at a zero length difference
    terse = reward_length_control(
        candidate, production, np.r_[np.full(50, 10.0), np.full(50, 40.0)], np.full(100, 40.0)
    )
    assert terse.win_rate < 0.5 and terse.mean_length_change < 0
    assert decide_reward(
        "rl-1", PRODUCTION, PromotionPolicy(), candidate - production, UNCHANGED, length_controlled=terse
    ).passed


def test_the_reward_gate_names_the_guards_it_ran_in_its_rule() -> None:
    decision = decide_reward(
        "rl-1", PRODUCTION, PromotionPolicy(), _better_rewards(), UNCHANGED, length_controlled=None
    )
    assert decision.passed
    d = _better_rewards()
    m = decide_reward("rl-1", PRODUCTION, PromotionPolicy(), d, UNCHANGED, means=(0.7, 0.2)).metadata()
    assert (m["candidate"], m["production"], m["difference"]) == pytest.approx((0.7, 0.2, d.mean()))
    assert decision.rule == (
        "reward interval low > 0.0; guards eval_loss regression <= 0.05, benchmarks regression <= 0.05, "
        "length-controlled win rate > 0.5"
    )


# --- 3. the non-inferiority guards: promote only when the interval's worse end is within the margin ---


def test_the_reward_gates_loss_guard_is_a_non_inferiority_test() -> None:
    better = _better_rewards()
    demo = decide_reward("rl-1", PRODUCTION, PromotionPolicy(), better, DEMO_DPO_LOSS)
    assert demo.outcome == "hold back", demo.reason  # interval high 0.053 > 0.05: not shown within the margin
    assert "eval_loss worse by +0.0430 nats/token, interval high +0.0530 > 0.05" in demo.reason
    within = PairedLoss(3.04, 3.0, Interval(0.04, 0.03, 0.049, 0.95), examples=107, tokens=4000)
    assert decide_reward("rl-1", PRODUCTION, PromotionPolicy(), better, within).passed
    unmeasured = decide_reward("rl-1", PRODUCTION, PromotionPolicy(), better, None)
    assert unmeasured.outcome == "insufficient evidence" and "eval_loss not measured" in unmeasured.reason


def test_the_preference_gates_guards_are_non_inferiority_tests() -> None:
    policy, win = PromotionPolicy(), _win_rate(30, 6)
    assert decide_preference("pref", PRODUCTION, policy, UNCHANGED, win, []).passed
    loss = decide_preference("pref", PRODUCTION, policy, DEMO_DPO_LOSS, win, [])
    assert loss.outcome == "hold back" and loss.guards[0].startswith("eval_loss worse by +0.0430")
    noisy = BenchmarkComparison("stdlib/acc", 0.48, 0.50, -0.02, -0.21, 0.17, 0.95, True, 40)
    bench = decide_preference("pref", PRODUCTION, policy, UNCHANGED, win, [noisy])
    assert bench.outcome == "hold back" and "stdlib/acc lower by 0.0200, interval low -0.2100" in bench.reason
    unmeasured = decide_preference("pref", PRODUCTION, policy, None, win, [])
    assert unmeasured.outcome == "insufficient evidence"


def test_a_length_guard_hold_back_is_not_waived() -> None:
    verbose = LengthControlled(win_rate=0.46, length_coefficient=3.1, mean_length_change=240.0, verdicts=12)
    decision = decide_preference("pref", PRODUCTION, WAIVING, UNCHANGED, _win_rate(11, 1), [], None, verbose)
    assert decision.outcome == "hold back" and "length-controlled win rate 0.460" in decision.reason


# --- the boundaries and the worse side each gate's waiver looks at (mutation testing found them unasserted) ---


def _loss(low: float, high: float) -> PairedLoss:
    return PairedLoss(3.0 + (low + high) / 2, 3.0, Interval((low + high) / 2, low, high, 0.95), 107, 4000)


def test_the_non_inferiority_margins_are_inclusive_and_each_guard_names_its_own_finding() -> None:
    """The loss's high end exactly at the margin and a benchmark's low end exactly at minus it are shown within it
    (promoted); a hair past either is held back by that guard alone."""
    policy, better = PromotionPolicy(), _better_rewards()
    assert decide_reward("rl-1", PRODUCTION, policy, better, _loss(0.0, 0.05)).passed
    past = decide_reward("rl-1", PRODUCTION, policy, better, _loss(0.0, 0.0501))
    assert past.outcome == "hold back" and past.guards == (
        "eval_loss worse by +0.0250 nats/token, interval high +0.0501 > 0.05",
    )
    at = BenchmarkComparison("t/acc", 0.5, 0.5, 0.0, -0.05, 0.05, 0.95, True, 4000)
    assert decide_reward("rl-1", PRODUCTION, policy, better, UNCHANGED, benchmarks=[at]).passed
    below = BenchmarkComparison("t/acc", 0.5, 0.5, 0.0, -0.0501, 0.05, 0.95, True, 4000)
    held = decide_reward("rl-1", PRODUCTION, policy, better, UNCHANGED, benchmarks=[below])
    assert held.guards == ("t/acc lower by -0.0000, interval low -0.0501 < -0.05",)


def test_the_length_guard_holds_back_at_its_limit_and_only_with_longer_answers() -> None:
    policy, better = PromotionPolicy(), _better_rewards()
    at = LengthControlled(win_rate=0.5, length_coefficient=1.0, mean_length_change=1.0, verdicts=40)
    assert (
        decide_reward("rl-1", PRODUCTION, policy, better, UNCHANGED, length_controlled=at).outcome
        == "hold back"
    )
    above = LengthControlled(win_rate=0.5001, length_coefficient=1.0, mean_length_change=1.0, verdicts=40)
    assert decide_reward("rl-1", PRODUCTION, policy, better, UNCHANGED, length_controlled=above).passed
    same_length = LengthControlled(win_rate=0.2, length_coefficient=1.0, mean_length_change=0.0, verdicts=40)
    assert decide_reward("rl-1", PRODUCTION, policy, better, UNCHANGED, length_controlled=same_length).passed
    off = policy.model_copy(
        update={"rl": policy.rl.model_copy(update={"min_length_controlled_win_rate": None})}
    )
    lenient = decide_reward("rl-1", PRODUCTION, off, better, UNCHANGED, length_controlled=at)
    assert lenient.passed and "length-controlled" not in lenient.rule


@pytest.mark.parametrize(
    ("high", "promoted"),
    [(-0.0001, False), (0.0, True)],  # wholly below zero: shown worse; touching it: not
)
def test_the_reward_waiver_looks_at_the_interval_high_end(high: float, promoted: bool) -> None:
    from nexa_dagster.core.evaluation.promotion import Evidence
    from nexa_dagster.core.evaluation.reward_gate import reward_decision

    d = Interval(high - 0.5, high - 1.0, high, 0.95)
    decision = reward_decision(
        WAIVING, d, (20, 0, 20), Evidence(paired_loss=UNCHANGED, **WAIVING.rl.limits())
    )
    assert decision.passed is promoted and decision.outcome == (
        "promote" if promoted else "insufficient evidence"
    )


def test_the_win_rate_waiver_and_rule_look_at_the_right_ends_and_the_margin() -> None:
    """Below min_consistent_verdicts a win rate wholly under 0.5 is never waived, one touching it is; the rule
    clears 0.5 + margin, strictly, on the interval (or on the estimate without require_interval)."""
    from nexa_dagster.core.evaluation.paired import WinRate

    def rate(low: float, estimate: float, high: float, n: int = 30) -> WinRate:
        return WinRate(wins=n, losses=0, inconsistent=0, rate=Interval(estimate, low, high, 0.95))

    win = PromotionPolicy(metric="win_rate")
    waiving = win.model_copy(update={"on_insufficient_evidence": "promote"})
    assert not decide("c", PRODUCTION, waiving, win_rate=rate(0.1, 0.3, 0.4999, n=5)).passed
    assert decide("c", PRODUCTION, waiving, win_rate=rate(0.1, 0.3, 0.5, n=5)).passed
    assert not decide("c", PRODUCTION, win, win_rate=rate(0.5, 0.7, 0.9)).passed  # strictly above 0.5
    assert decide("c", PRODUCTION, win, win_rate=rate(0.5001, 0.7, 0.9)).passed
    margin = win.model_copy(update={"margin": 0.1})
    held = decide("c", PRODUCTION, margin, win_rate=rate(0.55, 0.7, 0.9))
    assert not held.passed and held.rule == "interval low > 0.6"
    point = win.model_copy(update={"require_interval": False})
    on_estimate = decide("c", PRODUCTION, point, win_rate=rate(0.4, 0.55, 0.7))
    assert on_estimate.passed and on_estimate.rule == "win rate > 0.5"
    m = on_estimate.metadata()
    assert (m["candidate"], m["production"], m["difference"]) == pytest.approx((0.55, 0.45, 0.05))


def test_the_loss_and_benchmark_waivers_look_at_the_worse_end() -> None:
    waiving = PromotionPolicy(on_insufficient_evidence="promote")
    assert not decide(
        "c", PRODUCTION, waiving, PairedLoss(3.1, 3.0, Interval(0.1, 0.0001, 0.2, 0.95), 5, 200)
    ).passed
    assert decide(
        "c", PRODUCTION, waiving, PairedLoss(3.1, 3.0, Interval(0.1, 0.0, 0.2, 0.95), 5, 200)
    ).passed
    bench = waiving.model_copy(update={"metric": "benchmark:t/acc"})
    worse = BenchmarkComparison("t/acc", 0.4, 0.5, -0.1, -0.2, -0.0001, 0.95, True, 5)
    touching = BenchmarkComparison("t/acc", 0.4, 0.5, -0.1, -0.2, 0.0, 0.95, True, 5)
    assert not decide("c", PRODUCTION, bench, benchmark=worse).passed
    assert decide("c", PRODUCTION, bench, benchmark=touching).passed


def test_the_reward_gates_comparisons_of_nothing_and_its_smallest_n() -> None:
    first = decide_reward("rl-1", None, PromotionPolicy(), [])
    assert (first.passed, first.outcome, first.rule, first.reason) == (
        True,
        "promote",
        "first model",
        "no production model yet",
    )
    same = ProductionEntry(checkpoint_id="rl-1", checkpoint_path="checkpoints/rl-1", metric="eval_loss")
    again = decide_reward("rl-1", same, PromotionPolicy(), [])
    assert (again.passed, again.outcome, again.reason) == (True, "promote", "rl-1 is production")
    one = decide_reward("rl-1", PRODUCTION, PromotionPolicy(), [1.0], UNCHANGED)
    assert (one.passed, one.n, one.rule) == (False, 1, "n >= 2") and "nothing to compare" in one.reason
    two = decide_reward("rl-1", PRODUCTION, PromotionPolicy(), [1.0, 0.0], UNCHANGED)
    assert two.n == 2 and two.outcome == "insufficient evidence" and two.rule.startswith("n >= 30")


def test_the_reward_gate_runs_its_guards_from_the_minimum_n_on() -> None:
    at_minimum = decide_reward("rl-1", PRODUCTION, PromotionPolicy(), _better_rewards(30), UNCHANGED)
    assert at_minimum.guard is not None and at_minimum.guard.n == 30
    assert decide_reward("rl-1", PRODUCTION, PromotionPolicy(), _better_rewards(29), UNCHANGED).guard is None


def test_the_reward_gates_bootstrap_interval_is_the_paired_statistics_own() -> None:
    """``interval_method: bootstrap``: the reward gate's interval is ``paired_loss_difference``'s on the same
    differences with every prompt weighing one, the policy's resamples and seed 0 (reproducible)."""
    from nexa_dagster.core.evaluation.reward_gate import mean_difference_interval

    d = np.random.default_rng(4).normal(0.1, 1.0, size=50)
    ours = mean_difference_interval(d, 0.95, "bootstrap", 300)
    theirs = paired_loss_difference(d, np.zeros(50), np.ones(50), 0.95, 300, 0, "bootstrap").difference
    assert (ours.low, ours.high) == (theirs.low, theirs.high)
    other = mean_difference_interval(d, 0.95, "bootstrap", 301)
    assert (ours.low, ours.high) != (other.low, other.high)
