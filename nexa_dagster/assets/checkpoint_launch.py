"""One launch-and-record path for every trained checkpoint: pretraining (``base_model``), SFT (``moe_checkpoint``),
DPO (``preference_checkpoint``) and GRPO (``rl_checkpoint``).

Each stage builds its ``TrainingJob`` and says what is its own (``StageRecord``: the MLflow stage, the curve's
label, the parameters, and ``figures``, the pluggable part that turns the worker's result into the stage's
final metrics, record fields and metadata); ``launch_and_record`` then does what every one of them does, in one
order: launch the worker on the GPU cluster through Dagster Pipes, log the run to MLflow with its loss curve,
write the checkpoint's record beside its weights, publish it (``registered``: a model version and the
``checkpoints`` partition evaluation runs on; a base model: its ``base_models`` partition) and return it with its
metadata. A fourth stage adds a ``StageRecord``, not a fifth copy of the sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from nexa_dagster.assets.training_record import (
    log_training_run,
    publish_checkpoint,
    training_metadata,
    write_checkpoint_record,
)
from nexa_dagster.core.common import storage as io
from nexa_dagster.core.common.artifacts import Checkpoint
from nexa_dagster.core.common.config import ScalePreset
from nexa_dagster.core.common.spans import span
from nexa_dagster.core.training.job import TrainingJob, TrainingResult
from nexa_dagster.resources.gpu_cluster import GPUClusterResource
from nexa_dagster.resources.scale import ScaleResource
from nexa_dagster.resources.storage import StorageResource
from nexa_dagster.resources.tracking import TrackingResource


@dataclass(frozen=True)
class StageFigures:
    """What one stage makes of a finished training: MLflow's final metrics (None values are left out), extra
    fields of the checkpoint's record, and extra metadata of the materialization."""

    final_metrics: dict[str, float | None] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StageRecord:
    """What differs between the stages' trainings: their MLflow stage tag, title and curve label, the run's
    parameters and record fields known before the launch, and ``figures`` (the pluggable part)."""

    stage: str  # MLflow's stage tag: training | preference | rl
    title: str
    curve_label: str
    launch_message: str
    params: dict[str, Any]
    record: dict[str, Any]
    figures: Callable[[TrainingResult], StageFigures]
    metadata: dict[str, Any] = field(
        default_factory=dict
    )  # known before the launch (the production it started from)


Publish = Callable[[Checkpoint], dict[str, Any]]


def preset_on_cluster(
    scale: ScalePreset, scale_preset: ScaleResource, gpu_cluster: GPUClusterResource
) -> dict[str, Any]:
    """The ``TrainingJob`` fields every stage's training shares: the scale's model preset, trained with the scale's
    DeepSpeed configuration on the GPU cluster's accelerator."""
    return {
        "model_preset": scale.model_preset,
        "deepspeed_config": scale_preset.deepspeed_config(),
        "accelerator": gpu_cluster.accelerator,
    }


def origin(scale: ScalePreset, job: TrainingJob) -> dict[str, str]:
    """What the MLflow parameters and the record of every post-trained checkpoint say of where it came from: the
    model preset, the scale preset, and the parent it started from."""
    return {"model_preset": scale.model_preset, "scale": scale.name, "parent": job.parent}


def registered(
    context: dg.AssetExecutionContext, tracking: TrackingResource, registered_model: str
) -> Publish:
    """Publishing as every post-trained checkpoint is published: a model version in MLflow, and the
    ``checkpoints`` partition evaluation_job runs on next."""

    def publish(checkpoint: Checkpoint) -> dict[str, Any]:
        return {"mlflow_model_version": publish_checkpoint(context, tracking, registered_model, checkpoint)}

    return publish


def launch_and_record(
    context: dg.AssetExecutionContext,
    job: TrainingJob,
    stage: StageRecord,
    gpu_cluster: GPUClusterResource,
    storage: StorageResource,
    tracking: TrackingResource,
    publish: Publish,
) -> dg.Output[Checkpoint]:
    """Train ``job`` off-process and write it down: Pipes launch, MLflow run, ``checkpoint.json``, ``publish``
    (returns metadata of its own), and the materialization's metadata."""
    context.log.info(f"{stage.launch_message} on the {gpu_cluster.backend} cluster")
    result, invocation = gpu_cluster.run_training(
        context, job, io.local_dir(storage.path("runs", job.run_id))
    )
    figures = stage.figures(result)
    with span(context.log.info, "fixed", "mlflow"):
        png, mlflow_run_id = log_training_run(
            context,
            tracking,
            result,
            run_name=job.run_id,
            stage=stage.stage,
            title=stage.title,
            params=stage.params,
            final_metrics={k: v for k, v in figures.final_metrics.items() if v is not None},
        )
    # the checkpoint's own record: what it is and what it came from (read by evaluation, also for hand copies)
    checkpoint = write_checkpoint_record(
        context,
        result,
        storage.root,
        checkpoint_id=job.run_id,
        mlflow_run_id=mlflow_run_id,
        dataset_run_hash=job.dataset_run_hash,
        **stage.record,
        **figures.record,
    )
    with span(context.log.info, "fixed", "mlflow_register"):
        published = publish(checkpoint)
    return dg.Output(
        checkpoint,
        metadata={
            **training_metadata(invocation, png, result, stage.curve_label),
            "checkpoint_id": job.run_id,
            "parent": job.parent,
            "dataset_run_hash": job.dataset_run_hash,
            "mlflow_run_id": mlflow_run_id,
            **published,
            **stage.metadata,
            **figures.metadata,
        },
    )
