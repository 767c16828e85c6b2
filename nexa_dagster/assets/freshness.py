"""Freshness policies on the nightly's outputs, from the schedule in ``configs/pipeline.yaml``.

A nightly retrain that silently stops (the schedule turned off, a sensor erroring, training failing every night)
leaves every asset looking as it did; a freshness policy makes the UI (and an alert on it) say so:

* ``eval_report``: the night's snapshot is evaluated between the schedule's hour (``nightly_retrain_hour_utc``) and
  ``nightly_deadline_hours`` later, every day. Missing that window, the asset fails its policy at the deadline, and
  passes again as soon as an evaluation is recorded (a late night, or one run by hand).
* ``model_deployment``: a night whose candidate the gate holds back deploys nothing, and that is a decision, not a
  failure: the deployment warns after a day and a deadline without one, and fails after a week without any.

Dagster's daemon (``make ui``) evaluates the policies (its FreshnessDaemon) and the asset's page shows the state.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import dagster as dg

from nexa_dagster.core.common.config import ScheduleConfig

NO_DEPLOYMENT_FAILS_AFTER = timedelta(
    days=7
)  # a week of held-back nights: the retrain has stalled, not the gate


def nightly_freshness(schedule: ScheduleConfig) -> dict[str, dg.FreshnessPolicy]:
    """The policy of each nightly output, from the schedule's hour and its deadline."""
    window = timedelta(hours=schedule.nightly_deadline_hours)
    deadline_hour = (schedule.nightly_retrain_hour_utc + schedule.nightly_deadline_hours) % 24
    return {
        "eval_report": dg.FreshnessPolicy.cron(
            deadline_cron=f"0 {deadline_hour} * * *", lower_bound_delta=window, timezone="UTC"
        ),
        "model_deployment": dg.FreshnessPolicy.time_window(
            fail_window=NO_DEPLOYMENT_FAILS_AFTER, warn_window=timedelta(days=1) + window
        ),
    }


def with_freshness(assets: Iterable[Any], schedule: ScheduleConfig) -> list[Any]:
    """The assets, the nightly outputs given their freshness policy."""
    policies = nightly_freshness(schedule)

    def fresh(spec: dg.AssetSpec) -> dg.AssetSpec:
        policy = policies.get(spec.key.to_user_string())
        return spec.replace_attributes(freshness_policy=policy) if policy else spec

    return [a.map_asset_specs(fresh) if isinstance(a, dg.AssetsDefinition) else a for a in assets]
