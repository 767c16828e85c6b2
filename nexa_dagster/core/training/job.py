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
DataKind = Literal["packed_sft", "pretrain_corpus", "preference"]
DPOLossType = Literal["sigmoid", "sigmoid_norm"]


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


Objective = Annotated[LanguageModelObjective | DPOObjective, Field(discriminator="kind")]


class TrainingJob(BaseModel):
    """Everything one training run needs; ``extra="forbid"`` so a typo in a hand-written job fails loudly."""

    model_config = ConfigDict(extra="forbid")

    run_id: str = Field(min_length=1, description="unique per run; also the checkpoint's name")
    train_path: str = Field(
        description="packed rows (input_ids, loss_mask, position_ids, attention_mask): a split "
        "manifest <split>.shards.json (core/packed_split) or one packed Parquet file"
    )
    validation_path: str = Field(description="packed Parquet with the same columns, for the validation loss")
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
            "(packed-preference-parquet/1), trained with DPO from init_from (core/training/preference.py)"
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
            '{"kind": "language_model"} for packed_sft and pretrain_corpus, {"kind": "dpo", ...} for preference'
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _objective_of_the_data_kind(cls, data: Any) -> Any:
        """A job without an ``objective`` section gets its data kind's default objective."""
        if isinstance(data, dict) and data.get("objective") is None:
            kind = "dpo" if data.get("data_kind") == "preference" else "language_model"
            data = {**data, "objective": {"kind": kind}}
        return data

    @model_validator(mode="after")
    def _preference_starts_from_a_checkpoint(self) -> TrainingJob:
        wanted = "dpo" if self.data_kind == "preference" else "language_model"
        if self.objective.kind != wanted:
            raise ValueError(
                f"training job {self.run_id}: data_kind {self.data_kind} is trained with the {wanted} objective, "
                f"not {self.objective.kind}"
            )
        if self.data_kind == "preference" and not self.init_from:
            raise ValueError(
                f"training job {self.run_id}: a preference (DPO) job needs init_from, the SFT checkpoint it "
                "starts from (and, by default, its reference model)"
            )
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
    validation_loss: float = Field(
        description="mean token NLL over the validation set's loss-mask tokens (preference: mean DPO loss of "
        "the validation pairs)"
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
