"""Retrain when a day's data has been processed: the second link of the nightly chain.

The nightly schedule processes a day (``daily_data_job``); when that run succeeds, this sensor starts
``training_job`` on the new snapshot, unless the day added no filtered samples, in which case retraining would
train on the same data again and the sensor says so instead.
"""


import dagster as dg

from nexa_dagster.jobs import daily_data_job, training_job


def filtered_rows_in_run(instance: dg.DagsterInstance, run_id: str) -> int | None:
    """Rows the run's ``filtered_samples`` materializations reported (None if it materialized none)."""
    records = instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION).records
    counts = []
    for record in records:
        mat = record.event_log_entry.asset_materialization
        if mat and mat.asset_key == dg.AssetKey("filtered_samples"):
            value = mat.metadata.get("dagster/row_count")
            counts.append(int(value.value) if value is not None else 0)
    return sum(counts) if counts else None


@dg.run_status_sensor(run_status=dg.DagsterRunStatus.SUCCESS, monitored_jobs=[daily_data_job],
                      request_job=training_job, default_status=dg.DefaultSensorStatus.RUNNING,
                      description="After a successful daily_data_job run, train on the new snapshot.")
def retrain_after_ingest(context: dg.RunStatusSensorContext) -> dg.RunRequest | dg.SkipReason:
    run = context.dagster_run
    rows = filtered_rows_in_run(context.instance, run.run_id)
    days = run.tags.get("dagster/partition") or run.tags.get("dagster/asset_partition_range_start", "?")
    if not rows:
        return dg.SkipReason(f"run {run.run_id[:8]} ({days}) added no filtered samples: not retraining on the "
                             "same data")
    return dg.RunRequest(run_key=f"retrain-after-{run.run_id}", tags={"nexa/triggered_by": run.run_id})
