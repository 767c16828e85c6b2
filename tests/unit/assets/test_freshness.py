"""The nightly's outputs carry freshness policies from configs/pipeline.yaml's schedule, and Dagster's own
evaluators, on a real instance, see the night's evaluation overdue when a night passes without one and fresh again
after a run. Time is Dagster's frozen test clock (``freeze_time``): the runs and the evaluations happen at the
hours of two nights."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import dagster as dg
import pytest

# private: in Dagster 1.13 only the daemon evaluates freshness; no public API evaluates a policy, names its
# states or freezes Dagster's clock (public DagsterInstance.get_freshness_state_records reads what the daemon stored)
from dagster._core.definitions.freshness import FreshnessState
from dagster._core.definitions.freshness_evaluator import (
    CronFreshnessPolicyEvaluator,
    TimeWindowFreshnessPolicyEvaluator,
)
from dagster._core.loader import LoadingContextForTest
from dagster._core.test_utils import freeze_time

from nexa_dagster.assets.freshness import nightly_freshness
from nexa_dagster.core.common.config import ScheduleConfig, pipeline_config


def _at(day: int, hour: int, minute: int = 0) -> datetime:
    return datetime(2026, 11, day, hour, minute, tzinfo=UTC)


@pytest.fixture(scope="module")
def graph():
    from nexa_dagster.definitions import build_defs

    return build_defs().resolve_asset_graph()


def _materialize(graph, instance: dg.DagsterInstance, name: str, checkpoint: str) -> None:
    """A real run of the asset's spec as the code location defines it (its body a stand-in: freshness reads only
    when it was materialized)."""
    key = dg.AssetKey(name)
    spec = next(s for s in graph.assets_def_for_key(key).specs if s.key == key)

    @dg.multi_asset(specs=[spec], name=f"stand_in_{name}")
    def stand_in() -> dg.MaterializeResult:
        return dg.MaterializeResult(asset_key=key)

    instance.add_dynamic_partitions("checkpoints", [checkpoint])
    assert dg.materialize([stand_in], instance=instance, partition_key=checkpoint).success


def _freshness(graph, instance: dg.DagsterInstance, name: str) -> FreshnessState:
    node = graph.get(dg.AssetKey(name))
    evaluator = {
        "eval_report": CronFreshnessPolicyEvaluator,
        "model_deployment": TimeWindowFreshnessPolicyEvaluator,
    }
    return asyncio.run(evaluator[name]().evaluate_freshness(LoadingContextForTest(instance), node))


def test_the_policies_follow_the_configured_schedule(graph) -> None:
    schedule = pipeline_config().schedule
    policy = graph.get(dg.AssetKey("eval_report")).freshness_policy
    deadline = (schedule.nightly_retrain_hour_utc + schedule.nightly_deadline_hours) % 24
    assert policy.deadline_cron == f"0 {deadline} * * *"
    assert policy.lower_bound_delta.total_seconds() == schedule.nightly_deadline_hours * 3600
    assert graph.get(dg.AssetKey("model_deployment")).freshness_policy is not None
    later = nightly_freshness(ScheduleConfig(nightly_retrain_hour_utc=22, nightly_deadline_hours=4))
    assert later["eval_report"].deadline_cron == "0 2 * * *"  # past midnight


def test_a_night_without_an_evaluation_is_overdue_and_fresh_after_a_run(graph) -> None:
    schedule = pipeline_config().schedule
    night, deadline = (
        schedule.nightly_retrain_hour_utc,
        schedule.nightly_retrain_hour_utc + schedule.nightly_deadline_hours,
    )
    assert deadline < 24  # the hours below are on the schedule's day (the shipped schedule: 02:00, 6 hours)
    with dg.instance_for_test() as instance:
        with freeze_time(_at(20, 0)):
            assert _freshness(graph, instance, "eval_report") == FreshnessState.UNKNOWN  # never evaluated
        with freeze_time(_at(20, night, 30)):
            _materialize(graph, instance, "eval_report", "ckpt-night-1")  # night 1, in its window
        with freeze_time(_at(20, deadline, 1)):
            assert _freshness(graph, instance, "eval_report") == FreshnessState.PASS
        with freeze_time(_at(21, deadline, 1)):  # night 2 passed its deadline without an evaluation
            assert _freshness(graph, instance, "eval_report") == FreshnessState.FAIL
        with freeze_time(_at(21, deadline, 30)):
            _materialize(graph, instance, "eval_report", "ckpt-night-2")  # late, by hand
        with freeze_time(_at(21, deadline, 31)):
            assert _freshness(graph, instance, "eval_report") == FreshnessState.PASS


def test_a_held_back_night_warns_about_the_deployment_and_a_week_fails_it(graph) -> None:
    with dg.instance_for_test() as instance:
        with freeze_time(_at(20, 3)):
            _materialize(graph, instance, "model_deployment", "ckpt-night-1")
        with freeze_time(_at(20, 12)):
            assert _freshness(graph, instance, "model_deployment") == FreshnessState.PASS
        with freeze_time(_at(22, 3)):  # two nights held back by the gate
            assert _freshness(graph, instance, "model_deployment") == FreshnessState.WARN
        with freeze_time(_at(27, 4)):
            assert _freshness(graph, instance, "model_deployment") == FreshnessState.FAIL
