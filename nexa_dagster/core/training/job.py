"""What a training run needs (``TrainingJob``) and what it reports back (``TrainingResult``), both plain JSON.

The job is written to a file and handed to the worker process, which may run on this machine, a Slurm node or a
Kubernetes pod: nothing in it may be a Python object that only exists in the Dagster process. The result is
written beside the checkpoint (``training_summary.json``), so a checkpoint explains itself without Dagster.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nexa_dagster.core.common.config import TrainingSettings

Accelerator = Literal["cpu", "cuda"]
DataKind = Literal["packed_sft", "pretrain_corpus", "preference", "rl_prompts"]
DPOLossType = Literal["sigmoid", "sigmoid_norm"]
GRPOLossType = Literal["grpo", "dr_grpo"]
ScaleRewards = Literal["group", "batch", "none"]


class LanguageModelObjective(BaseModel):
    """Pretraining and SFT: next-token cross-entropy over the learned tokens, weighted by tokens."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["language_model"] = "language_model"


class DPOObjective(BaseModel):
    """Preference training: the DPO family, scored against a frozen reference checkpoint."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["dpo"] = "dpo"
    beta: float = Field(
        default=0.1, gt=0, description="DPO's beta (strength of the pull towards the reference)"
    )
    loss: DPOLossType = Field(
        default="sigmoid",
        description="sigmoid (DPO) or sigmoid_norm (each log-ratio divided by its completion's token count)",
    )
    sft_weight: float = Field(
        default=0.0,
        ge=0,
        description=(
            "weight of TRL's `sft` loss beside DPO's (TRL: loss_type [sigmoid, sft], loss_weights [1, w]): the "
            "chosen completions' mean token NLL of each micro-batch. 0: DPO alone. RPO (Pang et al. 2024) uses 1: "
            "without it DPO can lower the chosen answers' likelihood with the rejected ones'"
        ),
    )
    reference_path: str = Field(
        default="",
        description="the reference checkpoint directory (empty: init_from, the weights before training)",
    )
    reference_logps_path: str = Field(
        default="",
        description=(
            "the reference log-probabilities file to read, or to write when missing (empty: "
            "ref_logps-<reference id>.parquet beside the training split)"
        ),
    )
    pack_length: int = Field(
        default=0,
        ge=0,
        description=(
            "tokens per packed row of pairs (every micro-batch is 2 x micro_batch_size rows of it); 0: the longest "
            "prompt+completion of the run's pairs rounded up to a multiple of 64"
        ),
    )


class RewardSpec(BaseModel):
    """One reward function of the sum a GRPO completion is scored by (``core/rl/rewards.py``'s registry)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(
        min_length=1, description="a name in core.rl.rewards.REWARDS (checked before a model is built)"
    )
    weight: float = Field(
        default=1.0,
        description="its weight in the summed reward (TRL's reward_weights); 1.0: rewards count alike",
    )


class GRPOObjective(BaseModel):
    """Online RL: GRPO on prompts, K completions sampled from the current weights every step (core/training/grpo.py).

    The defaults are TRL ``GRPOConfig``'s wherever TRL has one, so a run here means what it means there; each field
    says where it departs and why.
    """

    model_config = ConfigDict(extra="forbid")
    kind: Literal["grpo"] = "grpo"
    prompts_path: str = Field(
        min_length=1,
        description=(
            "training prompts, JSONL: each row a 'prompt' (a chat messages list, or a string: the user turn, with "
            "the row's 'system_prompt' as system turn when it has one, as rl_prompts writes) and any other "
            "columns, passed to the reward functions by name (reference, answer, task, ...)"
        ),
    )
    held_out_path: str = Field(
        default="",
        description=(
            "held-out prompts (same format, never trained on): the mean reward of greedy completions at the end "
            "is TrainingResult.held_out_reward, with each prompt's reward for a paired comparison; empty: none"
        ),
    )
    rewards: list[RewardSpec] = Field(
        min_length=1, description="the reward functions summed (weighted) into each completion's reward"
    )
    num_generations: int = Field(
        default=8,
        ge=2,
        description=(
            "K completions per prompt: the group whose mean and spread the advantages are taken against (TRL's "
            "default 8; at least 2, a group of one has no spread)"
        ),
    )
    prompts_per_step: int = Field(
        default=4,
        gt=0,
        description=(
            "B prompts per optimizer step, so K x B completions are generated in one batched call; each prompt's "
            "group of K is one micro-batch (micro_batch_size = K, gradient_accumulation_steps = B / ranks)"
        ),
    )
    max_completion_tokens: int = Field(
        default=256,
        gt=0,
        description="longest completion sampled, in tokens (TRL's max_completion_length); also dr_grpo's divisor",
    )
    ptx_coef: float = Field(
        default=0.0,
        ge=0,
        description=(
            "gamma of InstructGPT's PPO-ptx: the next-token loss of one packed SFT row (ptx_path) per micro-batch "
            "added to every step, so RL on one task does not cost the language model (core/training/ptx.py); 0: "
            "none (TRL has no such term)"
        ),
    )
    ptx_path: str = Field(
        default="", description="the packed SFT split (manifest or Parquet) the ptx rows come from"
    )
    temperature: float = Field(
        default=1.0,
        gt=0,
        description="sampling temperature of the rollouts (TRL's 1.0: the policy's own distribution, on-policy)",
    )
    top_p: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="nucleus sampling of the rollouts (TRL's 1.0: no truncation, so log-probs are the policy's)",
    )
    beta: float = Field(
        default=0.0,
        ge=0,
        description=(
            "weight of the KL to the reference (the starting weights). TRL's default 0.0 (after Open-Reasoner-Zero "
            "and DAPO): no reference model is kept; > 0 keeps a frozen copy of init_from to score each rollout"
        ),
    )
    epsilon: float = Field(
        default=0.2,
        gt=0,
        description="the clipped surrogate's range: the ratio is clipped to [1 - epsilon, 1 + epsilon] (TRL's 0.2)",
    )
    loss_type: GRPOLossType = Field(
        default="dr_grpo",
        description=(
            "grpo: each completion's token mean, then the mean over completions; dr_grpo: the token sum over "
            "completions x max_completion_tokens (TRL's definitions). dr_grpo by default (TRL's is dapo, not "
            "offered here): grpo's per-completion mean gives a long wrong answer a smaller per-token penalty "
            "than a short one, a pull towards length (Liu et al. 2025, 'Understanding R1-Zero-like training')"
        ),
    )
    scale_rewards: ScaleRewards = Field(
        default="group",
        description=(
            "advantage = reward - group mean, divided by the std of the group (group, TRL's default), of the "
            "whole batch (batch) or not at all (none)"
        ),
    )

    rollout_engine: Literal["transformers", "vllm"] = Field(
        default="transformers",
        description=(
            "what samples the rollouts: transformers (batched generate on the training tensors themselves, no copy) "
            "or vllm (an engine from the vLLM environment, the weights synced to it through the filesystem before "
            "every rollout; its sampling log-probabilities correct the engine/trainer mismatch, below). vLLM's CPU "
            "build cannot run the tiny preset's head size 16: it is refused before a step with the reason"
        ),
    )
    vllm_importance_sampling_mode: Literal[
        "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
    ] = Field(
        default="sequence_mask",
        description=(
            "rollout_engine vllm: how the ratio of the trainer's to the engine's probability of each sampled "
            "token weights the loss (TRL 1.16's vllm_importance_sampling_mode and its default: a completion "
            "whose whole-sequence ratio leaves [0, clip_max] is masked out)"
        ),
    )
    vllm_importance_sampling_clip_max: float = Field(
        default=3.0,
        gt=1,
        description="the ratio's upper bound, truncated or masked above (TRL 1.16's default 3.0)",
    )

    @model_validator(mode="after")
    def _ptx_has_rows(self) -> GRPOObjective:
        if self.ptx_coef and not self.ptx_path:
            raise ValueError("ptx_coef > 0 needs ptx_path (the packed SFT split its rows come from)")
        return self


Objective = Annotated[LanguageModelObjective | DPOObjective | GRPOObjective, Field(discriminator="kind")]
OBJECTIVE_OF_DATA_KIND = {"preference": "dpo", "rl_prompts": "grpo"}  # every other kind: language_model


class TrainingJob(BaseModel):
    """Everything one training run needs; ``extra="forbid"`` so a typo in a hand-written job fails loudly."""

    model_config = ConfigDict(extra="forbid")

    run_id: str = Field(min_length=1, description="unique per run; also the checkpoint's name")
    train_path: str = Field(
        default="",
        description="(unused by grpo: its objective names its prompts) packed rows (input_ids, loss_mask, position_ids, attention_mask): a split "
        "manifest <split>.shards.json (core/packed_split) or one packed Parquet file",
    )
    validation_path: str = Field(
        default="",
        description="packed Parquet with the same columns, for the validation loss (unused by grpo)",
    )
    tokenizer_path: str = Field(
        description="a Hugging Face directory whose tokenizer the model is trained for"
    )
    model_preset: str = Field(description="name of a preset in configs/models/")
    deepspeed_config: dict[str, Any] = Field(
        description='DeepSpeed JSON config; "auto" fields come from settings'
    )
    settings: TrainingSettings
    output_dir: str = Field(description="final Hugging Face checkpoint directory (must not exist yet)")
    dataset_run_hash: str = Field(default="", description="lineage: the packed dataset this run trained on")
    accelerator: Accelerator = "cpu"
    data_kind: DataKind = Field(
        default="packed_sft",
        description=(
            "packed_sft: train/validation_path are packed Parquet; pretrain_corpus: train_path is a Megatron bin/idx "
            "corpus (megatron_blend.json or its directory), packed here into pack_size rows, its held-out documents "
            "are the validation set; preference: train/validation_path are packed preference pairs "
            "(packed-preference-parquet/1), trained with DPO from init_from (core/training/preference.py); "
            "rl_prompts: GRPO from init_from on the objective's prompts_path (core/training/grpo.py)"
        ),
    )
    pack_size: int = Field(default=0, ge=0, description="pretrain_corpus: tokens per packed row")
    heldout_fraction: float = Field(
        default=0.1, gt=0, lt=1, description="pretrain_corpus: documents held out"
    )
    eval_fraction: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description=(
            "pretrain_corpus: documents on the frozen eval set's side (eval_set.corpus_fraction), never trained on"
        ),
    )
    exclude_documents: list[str] = Field(
        default_factory=list,
        description=(
            "pretrain_corpus: document ids (core.packaging.formats.indexed_dataset.document_id) never trained on: "
            "the corpus documents that hold eval-set or benchmark text (the contamination check)"
        ),
    )
    init_from: str = Field(default="", description="a Mixtral HF directory to start from; empty: random init")
    parent: str = Field(
        default="scratch", description="lineage: scratch, base:<id>, production:<id>, path:<dir>"
    )
    init_requested: str = Field(
        default="",
        description="lineage: what init_from asked for (base, production, scratch, a path); 'base' with parent "
        "scratch: no base model existed yet",
    )
    objective: Objective = Field(
        default=None,  # filled from data_kind by _objective_of_the_data_kind
        description=(
            "what the loop minimises, a typed section per objective (core/training/objectives.py): "
            '{"kind": "language_model"} for packed_sft and pretrain_corpus, {"kind": "dpo", ...} for preference, '
            '{"kind": "grpo", ...} for rl_prompts'
        ),
    )

    @property
    def compiles_layers(self) -> bool:
        """Whether the loop compiles the model's layers (``settings.compile`` on CUDA; on CPU nothing is compiled):
        then every new input shape is a recompile, which a rollout's varying widths must avoid."""
        return self.settings.compile and self.accelerator == "cuda"

    @model_validator(mode="before")
    @classmethod
    def _objective_of_the_data_kind(cls, data: Any) -> Any:
        """A job without an ``objective`` section gets its data kind's default objective."""
        if isinstance(data, dict) and data.get("objective") is None:
            kind = OBJECTIVE_OF_DATA_KIND.get(data.get("data_kind", ""), "language_model")
            data = {**data, "objective": {"kind": kind}}
        return data

    @model_validator(mode="after")
    def _post_training_starts_from_a_checkpoint(self) -> TrainingJob:
        wanted = OBJECTIVE_OF_DATA_KIND.get(self.data_kind, "language_model")
        if self.objective.kind != wanted:
            raise ValueError(
                f"training job {self.run_id}: data_kind {self.data_kind} is trained with the {wanted} objective, "
                f"not {self.objective.kind}"
            )
        if self.data_kind in OBJECTIVE_OF_DATA_KIND and not self.init_from:
            raise ValueError(
                f"training job {self.run_id}: a {self.data_kind} ({self.objective.kind.upper()}) job needs init_from, "
                "the checkpoint it "
                "starts from (and, by default, its reference model)"
            )
        if self.objective.kind != "grpo" and not (self.train_path and self.validation_path):
            raise ValueError(f"training job {self.run_id}: train_path and validation_path are required")
        return self


class TrainingResult(BaseModel):
    """What a finished run reports: read back by the launcher and stored as ``training_summary.json``."""

    run_id: str
    checkpoint_dir: str
    steps: int
    first_loss: float = Field(
        description="LM loss (preference: DPO loss), without the router aux loss, of step 1"
    )
    final_loss: float = Field(
        description="LM loss (preference: DPO loss), without the router aux loss, of the last step"
    )
    validation_loss: float | None = Field(
        description="mean token NLL over the validation set's loss-mask tokens (preference: mean DPO loss of "
        "the validation pairs; rl_prompts: None, its held-out figure is held_out_reward)"
    )
    tokens_seen: int = Field(description="real (non-padding) tokens trained on, all ranks")
    tokens_per_s: float = Field(description="tokens_seen over the training loop's wall time")
    wall_s: float = Field(description="the run up to the save: loading, engine setup, training, validation")
    loss_curve: list[tuple[int, float]] = Field(description="(step, LM loss) at every logged step")
    parameters_total: int
    parameters_active: int = Field(description="parameters used per token: non-expert + top-k of the experts")
    world_size: int = 1
    dataset_run_hash: str = ""
    resumed_from_step: int = Field(
        default=0, description="0, or the step whose saved state this run resumed from"
    )
    mfu: float = Field(
        default=0.0, description="best model-FLOPs utilisation of a logging window (GPUs only)"
    )
    peak_mem_gb: float = Field(default=0.0, description="peak accelerator memory (GPU) or process RSS (CPU)")
    parent: str = Field(default="scratch", description="what the weights started from (TrainingJob.parent)")
    data_kind: str = "packed_sft"
    validation_documents: int = Field(default=0, description="pretrain_corpus: held-out documents evaluated")
    reward_accuracy: float | None = Field(
        default=None,
        description="preference: share of validation pairs whose chosen reward beats the rejected one (strict)",
    )
    reward_margin: float | None = Field(
        default=None,
        description="preference: mean of beta*(chosen log-ratio - rejected log-ratio) over the validation pairs",
    )
    validation_pairs: int | None = Field(default=None, description="preference: validation pairs scored")
    reward_first: float | None = Field(
        default=None, description="rl_prompts: mean summed reward of the rollouts of step 1"
    )
    reward_final: float | None = Field(
        default=None, description="rl_prompts: mean summed reward of the rollouts of the last logged step"
    )
    reward_curve: list[tuple[int, float]] | None = Field(
        default=None, description="rl_prompts: (step, mean rollout reward) at every logged step"
    )
    held_out_reward: float | None = Field(
        default=None,
        description="rl_prompts: mean summed reward of greedy completions of the held-out prompts, at the end",
    )
    held_out_rewards: list[float] | None = Field(
        default=None,
        description="rl_prompts: each held-out prompt's reward, in the file's order (paired gates)",
    )
    held_out_prompts: int | None = Field(default=None, description="rl_prompts: held-out prompts scored")
    frac_reward_zero_std: float | None = Field(
        default=None,
        description="rl_prompts: share of prompt groups whose K rewards were all equal (no signal), mean over steps",
    )
    completion_length: float | None = Field(
        default=None, description="rl_prompts: mean completion tokens of the rollouts, mean over steps"
    )
    rollout_s: float | None = Field(
        default=None, description="rl_prompts: seconds spent generating rollouts (this process)"
    )
    update_s: float | None = Field(
        default=None,
        description="rl_prompts: seconds of the rest of the steps (scoring, backward, optimizer; this process)",
    )
    rollout_tokens: int | None = Field(
        default=None, description="rl_prompts: completion tokens generated in rollouts (this process)"
    )
    rollout_engine: str | None = Field(
        default=None, description="rl_prompts: what sampled the rollouts (transformers or vllm)"
    )
    weight_sync_s: float | None = Field(
        default=None,
        description="rl_prompts, vllm: seconds of the weight syncs (write and load), part of rollout_s",
    )
