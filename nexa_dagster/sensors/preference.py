"""The preference stage's automation: a new SFT model in production answers the new days' prompts, and new pairs
train a DPO checkpoint (which the checkpoint sensor then evaluates and gates like any checkpoint).

* ``pairs_after_promotion``: when the production pointer names an SFT checkpoint that has not yet answered, it
  requests ``preference_pairs`` for every day with judged samples and no pairs yet (run key: day and production).
* ``preference_training_after_pairs``: when ``preference_pairs`` has materializations newer than the last
  ``preference_training_job`` (and none of its runs is in flight), it requests one training on all pairs so far.
"""

from __future__ import annotations

import dagster as dg

from nexa_dagster.automation import sensor_default_status
from nexa_dagster.core.common import storage as io
from nexa_dagster.core.evaluation.promotion import ProductionRegistry
from nexa_dagster.jobs import preference_pairs_job, preference_training_job
from nexa_dagster.resources.scale import ScaleResource
from nexa_dagster.resources.storage import StorageResource
from nexa_dagster.sensors.retrain import IN_FLIGHT

FILTERED, PAIRS = dg.AssetKey("filtered_samples"), dg.AssetKey("preference_pairs")


def production_stage(storage: StorageResource) -> tuple[str | None, str]:
    """(the production checkpoint's id, its stage: sft, preference, ...) or (None, "")."""
    production = ProductionRegistry(storage.production_pointer()).current()
    if production is None:
        return None, ""
    record = io.join(production.checkpoint_path, "checkpoint.json")
    stage = io.read_json(record).get("stage", "sft") if io.exists(record) else "sft"
    return production.checkpoint_id, stage


@dg.sensor(
    job=preference_pairs_job,
    minimum_interval_seconds=60,
    default_status=sensor_default_status(),
    description="When a new SFT model is promoted, its answers to the days without pairs become preference pairs.",
)
def pairs_after_promotion(
    context: dg.SensorEvaluationContext, storage: StorageResource, scale_preset: ScaleResource
) -> dg.SensorResult | dg.SkipReason:
    if scale_preset.load().preference is None:
        return dg.SkipReason(f"scale preset {scale_preset.name!r} has no preference stage")
    production, stage = production_stage(storage)
    if production is None or stage != "sft":
        return dg.SkipReason(
            f"production is {production or 'nothing'} ({stage or 'none'}): pairs come from a "
            "newly promoted SFT model"
        )
    if context.cursor == production:
        return dg.SkipReason(f"{production} has answered already")
    judged = context.instance.get_materialized_partitions(FILTERED)
    paired = context.instance.get_materialized_partitions(PAIRS)
    days = sorted(judged - paired)
    requests = [dg.RunRequest(run_key=f"pairs-{day}-{production}", partition_key=day) for day in days]
    return dg.SensorResult(
        run_requests=requests,
        cursor=production,
        skip_reason=None if requests else f"every judged day has pairs ({production})",
    )


@dg.sensor(
    job=preference_training_job,
    minimum_interval_seconds=60,
    default_status=sensor_default_status(),
    description="Trains a DPO checkpoint once new preference pairs have landed and no pairs run is in flight.",
)
def preference_training_after_pairs(context: dg.SensorEvaluationContext) -> dg.SensorResult | dg.SkipReason:
    instance = context.instance
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=PAIRS), limit=1, ascending=False
    )
    newest = records.records[0].storage_id if records.records else 0
    if newest <= int(context.cursor or 0):
        return dg.SkipReason("no preference pairs since the last DPO training")
    if instance.get_runs(dg.RunsFilter(job_name=preference_pairs_job.name, statuses=IN_FLIGHT)):
        return dg.SkipReason("preference pairs runs in flight: training waits for all of them")
    failed = days_whose_pairs_failed(instance, int(context.cursor or 0))
    if failed:
        return dg.SkipReason(
            f"the latest pairs of {', '.join(failed)} failed their blocking check (pairs_are_trainable): DPO waits "
            "until those days' pairs are made again and pass"
        )
    return dg.SensorResult(run_requests=[dg.RunRequest(run_key=f"dpo-after-{newest}")], cursor=str(newest))


def days_whose_pairs_failed(instance: dg.DagsterInstance, after: int) -> list[str]:
    """The days materialized after storage id ``after`` whose latest pairs came from a failed run: a blocking check
    (pairs_are_trainable) fails the run after the pairs are written, and a failed run never feeds DPO."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=PAIRS, after_storage_id=after), limit=10_000, ascending=True
    ).records
    latest = {r.partition_key: r for r in records}  # ascending: the last one of each day wins
    failed = []
    for day, record in sorted(latest.items(), key=lambda kv: str(kv[0])):
        run = instance.get_run_by_id(record.run_id)
        if run is not None and run.status == dg.DagsterRunStatus.FAILURE:
            failed.append(str(day))
    return failed
