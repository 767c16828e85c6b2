"""Training stage: the packed dataset trains a Mixture-of-Experts checkpoint with DeepSpeed, off-process.

The asset never trains in the Dagster process: the GPU-cluster resource launches the DeepSpeed worker (locally,
or later on Slurm/Kubernetes) and streams its logs and metrics back through Dagster Pipes.
"""


import datetime as dt
from pathlib import Path

import dagster as dg

from nexa_dagster.assets.common import MODEL_CALL_RETRY
from nexa_dagster.assets.partitions import checkpoint_partitions
from nexa_dagster.core import storage as io
from nexa_dagster.core.artifacts import Checkpoint, SFTDataset
from nexa_dagster.core.config import load_deepspeed_config, load_scale
from nexa_dagster.core.plots import loss_curve_png, markdown_image
from nexa_dagster.core.promotion import load_policy
from nexa_dagster.core.tiny_model import COMPLETION_MARKER
from nexa_dagster.core.training.job import TrainingJob
from nexa_dagster.resources.gpu_cluster import GPUClusterResource
from nexa_dagster.resources.storage import StorageResource
from nexa_dagster.resources.tracking import TrackingResource


def checkpoint_id_for(context: dg.AssetExecutionContext, storage: StorageResource) -> str:
    """One id per training, kept by step retries and run re-executions so that they resume its saved state.

    The id comes from the root run of a re-execution chain; if that training already completed (a deliberate
    re-execution to train again), this run gets an id of its own.
    """
    root = context.run.root_run_id or context.run.run_id
    record = context.instance.get_run_record_by_id(root)
    created = record.create_timestamp if record is not None else dt.datetime.now(dt.UTC)
    checkpoint_id = f"ckpt-{created:%Y%m%d-%H%M%S}-{root[:8]}"
    if (Path(storage.checkpoint_dir(checkpoint_id)) / COMPLETION_MARKER).exists():
        checkpoint_id = f"ckpt-{dt.datetime.now(dt.UTC):%Y%m%d-%H%M%S}-{context.run.run_id[:8]}"
    return checkpoint_id


@dg.asset(
    group_name="training",
    pool="gpu",
    retry_policy=MODEL_CALL_RETRY,
    kinds={"deepspeed", "pytorch"},
    description="A Mixtral-architecture MoE causal LM trained with the DeepSpeed engine on sft_dataset, saved as "
                "a Hugging Face checkpoint (safetensors, config, tokenizer) in data/checkpoints/<checkpoint_id>/.",
)
def moe_checkpoint(context: dg.AssetExecutionContext, sft_dataset: SFTDataset, gpu_cluster: GPUClusterResource,
                   storage: StorageResource, tracking: TrackingResource) -> dg.Output[Checkpoint]:
    scale = load_scale()
    checkpoint_id = checkpoint_id_for(context, storage)
    job = TrainingJob(
        run_id=checkpoint_id, train_path=sft_dataset.train_path, validation_path=sft_dataset.validation_path,
        tokenizer_path=sft_dataset.tokenizer_path, model_preset=scale.model_preset,
        deepspeed_config=load_deepspeed_config(scale.deepspeed_config), settings=scale.training,
        output_dir=str(storage.checkpoint_dir(checkpoint_id)), dataset_run_hash=sft_dataset.run_hash,
        accelerator=gpu_cluster.accelerator,
    )
    work_dir = io.local_dir(storage.path("runs", checkpoint_id))
    context.log.info(f"launching training of {checkpoint_id} ({scale.model_preset}, {scale.training.max_steps} "
                     f"steps) on the {gpu_cluster.backend} cluster")
    result, invocation = gpu_cluster.run_training(context, job, work_dir)

    png = loss_curve_png(result.loss_curve, f"{checkpoint_id} ({scale.model_preset})", result.validation_loss)
    (Path(result.checkpoint_dir) / "loss_curve.png").write_bytes(png)
    with tracking.start_run(run_name=checkpoint_id, tags={"stage": "training",
                                                           "dagster_run_id": context.run.run_id}) as run:
        run.log_params({"model_preset": scale.model_preset, "scale": scale.name,
                        "dataset_run_hash": sft_dataset.run_hash, **scale.training.model_dump()})
        for step, loss in result.loss_curve:
            run.log_metrics({"train_loss": loss}, step=step)
        run.log_artifact(Path(result.checkpoint_dir) / "loss_curve.png")
        run.log_metrics({"validation_loss": result.validation_loss, "tokens_per_s": result.tokens_per_s})
        mlflow_run_id = run.run_id

    # the checkpoint's own record: what it is and what it came from (read by evaluation, also for hand copies)
    checkpoint = Checkpoint(
        checkpoint_id=checkpoint_id, path=result.checkpoint_dir, num_steps=result.steps,
        training_loss=result.final_loss, validation_loss=result.validation_loss,
        dataset_run_hash=sft_dataset.run_hash, dataset_validation_path=sft_dataset.validation_path,
        model_preset=scale.model_preset, scale=scale.name, parameters_total=result.parameters_total,
        parameters_active=result.parameters_active, training_run_id=context.run.run_id,
        mlflow_run_id=mlflow_run_id,
    )
    io.write_json(checkpoint.model_dump(), io.join(result.checkpoint_dir, "checkpoint.json"))
    model_name = load_policy().registered_model
    version = tracking.register_checkpoint(model_name, checkpoint_id, result.checkpoint_dir, mlflow_run_id)
    context.instance.add_dynamic_partitions(checkpoint_partitions.name, [checkpoint_id])

    # what the worker reported through Pipes, merged into this asset's own materialization (a step that opened
    # a Pipes session must return typed results: an Output, not a bare value)
    worker_metadata = {f"worker/{k}": v for k, v in invocation.get_materialize_result().metadata.items()}
    return dg.Output(checkpoint, metadata={
        **worker_metadata,
        "loss_curve": dg.MetadataValue.md(markdown_image(png, "training loss")),
        "checkpoint_id": checkpoint_id,
        "checkpoint_path": dg.MetadataValue.path(result.checkpoint_dir),
        "steps": result.steps,
        "final_train_loss": result.final_loss,
        "validation_loss": result.validation_loss,
        "tokens_seen": result.tokens_seen,
        "tokens_per_s": round(result.tokens_per_s, 1),
        "wall_s": round(result.wall_s, 1),
        "parameters_total": result.parameters_total,
        "parameters_active": result.parameters_active,
        "dataset_run_hash": sft_dataset.run_hash,
        "mlflow_run_id": mlflow_run_id,
        "mlflow_model_version": f"{model_name}/{version}",
    })


@dg.asset_check(asset=moe_checkpoint, description="The checkpoint loads with plain transformers "
                                                  "(AutoModelForCausalLM) and gives finite logits.")
def checkpoint_loads_with_transformers(moe_checkpoint: Checkpoint) -> dg.AssetCheckResult:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(moe_checkpoint.path)
    model = AutoModelForCausalLM.from_pretrained(moe_checkpoint.path)
    ids = tokenizer("def f(x): return x", return_tensors="pt")
    with torch.no_grad():
        logits = model(**ids).logits
    finite = bool(torch.isfinite(logits).all())
    return dg.AssetCheckResult(passed=finite, metadata={"architecture": model.config.architectures[0],
                                                        "num_experts": model.config.num_local_experts,
                                                        "logits_finite": finite})
