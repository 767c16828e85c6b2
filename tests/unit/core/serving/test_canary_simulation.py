"""The canary's error rates under continuous monitoring, simulated with its own rule: within ``1 - confidence``
for the confidence sequences however often they are checked, where a fixed-n interval re-checked as often is not;
and a clearly broken canary is rolled back within a few hundred requests."""

from __future__ import annotations

import json

import pytest

from nexa_dagster.core.serving import canary_simulation as sim
from nexa_dagster.core.serving.canary import CanaryPolicy

pytestmark = pytest.mark.simulation
ALPHA = 0.05
# 400 streams: a true error rate of 5 % is observed above 8.4 % with probability < 1 %
LIMIT = 0.084


def _failures_only() -> CanaryPolicy:
    return CanaryPolicy(share=0.5, max_slow_increase=None, max_quality_drop=None)


def test_a_canary_at_the_failure_limit_is_promoted_within_the_level_only_by_the_sequence() -> None:
    canary, _ = sim.POPULATIONS["failed at the limit (+2 points)"]
    kwargs = dict(streams=400, requests=6000, look_every=20, seed=3)
    sequence = sim.summarise(sim.simulate(canary, _failures_only(), method="sequence", **kwargs))
    rechecked = sim.summarise(sim.simulate(canary, _failures_only(), method="fixed", **kwargs))
    once = sim.summarise(sim.simulate(canary, _failures_only(), method="fixed-once", **kwargs))
    assert sequence["promote"] <= LIMIT and once["promote"] <= LIMIT
    assert rechecked["promote"] > 3 * ALPHA  # the same interval, looked at every 20 requests


def test_every_error_of_the_whole_policy_stays_within_its_level_and_broken_canaries_are_caught() -> None:
    policy = CanaryPolicy(share=0.5)
    results = sim.run(policy, streams=400, requests=4000, look_every=20, seed=0, methods=("sequence",))
    for name, methods in results.items():
        assert sim.error_rate(name, methods["sequence"]) <= LIMIT, name
    for name in ("5xx on a fifth of requests", "3x slower"):
        caught = results[name]["sequence"]
        assert caught["roll_back"] >= 0.99 and caught["median_requests_to_decide"] <= 600, name


def test_the_command_prints_a_table_and_ends_with_one_json_object(capsys) -> None:
    sim.main(["--streams", "50", "--requests", "1000", "--figures", "failed"])
    out = capsys.readouterr().out.strip().splitlines()
    figures = json.loads(out[-1])
    assert set(figures["results"]) == {
        "equal",
        "failed at the limit (+2 points)",
        "5xx on a fifth of requests",
    }
    assert set(figures["results"]["equal"]) == set(sim.METHODS)
    assert out[0].startswith("50 streams of 1000 requests, checked every 20; share 0.1")
