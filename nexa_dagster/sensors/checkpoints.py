"""Evaluate every new checkpoint exactly once, wherever it came from, and again when its evaluation failed.

The sensor watches the checkpoint store (``<data_root>/checkpoints/``) and the MLflow model registry (a training
job outside Dagster registers its checkpoint there). A checkpoint counts once its completion
marker exists, so a half-written or half-copied directory is left alone until it is complete. Exactly-once comes
from three layers: the cursor (ids requested, with how many runs), run keys (``evaluate-<id>``; Dagster drops a
duplicate request), and a check that the partition was not already evaluated (e.g. by ``make run``). A checkpoint
is only done once it has an evaluation: when every run for it failed, it is requested again, a bounded number of
times (``MAX_EVALUATION_ATTEMPTS``), and after that the skip reason names it and the command that retries it.
"""

import json
from pathlib import Path

import dagster as dg

from nexa_dagster.assets.partitions import checkpoint_partitions
from nexa_dagster.automation import sensor_default_status
from nexa_dagster.core.common.artifacts import COMPLETION_MARKER
from nexa_dagster.jobs import evaluation_job
from nexa_dagster.resources.configs import PromotionResource
from nexa_dagster.resources.storage import StorageResource
from nexa_dagster.resources.tracking import TrackingResource


def complete_checkpoints(store: Path) -> list[str]:
    if not store.is_dir():
        return []
    return sorted(
        p.name
        for p in store.iterdir()
        if p.is_dir() and not p.name.startswith(".") and (p / COMPLETION_MARKER).exists()
    )


def registered_complete_checkpoints(tracking: TrackingResource, registered_model: str) -> list[str]:
    """Checkpoints registered in the MLflow model registry (e.g. by a training job outside Dagster) whose
    directory is complete."""
    registered = tracking.registered_checkpoints(registered_model)
    return sorted(c for c, src in registered.items() if (Path(src) / COMPLETION_MARKER).exists())


MAX_EVALUATION_ATTEMPTS = 3
RETRY_COMMAND = (
    "dagster asset materialize -m nexa_dagster.definitions --select eval_report,model_deployment "
    "--partition {checkpoint}"
)
FINISHED_BADLY = {dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED}


def read_cursor(cursor: str | None) -> dict[str, int]:
    """{checkpoint id: evaluation runs requested}; an older cursor (a list of handled ids) counts one each."""
    value = json.loads(cursor) if cursor else {}
    return {c: 1 for c in value} if isinstance(value, list) else value


def evaluation_runs(instance: dg.DagsterInstance, checkpoint: str) -> list[dg.DagsterRun]:
    return list(
        instance.get_runs(dg.RunsFilter(job_name=evaluation_job.name, tags={"dagster/partition": checkpoint}))
    )


@dg.sensor(
    job=evaluation_job,
    minimum_interval_seconds=30,
    default_status=sensor_default_status(),
    description="Starts evaluation_job for each complete checkpoint in the checkpoint store or the MLflow "
    f"model registry, once; an evaluation run that failed is tried again, "
    f"{MAX_EVALUATION_ATTEMPTS} runs at most.",
)
def new_checkpoint_sensor(
    context: dg.SensorEvaluationContext,
    storage: StorageResource,
    tracking: TrackingResource,
    promotion_policy: PromotionResource,
) -> dg.SensorResult:
    requested = read_cursor(context.cursor)
    registered = registered_complete_checkpoints(tracking, promotion_policy.policy().registered_model)
    found = sorted(set(complete_checkpoints(storage.checkpoints_dir())) | set(registered))
    existing = set(context.instance.get_dynamic_partitions(checkpoint_partitions.name))
    evaluated = context.instance.get_materialized_partitions(dg.AssetKey("eval_report"))
    new = [c for c in found if c not in requested]
    for c in new:
        if c in evaluated:
            context.log.info(f"{c}: already evaluated, not requesting again")
    # a checkpoint whose every evaluation run so far has failed (none in flight, none succeeded) is tried again
    retry, given_up = [], []
    for c in sorted(set(found) & set(requested) - evaluated):
        runs = evaluation_runs(context.instance, c)
        if len(runs) < requested[c] or any(r.status not in FINISHED_BADLY for r in runs):
            continue  # its run is not created yet, still in flight, or succeeded (e.g. the gate held it back)
        (retry if requested[c] < MAX_EVALUATION_ATTEMPTS else given_up).append(c)
    for c in retry:
        context.log.info(
            f"{c}: evaluation run failed; trying again ({requested[c] + 1} of {MAX_EVALUATION_ATTEMPTS})"
        )
    requests = [
        dg.RunRequest(run_key=f"evaluate-{c}", partition_key=c, tags={"nexa/checkpoint": c})
        for c in new
        if c not in evaluated
    ]
    requests += [
        dg.RunRequest(
            run_key=f"evaluate-{c}-attempt-{requested[c] + 1}", partition_key=c, tags={"nexa/checkpoint": c}
        )
        for c in retry
    ]
    cursor = json.dumps(
        {**requested, **{c: 1 for c in new}, **{c: requested[c] + 1 for c in retry}}, sort_keys=True
    )
    if not requests:
        reason = f"no new complete checkpoint ({len(found)} known)"
        if given_up:
            reason += (
                f"; evaluation failed {MAX_EVALUATION_ATTEMPTS} times, not retried: {', '.join(given_up)} "
                f"(fix the cause in the run log, then `{RETRY_COMMAND.format(checkpoint='<id>')}`)"
            )
        return dg.SensorResult(skip_reason=reason, cursor=cursor)
    return dg.SensorResult(
        run_requests=requests,
        dynamic_partitions_requests=[
            checkpoint_partitions.build_add_request([c for c in new if c not in existing])
        ],
        cursor=cursor,
    )
