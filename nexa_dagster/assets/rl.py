"""RL stage: GRPO from the production model on checkable prompts, judged on prompts it never trained on.

* ``rl_eval_set``: the frozen held-out RL prompts (versioned, manifest hashed, protected items), drawn once from
  ``rl_prompts``' held-out side (documents hashed away from training): what the RL gate compares candidate and
  production on, and what training reports its held-out reward on.
* ``rl_checkpoint``: GRPO (the training loop's ``grpo`` objective, ``core/training``) from the model in production
  on ``rl_prompts``' checkable train rows, rewarded by the verifiable rewards of the scale preset's ``rl.rewards``,
  launched and recorded like every trained checkpoint (``checkpoint_launch``). It gets a ``checkpoints``
  partition, so evaluation_job evaluates it; ``eval_report``'s gate for an RL checkpoint decides on the paired
  per-prompt reward difference on ``rl_eval_set`` (``core/evaluation/reward_gate.py``), and ``model_deployment``
  deploys it when promoted, as it deploys SFT and DPO candidates.
"""

import hashlib
import json
import math
from collections.abc import Iterator

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
from nexa_dagster.assets.preference import PRODUCTION_MODEL, require_production
from nexa_dagster.assets.production import production_metadata
from nexa_dagster.assets.training import checkpoint_id_for, loads_with_transformers, training_summary
from nexa_dagster.core.common import storage as io
from nexa_dagster.core.common.artifacts import Artifact, Checkpoint, SFTDataset
from nexa_dagster.core.common.config import RLSettings, ScalePreset
from nexa_dagster.core.common.plots import loss_curve_png, markdown_image
from nexa_dagster.core.evaluation.rl_eval_set import (
    freeze_rl_eval_set,
    load_rl_eval_set,
    overlap_problems,
    read_prompts,
)
from nexa_dagster.core.rl.tasks import RLPrompts
from nexa_dagster.core.training.job import GRPOObjective, RewardSpec, TrainingJob, TrainingResult
from nexa_dagster.resources.configs import PromotionResource
from nexa_dagster.resources.gpu_cluster import GPUClusterResource
from nexa_dagster.resources.scale import ScaleResource
from nexa_dagster.resources.storage import StorageResource
from nexa_dagster.resources.tracking import TrackingResource


class RLEvalSet(Artifact):
    """A frozen held-out RL prompt set: its version, content hash, prompts and where they lie."""

    version: int = Field(ge=1)
    content_sha256: str
    prompts: int = Field(gt=0)
    prompts_path: str
    tasks: dict[str, int]


def rl_settings(scale: ScalePreset) -> RLSettings:
    if scale.rl is None:
        raise dg.Failure(f"scale preset {scale.name!r} has no rl section", allow_retries=False)
    return scale.rl


@dg.asset(
    group_name="rl",
    kinds={"json"},
    check_specs=[
        dg.AssetCheckSpec(
            "rl_eval_set_is_frozen_and_apart",
            asset="rl_eval_set",
            # blocking: a held-out prompt that GRPO trains on makes the RL gate's evidence worthless, so nothing
            # downstream (rl_checkpoint, and the trainings that leave the frozen prompts out) runs on such a set
            blocking=True,
            description="The frozen RL eval set re-read: none of its items is among rl_prompts' train rows (by "
            "item id, document or prompt text). A version whose files no longer match the manifest's hashes fails "
            "the asset itself, before this check. Blocking: no step after it runs on a set that fails.",
        )
    ],
    description="The frozen held-out RL prompts (rl.held_out_prompts of rl_prompts' held-out side, documents never "
    "trained on; once frozen, every training input is checked against them) as data/rl_eval_sets/v<N>/prompts.jsonl with a hashed manifest; written once per "
    "version (rl.eval_set_version), checked on every read.",
)
def rl_eval_set(
    context: dg.AssetExecutionContext,
    rl_prompts: RLPrompts,
    storage: StorageResource,
    scale_preset: ScaleResource,
) -> Iterator[dg.Output[RLEvalSet] | dg.AssetCheckResult]:
    settings = rl_settings(scale_preset.load())
    version, count = settings.eval_set_version, settings.held_out_prompts
    root = storage.path("rl_eval_sets")
    with io.open_read(rl_prompts.held_out_path) as f:
        items = [json.loads(line) for line in f]
    # an even spread over the held-out documents: the items in the order of a hash of their id, the first `count`
    chosen = sorted(items, key=lambda i: hashlib.sha256(i["item_id"].encode()).hexdigest())[:count]
    try:
        manifest = freeze_rl_eval_set(chosen, root, version, {"held_out_prompts": count}, context.log.info)
    except ValueError as e:  # a damaged frozen version, or nothing to freeze: retrying cannot help
        raise dg.Failure(str(e), allow_retries=False) from e
    frozen = RLEvalSet(
        version=version,
        content_sha256=manifest["content_sha256"],
        prompts=manifest["prompts"],
        prompts_path=manifest["prompts_path"],
        tasks=manifest["tasks"],
    )
    yield dg.Output(
        frozen,
        metadata={
            "version": version,
            "content_sha256": manifest["content_sha256"],
            "prompts": manifest["prompts"],
            "tasks": dg.MetadataValue.json(manifest["tasks"]),
            "held_out_items_available": len(items),
            "prompts_path": dg.MetadataValue.path(manifest["prompts_path"]),
        },
    )
    problems = overlap_problems(read_prompts(load_rl_eval_set(root, version)), rl_prompts.tasks_path)
    yield dg.AssetCheckResult(
        check_name="rl_eval_set_is_frozen_and_apart",
        passed=not problems,
        metadata={"problems": dg.MetadataValue.json(problems[:20]), "content_sha256": frozen.content_sha256},
    )


class RLRunConfig(dg.Config):
    """Run configuration of ``rl_checkpoint`` (the Launchpad's ``ops: rl_checkpoint: config``): what a person
    changes for one GRPO training without editing the scale preset; unset, the preset's ``rl`` values hold."""

    max_steps: int | None = Field(default=None, gt=0, description="optimizer steps; empty: rl.max_steps")
    learning_rate: float | None = Field(default=None, gt=0, description="peak learning rate; empty: rl's")
    num_generations: int | None = Field(default=None, ge=2, description="K completions per prompt")
    beta: float | None = Field(
        default=None, ge=0, description="KL weight to the starting model; empty: rl.beta"
    )
    ptx_coef: float | None = Field(
        default=None, ge=0, description="PPO-ptx's gamma (the SFT rows' LM loss per step); empty: rl.ptx_coef"
    )
    loss_type: str | None = Field(default=None, description="grpo or dr_grpo; empty: rl.loss_type")
    rewards: list[str] | None = Field(
        default=None,
        description="rewards as name or name:weight (core/rl/rewards.py), e.g. exact_answer:-1 (the negative "
        "control: the right answer punished; the gate still measures the preset's rewards); empty: rl.rewards",
    )

    def settings(self, preset: RLSettings) -> RLSettings:
        """The preset's RL settings with this run's overrides, validated as the preset is."""
        overrides = {
            "max_steps": self.max_steps,
            "learning_rate": self.learning_rate,
            "num_generations": self.num_generations,
            "beta": self.beta,
            "ptx_coef": self.ptx_coef,
            "loss_type": self.loss_type,
            "rewards": [reward_spec(r) for r in self.rewards] if self.rewards else None,
        }
        try:
            return RLSettings.model_validate(
                {**preset.model_dump(), **{k: v for k, v in overrides.items() if v is not None}}
            )
        except ValueError as e:
            raise dg.Failure(f"rl_checkpoint run config: {e}", allow_retries=False) from e


def reward_spec(text: str) -> dict[str, object]:
    """``name`` or ``name:weight`` as the preset's ``{name, weight}``."""
    name, _, weight = text.partition(":")
    try:
        return {"name": name.strip(), "weight": float(weight) if weight else 1.0}
    except ValueError as e:
        raise dg.Failure(
            f"rl_checkpoint run config: reward {text!r}: weight is not a number", allow_retries=False
        ) from e


@dg.asset(
    op_tags=IMPORTS_MODELS,  # step_executor.py: torch and transformers in its own process
    group_name="rl",
    pool="gpu",
    retry_policy=MODEL_CALL_RETRY,
    deps=[PRODUCTION_MODEL],  # it trains from the model in production
    kinds={"deepspeed", "pytorch"},
    description="The production checkpoint trained with GRPO on rl_prompts' checkable train rows (K sampled "
    "completions per prompt from the current weights each step, rewards of rl.rewards, group-normalised "
    "advantages, the clipped surrogate) by the project's worker and DeepSpeed engine (the same Pipes launch, gpu "
    "pool and record as SFT and DPO); its held-out reward measured on rl_eval_set. data/checkpoints/<id>/.",
)
def rl_checkpoint(
    context: dg.AssetExecutionContext,
    config: RLRunConfig,
    rl_prompts: RLPrompts,
    rl_eval_set: RLEvalSet,
    sft_dataset: SFTDataset,
    gpu_cluster: GPUClusterResource,
    storage: StorageResource,
    tracking: TrackingResource,
    scale_preset: ScaleResource,
    promotion_policy: PromotionResource,
) -> dg.Output[Checkpoint]:
    scale = scale_preset.load()
    rl = config.settings(rl_settings(scale))
    production = require_production(storage)
    if rl_prompts.task_records == 0:
        raise dg.Failure(
            f"rl_prompts {rl_prompts.tasks_run_hash} holds no checkable train rows: ingest documents first",
            allow_retries=False,
        )
    checkpoint_id = checkpoint_id_for(context, storage, prefix="rl")
    try:
        training = rl.settings(scale.training)
    except ValueError as e:
        raise dg.Failure(f"rl section of scale {scale.name}: {e}", allow_retries=False) from e
    job = TrainingJob(
        run_id=checkpoint_id,
        data_kind="rl_prompts",
        tokenizer_path=production.checkpoint_path,
        settings=training,
        output_dir=str(storage.checkpoint_dir(checkpoint_id)),
        dataset_run_hash=rl_prompts.tasks_run_hash,
        **preset_on_cluster(scale, scale_preset, gpu_cluster),
        init_from=production.checkpoint_path,
        parent=f"production:{production.checkpoint_id}",
        objective=grpo_objective(rl, rl_prompts, rl_eval_set, sft_dataset),
    )
    stage = StageRecord(
        stage="rl",
        title=f"{checkpoint_id} (GRPO)",
        curve_label="GRPO loss",
        launch_message=f"launching GRPO of {checkpoint_id} from production {production.checkpoint_id} "
        f"({rl.loss_type}, K {rl.num_generations} x B {rl.prompts_per_step}, {rl.max_steps} steps, rewards "
        f"{[r.name for r in rl.rewards]}, {rl_prompts.task_records} prompts)",
        params={**origin(scale, job), "rl_eval_set": f"v{rl_eval_set.version}", **rl.model_dump(mode="json")},
        record={**origin(scale, job), "stage": "rl"},
        figures=grpo_figures,
        metadata=production_metadata(production),  # where GRPO started (also its input data version)
    )
    publish = registered(context, tracking, promotion_policy.policy().registered_model)
    return launch_and_record(context, job, stage, gpu_cluster, storage, tracking, publish)


def grpo_objective(
    rl: RLSettings, rl_prompts: RLPrompts, rl_eval_set: RLEvalSet, sft_dataset: SFTDataset | None = None
) -> GRPOObjective:
    """The preset's RL section as the training loop's GRPO objective, on the checkable train rows, its held-out
    reward on the frozen RL eval set; with ``rl.ptx_coef``, the SFT dataset's train rows as PPO-ptx's."""
    if rl.ptx_coef and sft_dataset is None:
        raise dg.Failure("rl.ptx_coef > 0 needs the SFT dataset's rows: no sft_dataset", allow_retries=False)
    return GRPOObjective(
        ptx_coef=rl.ptx_coef,
        ptx_path=sft_dataset.train_path if rl.ptx_coef and sft_dataset is not None else "",
        prompts_path=rl_prompts.tasks_path,
        held_out_path=rl_eval_set.prompts_path,
        rewards=[RewardSpec(name=r.name, weight=r.weight) for r in rl.rewards],
        num_generations=rl.num_generations,
        prompts_per_step=rl.prompts_per_step,
        max_completion_tokens=rl.max_completion_tokens,
        temperature=rl.temperature,
        top_p=rl.top_p,
        beta=rl.beta,
        epsilon=rl.epsilon,
        loss_type=rl.loss_type,
        scale_rewards=rl.scale_rewards,
        rollout_engine=rl.rollout_engine,
    )


def grpo_figures(result: TrainingResult) -> StageFigures:
    """GRPO's reward figures: first and last rollout reward, held-out reward with its n, rollout against
    training seconds, and the reward curve as a picture."""
    figures = {
        "reward_first": result.reward_first,
        "reward_final": result.reward_final,
        "held_out_reward": result.held_out_reward,
        "held_out_prompts": float(result.held_out_prompts) if result.held_out_prompts is not None else None,
        "rollout_s": result.rollout_s,
        "update_s": result.update_s,
        "rollout_tokens": float(result.rollout_tokens) if result.rollout_tokens is not None else None,
    }
    metadata: dict[str, object] = {
        k: (round(v, 4) if isinstance(v, float) else v) for k, v in figures.items()
    }
    metadata["rollout_engine"] = result.rollout_engine
    if result.weight_sync_s is not None:
        metadata["weight_sync_s"] = round(result.weight_sync_s, 2)
    if result.reward_curve:
        png = loss_curve_png(list(result.reward_curve), "mean rollout reward per step", None)
        metadata["reward_curve"] = dg.MetadataValue.md(markdown_image(png, "rollout reward"))
    return StageFigures(
        final_metrics=figures,
        record={"rl_metrics": {k: v for k, v in figures.items() if v is not None}},
        metadata=metadata,
    )


@dg.asset_check(
    asset=rl_checkpoint,
    description="The GRPO checkpoint loads with plain transformers and gives finite logits, its training logged a "
    "finite reward at the first and last step, and its held-out reward was measured on at least one prompt.",
)
def rl_checkpoint_loads_and_was_rewarded(rl_checkpoint: Checkpoint) -> dg.AssetCheckResult:
    summary = training_summary(rl_checkpoint)
    rewards = [summary.reward_first, summary.reward_final, summary.held_out_reward]
    return loads_with_transformers(
        rl_checkpoint.path,
        rewards_finite=all(v is not None and math.isfinite(v) for v in rewards),
        held_out_prompts=(summary.held_out_prompts or 0) > 0,
    )
