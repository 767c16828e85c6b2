"""Training stage: the packed dataset trains a Mixture-of-Experts checkpoint with DeepSpeed, off-process.

The asset never trains in the Dagster process: the GPU-cluster resource launches the DeepSpeed worker (locally,
or later on Slurm/Kubernetes) and streams its logs and metrics back through Dagster Pipes.
"""

import datetime as dt
from pathlib import Path
from typing import Any

import dagster as dg
from pydantic import Field

from nexa_dagster.assets.checkpoint_launch import (
    StageFigures,
    StageRecord,
    launch_and_record,
    origin,
    preset_on_cluster,
    registered,
)
from nexa_dagster.assets.common import IMPORTS_MODELS, MODEL_CALL_RETRY
from nexa_dagster.core.common import roots
from nexa_dagster.core.common import storage as io
from nexa_dagster.core.common.artifacts import COMPLETION_MARKER, Checkpoint, SFTDataset
from nexa_dagster.core.common.config import ScalePreset, TrainingSettings
from nexa_dagster.core.evaluation.promotion import ProductionRegistry
from nexa_dagster.core.training.init import InitSource, check_init_checkpoint, resolve
from nexa_dagster.core.training.job import TrainingJob, TrainingResult
from nexa_dagster.resources.configs import PromotionResource
from nexa_dagster.resources.gpu_cluster import GPUClusterResource
from nexa_dagster.resources.scale import ScaleResource
from nexa_dagster.resources.storage import StorageResource
from nexa_dagster.resources.tracking import TrackingResource


def checkpoint_id_for(
    context: dg.AssetExecutionContext,
    storage: StorageResource,
    prefix: str = "ckpt",
    store: str | None = None,
) -> str:
    """One id per training, kept by step retries and run re-executions so that they resume its saved state.

    The id comes from the root run of a re-execution chain; if that training already completed (a deliberate
    re-execution to train again), this run gets an id of its own. ``store``: the directory the checkpoints of
    this kind live in (default: the SFT checkpoint store).
    """
    root = context.run.root_run_id or context.run.run_id
    record = context.instance.get_run_record_by_id(root)
    created = record.create_timestamp if record is not None else dt.datetime.now(dt.UTC)
    directory = Path(store) if store else storage.checkpoints_dir()
    checkpoint_id = f"{prefix}-{created:%Y%m%d-%H%M%S}-{root[:8]}"
    if (directory / checkpoint_id / COMPLETION_MARKER).exists():
        checkpoint_id = f"{prefix}-{dt.datetime.now(dt.UTC):%Y%m%d-%H%M%S}-{context.run.run_id[:8]}"
    return checkpoint_id


class TrainingRunConfig(dg.Config):
    """Run configuration of ``moe_checkpoint`` (the Launchpad's ``ops: moe_checkpoint: config``): what a person
    changes for one training without editing the scale preset; unset, the preset's values hold."""

    init_from: str = Field(
        default="",
        description="base | production | scratch | <path of a Mixtral HF "
        "checkpoint>; empty: the scale preset's init_from",
    )
    max_steps: int | None = Field(
        default=None, gt=0, description="optimizer steps; empty: training.max_steps"
    )
    learning_rate: float | None = Field(
        default=None, gt=0, description="peak learning rate; empty: training.learning_rate"
    )

    def settings(self, preset: TrainingSettings) -> TrainingSettings:
        """The preset's training settings with this run's overrides."""
        overrides = {"max_steps": self.max_steps, "learning_rate": self.learning_rate}
        return preset.model_copy(update={k: v for k, v in overrides.items() if v is not None})


def latest_base_model(context: dg.AssetExecutionContext, storage: StorageResource) -> tuple[str, str] | None:
    """(id, directory) of the latest materialized base_model, or None when there is none. The directory is where
    it lies now: the event recorded where it was written, which a moved data root no longer is."""
    event = context.instance.get_latest_materialization_event(dg.AssetKey("base_model"))
    if event is None or event.asset_materialization is None:
        return None
    metadata = event.asset_materialization.metadata
    base_id = str(metadata["checkpoint_id"].value)
    recorded = str(metadata["checkpoint_path"].value)
    here = storage.path("base_models", base_id)
    return base_id, here if io.exists(here) else roots.resolve_under(recorded, storage.root)


def resolve_init(
    context: dg.AssetExecutionContext,
    config: TrainingRunConfig,
    storage: StorageResource,
    sft_dataset: SFTDataset,
    scale: ScalePreset,
) -> tuple[InitSource, str]:
    """Where this training starts, and the tokenizer directory to train with, checked before anything launches.

    ``base`` is the preset's default; while no base_model exists (a fresh data root) it trains from scratch and
    says so. Asked for in the run config, a missing base model is an error.
    """
    from transformers import AutoTokenizer  # 3.5 s to import: not on every load of the code location

    requested = config.init_from or scale.init_from
    production = ProductionRegistry(storage.production_pointer()).current()
    try:
        source = resolve(
            requested,
            latest_base_model(context, storage),
            (production.checkpoint_id, production.checkpoint_path) if production else None,
            preset_default=not config.init_from,
        )
        tokenizer_dir = ""
        if source.path:
            tokenizer_dir = check_init_checkpoint(
                source.path,
                AutoTokenizer.from_pretrained(sft_dataset.tokenizer_path),
                f"sft_dataset {sft_dataset.run_hash}",
            )
    except ValueError as e:
        raise dg.Failure(f"init_from {requested!r}: {e}", allow_retries=False) from e
    if source.note:
        context.log.warning(source.note)
    return source, tokenizer_dir or sft_dataset.tokenizer_path


@dg.asset(
    op_tags=IMPORTS_MODELS,  # step_executor.py: torch and transformers in its own process
    group_name="training",
    pool="gpu",
    retry_policy=MODEL_CALL_RETRY,
    deps=["base_model"],
    kinds={"deepspeed", "pytorch"},
    description="A Mixtral-architecture MoE causal LM trained with the DeepSpeed engine on sft_dataset, starting "
    "from init_from (the latest base_model by default, production, scratch or a Mixtral checkpoint "
    "path), saved as a Hugging Face checkpoint (safetensors, config, tokenizer) in "
    "data/checkpoints/<checkpoint_id>/.",
)
def moe_checkpoint(
    context: dg.AssetExecutionContext,
    config: TrainingRunConfig,
    sft_dataset: SFTDataset,
    gpu_cluster: GPUClusterResource,
    storage: StorageResource,
    tracking: TrackingResource,
    scale_preset: ScaleResource,
    promotion_policy: PromotionResource,
) -> dg.Output[Checkpoint]:
    scale = scale_preset.load()
    settings = config.settings(scale.training)
    checkpoint_id = checkpoint_id_for(context, storage)
    init, tokenizer_path = resolve_init(context, config, storage, sft_dataset, scale)
    init_requested = config.init_from or scale.init_from
    job = TrainingJob(
        run_id=checkpoint_id,
        train_path=sft_dataset.train_path,
        validation_path=sft_dataset.validation_path,
        tokenizer_path=tokenizer_path,
        settings=settings,
        output_dir=str(storage.checkpoint_dir(checkpoint_id)),
        dataset_run_hash=sft_dataset.run_hash,
        **preset_on_cluster(scale, scale_preset, gpu_cluster),
        init_from=init.path,
        parent=init.parent,
        init_requested=init_requested,
    )
    stage = sft_record(job, scale, settings, sft_dataset)
    publish = registered(context, tracking, promotion_policy.policy().registered_model)
    return launch_and_record(context, job, stage, gpu_cluster, storage, tracking, publish)


def sft_record(
    job: TrainingJob, scale: ScalePreset, settings: TrainingSettings, data: SFTDataset
) -> StageRecord:
    """What is SFT's own in the launch-and-record path: its parameters, record fields and figures."""
    return StageRecord(
        stage="training",
        title=f"{job.run_id} ({scale.model_preset})",
        curve_label="training loss",
        launch_message=f"launching training of {job.run_id} ({scale.model_preset}, {settings.max_steps} "
        f"steps, from {job.parent})",
        params={**origin(scale, job), "dataset_run_hash": data.run_hash, **settings.model_dump()},
        record={
            "dataset_validation_path": data.validation_path,
            **origin(scale, job),
            "init_requested": job.init_requested,
        },
        figures=lambda result: StageFigures(
            final_metrics={"validation_loss": result.validation_loss, "tokens_per_s": result.tokens_per_s},
            metadata={
                "scale": scale.name,
                "validation_loss": result.validation_loss,
                "tokens_per_s": round(result.tokens_per_s, 1),
                "parameters_active": result.parameters_active,
            },
        ),
    )


@dg.asset_check(
    op_tags=IMPORTS_MODELS,  # step_executor.py: torch and transformers in its own process
    asset=moe_checkpoint,
    description="The checkpoint loads with plain transformers "
    "(AutoModelForCausalLM) and gives finite logits.",
)
def checkpoint_loads_with_transformers(moe_checkpoint: Checkpoint) -> dg.AssetCheckResult:
    return loads_with_transformers(moe_checkpoint.path)


def training_summary(checkpoint: Checkpoint) -> TrainingResult:
    """What the worker reported of the checkpoint's training (``training_summary.json`` beside its weights): what
    the checks of a trained checkpoint read its figures from."""
    return TrainingResult.model_validate(io.read_json(io.join(checkpoint.path, "training_summary.json")))


def loads_with_transformers(path: str, **extra: Any) -> dg.AssetCheckResult:
    """Passed when the checkpoint at ``path`` loads with plain transformers and gives finite logits (and every
    ``extra`` condition, a name and whether it holds, is true): the check of every trained checkpoint. A checkpoint
    that does not load (a truncated or damaged weights file, a missing config) fails the check naming the error,
    rather than erroring the check: what serving and evaluation would meet is the check's answer."""
    # torch and transformers: seconds to import, paid by the check that loads a model, not at every load
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path)
    except Exception as e:  # safetensors, OSError, ValueError...: any reason it does not load is the answer
        return dg.AssetCheckResult(
            passed=False,
            description=f"{path} does not load with transformers: {type(e).__name__}: {str(e)[:300]}",
            metadata={"loads": False, **{k: bool(v) for k, v in extra.items()}},
        )
    ids = tokenizer("def f(x): return x", return_tensors="pt")
    with torch.no_grad():
        logits = model(**ids).logits
    finite = bool(torch.isfinite(logits).all())
    return dg.AssetCheckResult(
        passed=finite and all(bool(v) for v in extra.values()),
        metadata={
            "loads": True,
            "architecture": model.config.architectures[0],
            "num_experts": model.config.num_local_experts,
            "logits_finite": finite,
            **{k: bool(v) for k, v in extra.items()},
        },
    )
