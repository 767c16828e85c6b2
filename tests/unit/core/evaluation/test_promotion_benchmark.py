"""The gate deciding on a benchmark metric (``metric: benchmark:<task>/<metric>``): the harness's interval against
the margin, on the configured end, with the figures, rule and reason a person reads."""

from __future__ import annotations

import pytest

from nexa_dagster.core.evaluation.benchmarks import BenchmarkComparison
from nexa_dagster.core.evaluation.promotion import ProductionEntry, PromotionPolicy, decide

PRODUCTION = ProductionEntry(checkpoint_id="prod", checkpoint_path="checkpoints/prod", metric="eval_loss")
ARC = PromotionPolicy(metric="benchmark:arc/acc", margin=0.01)
HARNESS = "normal interval from the harness's standard errors"


def _acc(
    candidate: float, difference: float, low: float, high: float, samples: int = 200
) -> BenchmarkComparison:
    return BenchmarkComparison(
        "arc/acc", candidate, candidate - difference, difference, low, high, 0.95, True, samples
    )


def test_a_benchmark_gain_whose_interval_clears_the_margin_promotes_with_its_figures() -> None:
    decision = decide("cand", PRODUCTION, ARC, benchmark=_acc(0.62, 0.07, 0.03, 0.11))
    assert decision.passed is True and decision.outcome == "promote"
    assert decision.reason == (
        "arc/acc 0.6200 vs production prod 0.5500: gain +0.0700, 95% interval [+0.0300, +0.1100] "
        "(the harness's standard errors, n = 200); the interval is above 0.01"
    )
    assert decision.metadata() == {
        "decision": "promote",
        "reason": decision.reason,
        "candidate": 0.62,
        "production": pytest.approx(0.55),
        "difference": 0.07,
        "interval_low": 0.03,
        "interval_high": 0.11,
        "n": 200,
        "method": HARNESS,
        "rule": "interval low > 0.01",
    }


def test_a_gain_inside_the_noise_is_held_back_on_the_interval_and_promoted_on_the_point_estimate() -> None:
    noisy = _acc(0.58, 0.03, -0.01, 0.07)
    held = decide("cand", PRODUCTION, ARC, benchmark=noisy)
    assert held.passed is False and held.outcome == "hold back" and held.rule == "interval low > 0.01"
    assert held.reason.endswith("(the harness's standard errors, n = 200); the interval is not above 0.01")
    point = ARC.model_copy(update={"require_interval": False})
    promoted = decide("cand", PRODUCTION, point, benchmark=noisy)
    assert promoted.passed is True and promoted.outcome == "promote" and promoted.rule == "gain > 0.01"
    assert promoted.reason.endswith("; the point estimate is above 0.01")
    assert (promoted.interval, promoted.method) == ((-0.01, 0.07), HARNESS)


def test_an_interval_that_only_reaches_the_margin_is_not_above_it() -> None:
    touching = decide("cand", PRODUCTION, ARC, benchmark=_acc(0.6, 0.05, 0.01, 0.09))
    assert touching.passed is False and touching.outcome == "hold back"


def test_a_lower_is_better_metric_is_stated_as_a_reduction() -> None:
    perplexity = BenchmarkComparison("wikitext/word_perplexity", 20.0, 22.0, 2.0, 0.4, 3.6, 0.95, False, 60)
    policy = PromotionPolicy(metric="benchmark:wikitext/word_perplexity", margin=0.5)
    decision = decide("cand", PRODUCTION, policy, benchmark=perplexity)
    assert decision.passed is False and decision.reason == (
        "wikitext/word_perplexity 20.0000 vs production prod 22.0000: reduction +2.0000, 95% interval "
        "[+0.4000, +3.6000] (the harness's standard errors, n = 60); the interval is not above 0.5"
    )


def test_a_benchmark_not_measured_on_both_models_compares_nothing_and_is_held_back() -> None:
    decision = decide("cand", PRODUCTION, ARC)
    assert decision.passed is False and decision.outcome == "hold back" and decision.n is None
    assert decision.reason == (
        "benchmark:arc/acc was not measured on both cand and production prod: nothing to compare with"
    )
