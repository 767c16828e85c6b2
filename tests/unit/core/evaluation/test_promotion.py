"""The promotion gate decides only on enough evidence, says on what it decided, and refuses a contaminated win."""

from __future__ import annotations

import numpy as np
import pytest

from nexa_dagster.core.evaluation.guards import GuardReport
from nexa_dagster.core.evaluation.paired import (
    Interval,
    LengthControlled,
    PairedLoss,
    order_consistent_win_rate,
    paired_loss_difference,
    pointwise_win_rate,
)
from nexa_dagster.core.evaluation.promotion import (
    GateDecision,
    ProductionEntry,
    PromotionPolicy,
    decide,
    decide_preference,
)

PRODUCTION = ProductionEntry(checkpoint_id="prod", checkpoint_path="checkpoints/prod", metric="eval_loss")
# a preference candidate's eval-set loss, measured and unchanged: its non-inferiority guard holds
UNCHANGED = PairedLoss(3.0, 3.0, Interval(0.0, -0.01, 0.01, 0.95), examples=107, tokens=4000)


def _clearly_better(n: int):
    """A candidate better by 0.5 nats per token on every one of ``n`` examples (tiny noise)."""
    rng = np.random.default_rng(n)
    tokens = rng.integers(20, 60, size=n)
    production = rng.uniform(3.0, 6.0, size=n) * tokens
    candidate = production - (0.5 + rng.normal(0, 0.01, size=n)) * tokens
    return paired_loss_difference(candidate, production, tokens)


@pytest.mark.parametrize("n", [1, 2])
def test_one_or_two_examples_are_insufficient_evidence_whatever_the_difference(n: int) -> None:
    decision = decide("cand", PRODUCTION, PromotionPolicy(), _clearly_better(n))
    assert not decision.passed and decision.outcome == "insufficient evidence"
    assert decision.n == n and decision.rule == "n >= 30"
    assert f"insufficient evidence: n = {n} < 30 (eval-set examples, min_examples)" in decision.reason


def test_enough_examples_and_a_clear_interval_promote_with_n_method_and_rule_stated() -> None:
    decision = decide("cand", PRODUCTION, PromotionPolicy(), _clearly_better(30))
    assert decision.passed and decision.outcome == "promote" and decision.n == 30
    assert decision.rule == "interval high < -0.0" and decision.method.startswith("skew-corrected t-interval")
    meta = decision.metadata()
    assert (meta["decision"], meta["n"]) == ("promote", 30) and meta["interval_high"] < -0.4


def test_promoting_on_too_little_evidence_happens_only_where_the_policy_says_so_and_warns() -> None:
    policy = PromotionPolicy(on_insufficient_evidence="promote")
    decision = decide("cand", PRODUCTION, policy, _clearly_better(5))
    assert (
        decision.passed and decision.outcome == "promote" and decision.reason.startswith("WARN insufficient")
    )
    assert decision.rule == "n >= 30 (waived)"
    assert decision.reason.endswith(
        "; promoted because on_insufficient_evidence: promote (nothing shows it worse)"
    )


def test_the_first_model_is_promoted_without_a_comparison() -> None:
    decision = decide("cand", None, PromotionPolicy())
    assert decision.passed and decision.outcome == "promote" and decision.rule == "first model"


def test_a_win_rate_on_a_handful_of_consistent_verdicts_decides_nothing() -> None:
    policy = PromotionPolicy(metric="win_rate")
    few = order_consistent_win_rate(["candidate"] * 8, ["candidate"] * 8)  # 8 wins, 0 losses: Wilson low 0.68
    decision = decide("cand", PRODUCTION, policy, win_rate=few)
    assert few.rate.low > 0.5 and decision.outcome == "insufficient evidence" and decision.n == 8
    many = order_consistent_win_rate(["candidate"] * 22, ["candidate"] * 22)
    assert decide("cand", PRODUCTION, policy, win_rate=many).outcome == "promote"


def test_a_contaminated_candidate_is_held_back_naming_the_share() -> None:
    decision = decide(
        "cand", PRODUCTION, PromotionPolicy(max_contamination=0.02), _clearly_better(30), contamination=0.1
    )
    assert not decision.passed and decision.outcome == "hold back"
    assert decision.reason.startswith("contaminated: 10.0% of the eval set occurs in its training data")
    clean = decide(
        "cand", PRODUCTION, PromotionPolicy(max_contamination=0.02), _clearly_better(30), contamination=0.0
    )
    assert clean.passed


def _win_rate(wins: int, losses: int):
    return order_consistent_win_rate(
        ["candidate"] * wins + ["production"] * losses, ["candidate"] * wins + ["production"] * losses
    )


def test_a_preference_checkpoint_is_promoted_on_its_win_rate_with_the_guards_named() -> None:
    decision = decide_preference("pref", PRODUCTION, PromotionPolicy(), UNCHANGED, _win_rate(30, 6), [])
    assert decision.passed and decision.n == 36
    assert decision.rule.endswith(
        "guards eval_loss regression <= 0.05, benchmarks regression <= 0.05, length-controlled win rate > 0.5"
    )
    too_few = decide_preference("pref", PRODUCTION, PromotionPolicy(), UNCHANGED, _win_rate(10, 1), [])
    assert too_few.outcome == "insufficient evidence"


def test_a_preference_checkpoint_much_worse_on_the_eval_set_is_held_back() -> None:
    worse = _clearly_better(30)
    worse = PairedLoss(  # the same examples with the signs turned: candidate worse by 0.5 nats per token
        worse.production,
        worse.candidate,
        Interval(-worse.difference.estimate, -worse.difference.high, -worse.difference.low, 0.95),
        worse.examples,
        worse.tokens,
    )
    decision = decide_preference("pref", PRODUCTION, PromotionPolicy(), worse, _win_rate(30, 6), [])
    assert decision.passed is False and decision.outcome == "hold back"
    assert decision.guards and decision.guards[0].startswith("eval_loss worse by +0.5")


def test_a_win_bought_with_longer_answers_is_held_back() -> None:
    verbose = LengthControlled(win_rate=0.46, length_coefficient=3.1, mean_length_change=240.0, verdicts=36)
    decision = decide_preference(
        "pref", PRODUCTION, PromotionPolicy(), UNCHANGED, _win_rate(30, 6), [], None, verbose
    )
    assert not decision.passed and "length-controlled win rate 0.460 <= 0.5" in decision.reason
    assert "+240 characters" in decision.reason
    honest = LengthControlled(win_rate=0.8, length_coefficient=0.1, mean_length_change=3.0, verdicts=36)
    assert decide_preference(
        "pref", PRODUCTION, PromotionPolicy(), UNCHANGED, _win_rate(30, 6), [], None, honest
    ).passed


def test_a_judge_whose_verdicts_follow_the_answer_order_is_called_unreliable_and_the_candidate_held_back() -> (
    None
):
    """30 prompts: 22 verdicts survive the swap (all wins: Wilson low 0.85, enough for a promotion on its own),
    but 8 more flipped with the order: 27 % of the judged prompts > max_inconsistent_share 0.2. The decision says
    the judge is unreliable, with the counts; unreadable replies are counted apart, not as flips."""
    first = ["candidate"] * 22 + ["candidate"] * 8 + [None] * 5
    second = ["candidate"] * 22 + ["production"] * 8 + ["candidate"] * 5
    rate = order_consistent_win_rate(first, second)
    policy = PromotionPolicy(preference={"judge_mode": "pairwise", "max_inconsistent_share": 0.2})
    decision = decide_preference("pref", PRODUCTION, policy, UNCHANGED, rate, [])
    assert not decision.passed and decision.outcome == "hold back" and decision.n == 22
    assert decision.reason.startswith(
        "judge unreliable: 8 of 30 judged prompts (27%) flipped their verdict when the answers swapped places "
        "(order consistency 73%; max_inconsistent_share 20%); 5 unreadable"
    )
    assert decision.rule == "flipped share <= 0.2" and "pairwise judge" in decision.reason
    # the same verdicts under a looser bound promote, stating the mode, n and method
    loose = PromotionPolicy(preference={"judge_mode": "pairwise", "max_inconsistent_share": 0.3})
    passed = decide_preference("pref", PRODUCTION, loose, UNCHANGED, rate, [])
    assert passed.passed and passed.n == 22 and passed.method.startswith("Wilson score interval over order-")
    # a judge flipping on nearly every prompt (the tiny demo judge) is unreliable before it is short of verdicts
    tiny = order_consistent_win_rate(["candidate"] * 47, ["production"] * 46 + ["candidate"])
    held = decide_preference("pref", PRODUCTION, PromotionPolicy(), UNCHANGED, tiny, [])
    assert held.outcome == "hold back" and held.reason.startswith("judge unreliable: 46 of 47")


def test_a_pointwise_judge_decides_on_its_decisive_verdicts_and_refuses_too_few() -> None:
    """Pointwise, nothing can flip: the win rate over the decisive verdicts decides (ties and unreadable scores
    counted apart, stated in the reason); below min_consistent_verdicts usable verdicts, insufficient evidence."""
    candidate = [4.0] * 20 + [2.0] * 4 + [3.0] * 6 + [None] * 2
    production = [3.0] * 20 + [3.0] * 4 + [3.0] * 6 + [3.0] * 2
    decision = decide_preference(
        "pref", PRODUCTION, PromotionPolicy(), UNCHANGED, pointwise_win_rate(candidate, production), []
    )
    assert (
        decision.passed
        and decision.n == 24
        and decision.method.startswith("Wilson score interval over decisive")
    )
    assert "pointwise judge: win_rate 0.833" in decision.reason and "6 ties; 2 unreadable" in decision.reason
    few = pointwise_win_rate(candidate[:19] + [3.0] * 13, production)  # 19 wins, 13 ties
    short = decide_preference("pref", PRODUCTION, PromotionPolicy(), UNCHANGED, few, [])
    assert (
        short.outcome == "insufficient evidence"
        and short.n == 19
        and short.rule.startswith("n >= 20; guards")
    )
    assert (
        "insufficient evidence: n = 19 < 20 (usable judge verdicts, min_consistent_verdicts)" in short.reason
    )
    # a pointwise judge is never called unreliable for flips: it has no answer order
    assert "unreliable" not in short.reason


def _pairwise_with_flips():
    """39 prompts: 30 wins and 6 losses that survive the swap, 2 verdicts that flip, 1 unreadable reply."""
    first = ["candidate"] * 30 + ["production"] * 6 + ["candidate"] * 2 + [None]
    second = ["candidate"] * 30 + ["production"] * 6 + ["production"] * 2 + ["candidate"]
    return order_consistent_win_rate(first, second)


def test_a_pairwise_win_rate_decision_states_the_counts_the_interval_and_the_margin_it_cleared() -> None:
    rate = _pairwise_with_flips()
    decision = decide("cand", PRODUCTION, PromotionPolicy(metric="win_rate", margin=0.05), win_rate=rate)
    assert decision.passed and decision.rule == "interval low > 0.55"
    assert decision.reason == (
        "pairwise judge: win_rate 0.833 over production prod (30 wins, 6 losses; 2 flipped with the answer "
        "order, order consistency 95%; 1 unreadable; headline 0.816 with those as ties), 95% Wilson interval "
        "[0.681, 0.921] over n = 36 order-consistent verdicts of 39 prompts; the interval is above 0.55"
    )
    meta = decision.metadata()
    assert (meta["interval_low"], meta["interval_high"]) == (rate.rate.low, rate.rate.high)
    held = decide("cand", PRODUCTION, PromotionPolicy(metric="win_rate", margin=0.2), win_rate=rate)
    assert not held.passed and held.reason.endswith("; the interval is not above 0.7")


def test_a_pointwise_win_rate_decision_states_its_ties_and_decisive_verdicts() -> None:
    rate = pointwise_win_rate([4.0] * 28 + [2.0] * 4 + [3.0] * 3 + [None], [3.0] * 36)
    decision = decide("cand", PRODUCTION, PromotionPolicy(metric="win_rate", margin=0.05), win_rate=rate)
    assert decision.passed and decision.reason == (
        "pointwise judge: win_rate 0.875 over production prod (28 wins, 4 losses; 3 ties; 1 unreadable; "
        "headline 0.843 with those as ties), 95% Wilson interval [0.719, 0.950] over n = 32 decisive pointwise "
        "verdicts of 36 prompts; the interval is above 0.55"
    )


def test_a_pairwise_judge_with_no_readable_verdict_states_no_order_consistency() -> None:
    unreadable = order_consistent_win_rate([None] * 5, [None] * 5)
    decision = decide("cand", PRODUCTION, PromotionPolicy(metric="win_rate"), win_rate=unreadable)
    assert decision.outcome == "insufficient evidence" and decision.n == 0
    assert "(0 wins, 0 losses; 0 flipped with the answer order, order consistency n/a; 5 unreadable;" in (
        decision.reason
    )


def test_no_judge_comparison_is_held_back_saying_so() -> None:
    decision = decide("cand", PRODUCTION, PromotionPolicy(metric="win_rate"))
    assert decision.passed is False and decision.outcome == "hold back" and decision.n is None
    assert decision.reason == "the judge did not compare cand with production prod: nothing to compare with"
    preference = decide_preference("pref", PRODUCTION, PromotionPolicy(), UNCHANGED, None, [])
    assert preference.passed is False and preference.reason == (
        "the judge did not compare pref with production prod: nothing to compare with"
    )


def test_the_preference_gate_clears_the_preference_margin_not_the_loss_gates() -> None:
    policy = PromotionPolicy(margin=0.0, preference={"margin": 0.2})
    decision = decide_preference("pref", PRODUCTION, policy, UNCHANGED, _pairwise_with_flips(), [])
    assert not decision.passed and decision.outcome == "hold back"
    assert decision.rule.startswith("interval low > 0.7;")


def test_the_preference_gate_promotes_the_first_model_and_re_evaluates_production_without_a_comparison() -> (
    None
):
    first = decide_preference("pref", None, PromotionPolicy(), None, None, [])
    assert first.passed and first.rule == "first model" and first.reason == "no production model yet"
    again = decide_preference("prod", PRODUCTION, PromotionPolicy(), None, None, [])
    assert again.passed and again.outcome == "promote" and again.rule == "already production"
    assert again.reason == "prod is the production model (re-evaluation)"


def test_a_contaminated_preference_checkpoint_is_held_back() -> None:
    policy = PromotionPolicy(max_contamination=0.02)
    rate = _win_rate(30, 6)
    decision = decide_preference("pref", PRODUCTION, policy, UNCHANGED, rate, [], contamination=0.1)
    assert decision.passed is False and decision.outcome == "hold back"
    assert decision.reason.startswith("contaminated: 10.0% of the eval set occurs in its training data")
    assert decide_preference("pref", PRODUCTION, policy, UNCHANGED, rate, [], contamination=0.0).passed


def test_the_metadata_of_a_decision_without_an_interval_or_with_an_unbounded_end_holds_no_infinity() -> None:
    """JSON and the leaderboard have no infinity: an interval end that is not finite is written as null."""
    first = decide("cand", None, PromotionPolicy()).metadata()
    assert (first["decision"], first["rule"], first["reason"]) == (
        "promote",
        "first model",
        "no production model yet",
    )
    assert (first["interval_low"], first["interval_high"], first["n"]) == (None, None, None)
    unbounded = GateDecision(False, "r", interval=(float("-inf"), 0.2)).metadata()
    assert (unbounded["interval_low"], unbounded["interval_high"]) == (None, 0.2)
    unbounded = GateDecision(False, "r", interval=(0.1, float("inf"))).metadata()
    assert (unbounded["interval_low"], unbounded["interval_high"]) == (0.1, None)


def test_the_loss_gate_needs_min_examples_not_the_benchmark_minimum() -> None:
    lenient = PromotionPolicy(min_examples=10, min_benchmark_samples=50)
    assert decide("cand", PRODUCTION, lenient, _clearly_better(12)).outcome == "promote"
    strict = PromotionPolicy(min_examples=40, min_benchmark_samples=5)
    held = decide("cand", PRODUCTION, strict, _clearly_better(30))
    assert held.outcome == "insufficient evidence" and held.rule == "n >= 40"


def test_re_evaluating_the_production_model_promotes_it_again_without_a_comparison() -> None:
    again = decide("prod", PRODUCTION, PromotionPolicy(), _clearly_better(2))
    assert again.passed and again.outcome == "promote" and again.rule == "already production"
    assert again.reason == "prod is the production model (re-evaluation)"


def test_the_win_rate_gate_refuses_an_unreliable_judge_and_applies_the_guards() -> None:
    tiny = order_consistent_win_rate(["candidate"] * 47, ["production"] * 46 + ["candidate"])
    held = decide("cand", PRODUCTION, PromotionPolicy(metric="win_rate"), win_rate=tiny)
    assert (
        held.passed is False
        and held.outcome == "hold back"
        and held.reason.startswith("judge unreliable: 46 of 47")
    )
    found = GuardReport(
        30, 0.0, 0, 3, 0.1, (0.02, 0.27), 0.1, 0.05, findings=(("hold back", "3 of 30 worse"),)
    )
    guarded = decide("cand", PRODUCTION, PromotionPolicy(), _clearly_better(30), guard=found)
    assert guarded.outcome == "hold back" and guarded.reason.startswith("3 of 30 worse; eval_loss")


def test_every_non_regression_finding_is_named_in_the_reason() -> None:
    worse = PairedLoss(3.5, 3.0, Interval(0.5, 0.4, 0.6, 0.95), examples=107, tokens=4000)
    verbose = LengthControlled(win_rate=0.46, length_coefficient=3.1, mean_length_change=240.0, verdicts=36)
    decision = decide_preference(
        "pref", PRODUCTION, PromotionPolicy(), worse, _win_rate(30, 6), [], None, verbose
    )
    assert decision.reason.startswith(
        "non-regression guard: eval_loss worse by +0.5000 nats/token, interval high +0.6000 > 0.05; "
        "length-controlled win rate 0.460 <= 0.5 (answers longer by +240 characters on average; logistic fit "
        "on 36 verdicts); pairwise judge:"
    )


def test_a_benchmark_is_a_guard_only_where_the_gate_has_a_margin_for_it() -> None:
    from nexa_dagster.core.evaluation.benchmarks import BenchmarkComparison
    from nexa_dagster.core.evaluation.promotion import Evidence, non_regression_findings

    lower = BenchmarkComparison("arc/acc", 0.4, 0.5, -0.1, -0.2, 0.0, 0.95, True, 200)
    assert non_regression_findings(Evidence(benchmarks=(lower,))) == []
    assert non_regression_findings(Evidence(benchmarks=(lower,), benchmark_limit=0.05)) == [
        ("hold back", "arc/acc lower by 0.1000, interval low -0.2000 < -0.05")
    ]
    assert non_regression_findings(Evidence(loss_limit=0.05)) == [
        ("insufficient evidence", "eval_loss not measured: cannot show it worse by <= 0.05")
    ]
