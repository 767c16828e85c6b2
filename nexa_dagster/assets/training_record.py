"""What every training asset does with a finished worker's result: the loss curve, the MLflow run, the checkpoint's
record, the metadata.

``base_model`` (pretraining), ``moe_checkpoint`` (SFT) and ``preference_checkpoint`` (DPO) differ in their data and
their record's fields, not in how a training is written down; one function each keeps them from drifting apart.
"""

from pathlib import Path
from typing import Any

import dagster as dg

from nexa_dagster.assets.partitions import checkpoint_partitions
from nexa_dagster.core.common import storage as io
from nexa_dagster.core.common.artifacts import Checkpoint
from nexa_dagster.core.common.plots import loss_curve_png, markdown_image
from nexa_dagster.core.training.job import TrainingResult
from nexa_dagster.resources.tracking import TrackingResource


def log_training_run(
    context: dg.AssetExecutionContext,
    tracking: TrackingResource,
    result: TrainingResult,
    *,
    run_name: str,
    stage: str,
    title: str,
    params: dict[str, Any],
    final_metrics: dict[str, float],
) -> tuple[bytes, str]:
    """Write the loss curve beside the checkpoint and record the training as an MLflow run.

    The run holds ``params``, the train-loss curve step by step, the curve's PNG as an artifact and
    ``final_metrics``. Returns the PNG (for the asset's page) and the MLflow run id (for the checkpoint's record).
    """
    png = loss_curve_png(result.loss_curve, title, result.validation_loss)
    curve = Path(result.checkpoint_dir) / "loss_curve.png"
    curve.write_bytes(png)
    with tracking.start_run(
        run_name=run_name, tags={"stage": stage, "dagster_run_id": context.run.run_id}
    ) as run:
        run.log_params(params)
        for step, loss in result.loss_curve:
            run.log_metrics({"train_loss": loss}, step=step)
        run.log_artifact(curve)
        run.log_metrics(final_metrics)
        return png, run.run_id


def write_checkpoint_record(
    context: dg.AssetExecutionContext,
    result: TrainingResult,
    data_root: str,
    *,
    checkpoint_id: str,
    mlflow_run_id: str,
    **fields: Any,
) -> Checkpoint:
    """The checkpoint's own record, ``checkpoint.json`` beside its weights: what it is and what it came from (read
    by evaluation, also for hand copies), its paths relative to the data root so a moved root keeps it valid.

    ``fields``: what differs by stage (``stage``, ``parent``, the dataset's hash and validation path, ...)."""
    checkpoint = Checkpoint(
        checkpoint_id=checkpoint_id,
        path=result.checkpoint_dir,
        num_steps=result.steps,
        training_loss=result.final_loss,
        validation_loss=result.validation_loss,
        parameters_total=result.parameters_total,
        parameters_active=result.parameters_active,
        training_run_id=context.run.run_id,
        mlflow_run_id=mlflow_run_id,
        **fields,
    )
    io.write_json(checkpoint.record(data_root), io.join(result.checkpoint_dir, "checkpoint.json"))
    return checkpoint


def publish_checkpoint(
    context: dg.AssetExecutionContext,
    tracking: TrackingResource,
    registered_model: str,
    checkpoint: Checkpoint,
) -> str:
    """Register the checkpoint in the MLflow model registry and give it its ``checkpoints`` partition, which is
    what ``new_checkpoint_sensor`` and a backfill of ``eval_report`` evaluate next. Returns ``<model>/<version>``."""
    version = tracking.register_checkpoint(
        registered_model, checkpoint.checkpoint_id, checkpoint.path, checkpoint.mlflow_run_id
    )
    context.instance.add_dynamic_partitions(checkpoint_partitions.name, [checkpoint.checkpoint_id])
    return f"{registered_model}/{version}"


def training_metadata(
    invocation: dg.PipesClientCompletedInvocation, png: bytes, result: TrainingResult, curve_label: str
) -> dict[str, Any]:
    """The metadata every training materialization starts with: what the worker reported through Pipes (a step
    that opened a Pipes session must return typed results, so it is merged here), the loss curve and the run's
    size and speed."""
    return {
        **{f"worker/{k}": v for k, v in invocation.get_materialize_result().metadata.items()},
        "loss_curve": dg.MetadataValue.md(markdown_image(png, curve_label)),
        "checkpoint_path": dg.MetadataValue.path(result.checkpoint_dir),
        "steps": result.steps,
        "final_train_loss": result.final_loss,
        "tokens_seen": result.tokens_seen,
        "wall_s": round(result.wall_s, 1),
        "parameters_total": result.parameters_total,
    }
