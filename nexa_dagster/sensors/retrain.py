"""Retrain when the data has changed: the second link of the nightly chain, once per new snapshot.

``training_job`` packages every filtered sample so far, so what a training reads is the set of ``filtered_samples``
materializations in the instance. This sensor requests one training when that set has grown since the last
training started (or was requested by this sensor), and only once the data runs in flight are done: a nightly run
gives one training, and a ten-day backfill one training on the whole snapshot, not ten trainings on the same one.
A day that added no filtered samples retrains nothing, and the sensor says so.
"""

from __future__ import annotations

import dagster as dg
from dagster._core.execution.backfill import BulkActionStatus

from nexa_dagster.automation import sensor_default_status
from nexa_dagster.jobs import daily_data_job, training_job

FILTERED = dg.AssetKey("filtered_samples")
IN_FLIGHT = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
]


def latest_filtered_storage_id(instance: dg.DagsterInstance, before_timestamp: float | None = None) -> int:
    """The event-log id of the newest ``filtered_samples`` materialization (0 if none), optionally before a time."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=FILTERED, before_timestamp=before_timestamp), limit=1, ascending=False
    ).records
    return records[0].storage_id if records else 0


def trained_up_to(instance: dg.DagsterInstance) -> int:
    """The newest ``filtered_samples`` materialization the last training run could read (it started after it):
    the data a training started by hand or by an earlier sensor tick has already been trained on."""
    records = instance.get_run_records(dg.RunsFilter(job_name=training_job.name), limit=1)
    return latest_filtered_storage_id(instance, records[0].create_timestamp.timestamp()) if records else 0


def new_filtered_rows(instance: dg.DagsterInstance, after_storage_id: int) -> tuple[int, int]:
    """(materializations, rows) of ``filtered_samples`` recorded after an event-log id."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=FILTERED, after_storage_id=after_storage_id), limit=10_000
    ).records
    rows = 0
    for record in records:
        value = (
            record.asset_materialization.metadata.get("dagster/row_count")
            if record.asset_materialization
            else None
        )
        rows += int(value.value) if value is not None else 0
    return len(records), rows


def data_runs_in_flight(instance: dg.DagsterInstance) -> int:
    """``daily_data_job`` runs queued or running, plus backfills of it still submitting runs."""
    runs = instance.get_runs(dg.RunsFilter(job_name=daily_data_job.name, statuses=IN_FLIGHT))
    backfills = [
        b
        for b in instance.get_backfills(status=BulkActionStatus.REQUESTED)
        if b.job_name == daily_data_job.name or FILTERED in (b.asset_selection or [])
    ]
    return len(runs) + len(backfills)


@dg.sensor(
    job=training_job,
    minimum_interval_seconds=60,
    default_status=sensor_default_status(),
    description="Trains on the new snapshot once new filtered samples have landed and the data runs in "
    "flight (a nightly run, a backfill's runs) are done: one training per new snapshot.",
)
def retrain_after_ingest(context: dg.SensorEvaluationContext) -> dg.SensorResult:
    instance = context.instance
    # the cursor: the newest filtered_samples materialization this sensor has requested a training for
    baseline = max(int(context.cursor or 0), trained_up_to(instance))
    latest = latest_filtered_storage_id(instance)
    if latest <= baseline:
        return dg.SensorResult(
            skip_reason="no new filtered samples since the last training started", cursor=str(baseline)
        )
    waiting = data_runs_in_flight(instance)
    if waiting:
        return dg.SensorResult(
            skip_reason=f"new filtered samples, waiting for {waiting} daily_data_job run(s) or "
            "backfill(s) in flight to finish, to train once on the whole snapshot",
            cursor=context.cursor,
        )
    materializations, rows = new_filtered_rows(instance, baseline)
    if not rows:
        return dg.SensorResult(
            skip_reason=f"{materializations} new filtered_samples materialization(s) added no "
            "filtered samples: not retraining on the same data",
            cursor=str(latest),
        )
    context.log.info(
        f"{rows} new filtered samples in {materializations} materialization(s): training once on them"
    )
    return dg.SensorResult(
        run_requests=[
            dg.RunRequest(run_key=f"retrain-{latest}", tags={"nexa/filtered_samples_up_to": str(latest)})
        ],
        cursor=str(latest),
    )
