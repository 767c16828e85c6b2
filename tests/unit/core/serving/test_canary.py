"""The canary's decision on live traffic, request by request: rolled back as soon as a figure is shown worse (and
named), promoted once every figure is shown no worse, rolled back at the time limit ("not enough traffic"); its
state survives a save between checks; a bad policy is refused before anything starts."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from nexa_dagster.core.serving.canary import CanaryPolicy, CanaryState, decide

# failures and latency only: quality needs scored requests, fed where a test says so
FAST = CanaryPolicy(share=0.5, max_quality_drop=None, max_failure_increase=0.05, max_slow_increase=0.1)


def _serve(state: CanaryState, policy: CanaryPolicy, rng, requests: int, canary: dict, every: int = 10):
    """Route ``requests`` requests (share to the canary), record each, decide every ``every``; the first decision
    that is not "continue" (with the request count), or the last one."""
    stable = {"failure": 0.01, "latency_s": 0.4, "reward": 0.7}
    decision = None
    for i in range(1, requests + 1):
        arm = "canary" if rng.random() < policy.share else "stable"
        backend = {**stable, **canary} if arm == "canary" else stable
        failed = bool(rng.random() < backend["failure"])
        latency = backend["latency_s"] * float(np.exp(0.5 * rng.standard_normal()))
        quality = float(rng.random() < backend["reward"]) if rng.random() < 0.5 else None
        state.record(arm, policy, failed=failed, latency_s=latency, quality=quality)
        if i % every == 0:
            decision = decide(state, policy, now=float(i))
            if decision.verdict != "continue":
                return decision, i
    return decision, requests


def test_a_canary_failing_a_fifth_of_requests_is_rolled_back_naming_the_failures() -> None:
    state = CanaryState.start("stable-ckpt", "canary-ckpt", FAST, now=0.0)
    decision, spent = _serve(state, FAST, np.random.default_rng(0), 4000, {"failure": 0.2})
    assert decision.verdict == "roll back" and spent < 1000
    assert decision.reason.startswith("canary worse: failed: ")
    failed = next(r for r in decision.figures if r.figure == "failed")
    assert failed.status == "worse" and failed.low > 0.05 and failed.n_canary > 0


def test_a_canary_three_times_slower_is_rolled_back_naming_its_slow_requests() -> None:
    state = CanaryState.start("s", "c", FAST, now=0.0)
    decision, _ = _serve(state, FAST, np.random.default_rng(1), 4000, {"latency_s": 1.2})
    assert decision.verdict == "roll back" and decision.reason.startswith("canary worse: slow: ")
    slow = next(r for r in decision.figures if r.figure == "slow")
    # the threshold: twice the median of the stable's first 30 successful requests (median 0.4 s)
    assert slow.threshold_s == pytest.approx(0.8, rel=0.3)
    assert f"more of requests slower than {slow.threshold_s:.3g} s" in decision.reason


def test_a_healthy_canary_is_promoted_once_every_figure_is_shown_no_worse() -> None:
    state = CanaryState.start("s", "c", FAST, now=0.0)
    decision, spent = _serve(state, FAST, np.random.default_rng(2), 6000, {})
    assert decision.verdict == "promote", decision.reason
    assert {r.figure: r.status for r in decision.figures} == {"failed": "no worse", "slow": "no worse"}
    assert decision.reason.startswith("canary no worse on every figure: failed: ")
    assert "; slow: " in decision.reason and "95% confidence sequences" in decision.reason
    assert spent == state.sequences["stable"]["failed"].n + state.sequences["canary"]["failed"].n


def test_a_canary_with_worse_answers_is_rolled_back_on_quality() -> None:
    policy = CanaryPolicy(share=0.5, max_failure_increase=None, max_slow_increase=None, max_quality_drop=0.1)
    state = CanaryState.start("s", "c", policy, now=0.0)
    decision, _ = _serve(state, policy, np.random.default_rng(3), 6000, {"reward": 0.2})
    assert (
        decision.verdict == "roll back"
        and "quality: " in decision.reason
        and "lower score" in decision.reason
    )


def test_undecided_at_the_time_limit_is_not_enough_traffic_and_rolls_back() -> None:
    policy = FAST.model_copy(update={"max_duration_s": 50.0})
    state = CanaryState.start("s", "c", policy, now=0.0)
    decision, spent = _serve(state, policy, np.random.default_rng(4), 4000, {})
    assert decision.verdict == "roll back" and spent == 50
    assert decision.reason.startswith("not enough traffic: undecided after 50 s (max_duration_s 50): ")
    assert all(r.status == "undecided" for r in decision.figures)


def test_the_state_saved_between_checks_gives_the_same_decision() -> None:
    state = CanaryState.start("s", "c", FAST, now=0.0)
    _serve(state, FAST, np.random.default_rng(5), 300, {})
    again = CanaryState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert decide(again, FAST, 300.0) == decide(state, FAST, 300.0)
    assert (again.stable_id, again.canary_id) == ("s", "c")


def test_a_failed_request_counts_as_a_failure_only_and_the_stables_warm_up_only_sets_the_threshold() -> None:
    policy = CanaryPolicy(warmup_requests=5)
    state = CanaryState.start("s", "c", policy, now=0.0)
    state.record("canary", policy, failed=True, latency_s=30.0, quality=0.0)
    state.record("canary", policy, failed=False, latency_s=30.0, quality=1.0)  # no threshold yet: not timed
    canary = state.sequences["canary"]
    assert (canary["failed"].n, canary["failed"].total, canary["slow"].n) == (2, 1.0, 0)
    assert (canary["quality"].n, canary["quality"].total) == (1, 1.0)
    for seconds in (0.1, 0.5, 0.2, 0.3, 0.4):
        state.record("stable", policy, failed=False, latency_s=seconds)
    assert state.thresholds == {"slow": pytest.approx(0.6)}  # 2 x the median 0.3
    assert state.sequences["stable"]["slow"].n == 0 and state.sequences["stable"]["failed"].n == 5
    state.record("canary", policy, failed=False, latency_s=0.7)
    state.record("stable", policy, failed=False, latency_s=0.5)
    assert (canary["slow"].n, canary["slow"].total) == (1, 1.0)
    assert (state.sequences["stable"]["slow"].n, state.sequences["stable"]["slow"].total) == (1, 0.0)


def test_a_stated_latency_objective_is_the_threshold_from_the_first_request() -> None:
    policy = CanaryPolicy(slow_request_s=1.0)
    state = CanaryState.start("s", "c", policy, now=0.0)
    state.record("canary", policy, failed=False, latency_s=1.5)
    assert state.thresholds == {"slow": 1.0} and state.sequences["canary"]["slow"].total == 1.0


def test_each_sequence_runs_at_its_share_of_the_error_over_every_watched_figure() -> None:
    assert CanaryPolicy().figures() == ("failed", "slow", "quality")
    assert CanaryPolicy().sequence_alpha() == pytest.approx(0.05 / 6)
    assert CanaryPolicy(max_slow_first_token_increase=0.1, confidence=0.9).sequence_alpha() == pytest.approx(
        0.1 / 8
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("share", 0.0),
        ("share", 1.0),
        ("confidence", 1.0),
        ("max_failure_increase", -0.01),
        ("max_latency_ratio", 0.9),
    ],
)
def test_a_policy_out_of_range_is_refused_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(ValidationError, match=field):
        CanaryPolicy(**{field: value})


def test_a_policy_watching_nothing_is_refused() -> None:
    with pytest.raises(ValidationError, match="at least one watched figure"):
        CanaryPolicy(max_failure_increase=None, max_slow_increase=None, max_quality_drop=None)
