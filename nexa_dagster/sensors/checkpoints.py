"""Evaluate every new checkpoint exactly once, wherever it came from.

The sensor watches the checkpoint store (``<data_root>/checkpoints/``) and the MLflow model registry (a training
job outside Dagster registers its checkpoint there). A checkpoint counts once its completion
marker exists, so a half-written or half-copied directory is left alone until it is complete. Exactly-once comes
from three layers: the cursor (ids already handled), run keys (``evaluate-<id>``; Dagster drops a duplicate
request), and a check that the partition was not already evaluated (e.g. by ``make run``).
"""


import json
from pathlib import Path

import dagster as dg

from nexa_dagster.assets.partitions import checkpoint_partitions
from nexa_dagster.core.promotion import load_policy
from nexa_dagster.core.tiny_model import COMPLETION_MARKER
from nexa_dagster.jobs import evaluation_job
from nexa_dagster.resources.storage import StorageResource
from nexa_dagster.resources.tracking import TrackingResource


def complete_checkpoints(store: Path) -> list[str]:
    if not store.is_dir():
        return []
    return sorted(p.name for p in store.iterdir()
                  if p.is_dir() and not p.name.startswith(".") and (p / COMPLETION_MARKER).exists())


def registered_complete_checkpoints(tracking: TrackingResource) -> list[str]:
    """Checkpoints registered in the MLflow model registry (e.g. by a training job outside Dagster) whose
    directory is complete."""
    registered = tracking.registered_checkpoints(load_policy().registered_model)
    return sorted(c for c, src in registered.items() if (Path(src) / COMPLETION_MARKER).exists())


@dg.sensor(job=evaluation_job, minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.RUNNING,
           description="Starts evaluation_job for each complete checkpoint in the checkpoint store or the MLflow "
                       "model registry, once.")
def new_checkpoint_sensor(context: dg.SensorEvaluationContext, storage: StorageResource,
                          tracking: TrackingResource) -> dg.SensorResult:
    seen = set(json.loads(context.cursor)) if context.cursor else set()
    found = sorted(set(complete_checkpoints(storage.checkpoints_dir())) | set(registered_complete_checkpoints(tracking)))
    new = [c for c in found if c not in seen]
    if not new:
        return dg.SensorResult(skip_reason=f"no new complete checkpoint ({len(found)} known)",
                               cursor=context.cursor)
    existing = set(context.instance.get_dynamic_partitions(checkpoint_partitions.name))
    evaluated = context.instance.get_materialized_partitions(dg.AssetKey("eval_report"))
    to_evaluate = [c for c in new if c not in evaluated]
    for c in new:
        if c in evaluated:
            context.log.info(f"{c}: already evaluated, not requesting again")
    return dg.SensorResult(
        run_requests=[dg.RunRequest(run_key=f"evaluate-{c}", partition_key=c, tags={"nexa/checkpoint": c})
                      for c in to_evaluate],
        dynamic_partitions_requests=[checkpoint_partitions.build_add_request([c for c in new if c not in existing])],
        cursor=json.dumps(sorted(seen | set(new))),
    )
