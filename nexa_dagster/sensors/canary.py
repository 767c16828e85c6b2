"""Show the serving service's canary in Dagster's UI, apart from the deployment's run, and keep the MLflow alias with a
promotion (issue 50).

Every 15 s the sensor asks the serving service of this data root for its status: a running canary's new figures
(share, stable, per figure its interval, limit and n per arm) and each decision (verdict, reason) become
observations of ``model_deployment``'s partition (the canary's checkpoint), once each; after a promotion, the alias
``production`` is moved to the promoted version if it is not there, so a deployment run that died after starting its
canary does not leave the alias behind the pointer. What to report is ``core/serving/canary_watch.py``'s; the cursor
is Dagster's, so a restarted daemon goes on from it. Stopping a canary: ``stop_canary_job`` (``jobs/canary.py``).
"""

from __future__ import annotations

import dagster as dg

from nexa_dagster.assets.partitions import checkpoint_partitions
from nexa_dagster.automation import sensor_default_status
from nexa_dagster.core.evaluation.promotion import ProductionRegistry
from nexa_dagster.core.serving.canary_watch import WatchCursor, follow_promotion, recorded_decision, watch
from nexa_dagster.core.serving.client import ServingServiceClient
from nexa_dagster.resources.configs import PromotionResource
from nexa_dagster.resources.storage import StorageResource
from nexa_dagster.resources.tracking import TrackingResource

DEPLOYMENT = dg.AssetKey("model_deployment")


@dg.sensor(
    minimum_interval_seconds=15,
    default_status=sensor_default_status(),
    description="Shows the serving service's canary on model_deployment's partition (its figures after each check "
    "that changed them, its decision with the reason) and, after a promotion, moves the MLflow alias "
    "`production` to it if a deployment run did not. Stop a canary with stop_canary_job.",
)
def canary_sensor(
    context: dg.SensorEvaluationContext,
    storage: StorageResource,
    tracking: TrackingResource,
    promotion_policy: PromotionResource,
) -> dg.SensorResult | dg.SkipReason:
    serving_dir = storage.serving_dir()
    service = ServingServiceClient.find(serving_dir)
    if service is None:
        return dg.SkipReason(f"no serving service runs for {serving_dir}: no canary to watch")
    cursor, reset = WatchCursor.parse(context.cursor)
    if reset:
        context.log.warning(reset)
    status = service.status()
    recorded, unreadable = (None, None) if status.get("last_canary") else recorded_decision(serving_dir)
    if unreadable:
        context.log.error(f"{unreadable}; the serving service keeps the stable model")
    seen = watch(status, recorded, cursor)
    alias = None
    # follow_promotion raises when MLflow fails: the tick fails, its cursor is not kept, and it is tried again
    if seen.promoted is not None:
        pointer = ProductionRegistry(storage.production_pointer()).current()
        registered = promotion_policy.policy().registered_model
        alias = follow_promotion(tracking, registered, seen.promoted, pointer)
        context.log.info(f"canary {seen.promoted} promoted: {alias}")
    known = set(context.instance.get_dynamic_partitions(checkpoint_partitions.name))
    events = [
        dg.AssetObservation(
            DEPLOYMENT,
            partition=r.checkpoint_id if r.checkpoint_id in known else None,
            description=r.description,
            metadata={**r.metadata, **({"production_alias": alias} if alias and r.promoted else {})},
        )
        for r in seen.reports
    ]
    summary = seen.summary + (f" (and: {unreadable})" if unreadable else "")
    if not events:
        return dg.SensorResult(skip_reason=summary, cursor=seen.cursor.dump())
    return dg.SensorResult(asset_events=events, cursor=seen.cursor.dump())
