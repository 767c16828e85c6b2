"""Validated artifacts: what a non-tabular stage produced, where it is, and what it came from.

Following the Nemotron design, each artifact validates its fields on creation (catching errors at the step
boundary, not hours later) and references the artifacts it was made from, so an evaluation holding a checkpoint
can find the dataset the checkpoint was trained on.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nexa_dagster.core.common import roots

COMPLETION_MARKER = "_COMPLETE"  # written last into a model or checkpoint directory: it is complete


def require_model_dir(path: str | Path, what: str = "model") -> Path:
    """A loadable local Hugging Face model directory, or an error naming the path and what to do.

    Nothing is built or downloaded behind the caller's back: the project's tiny models are installed by an
    explicit step (``nexa-dagster tiny-models``, which ``make run`` and the tests run)."""
    p = Path(path)
    if (p / "config.json").exists():
        return p
    hint = (
        " (the project's tiny models: run `nexa-dagster tiny-models` to install them into the data root)"
        if p.name.startswith("tiny-")
        else ""
    )
    raise FileNotFoundError(
        f"{what} directory {p} has no config.json: point the configured path at a Hugging Face "
        f"model directory{hint}"
    )


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


class Artifact(BaseModel):
    model_config = ConfigDict(extra="forbid")
    created_at: str = Field(default_factory=_now)


class SFTDataset(Artifact):
    run_hash: str = Field(min_length=8)
    root: str
    train_path: str
    validation_path: str
    train_jsonl_path: str
    validation_jsonl_path: str
    num_samples: int = Field(gt=0)
    num_train_sequences: int = Field(gt=0)
    num_validation_sequences: int = Field(gt=0)
    num_real_tokens: int = Field(gt=0)
    num_loss_tokens: int = Field(gt=0)
    pack_size: int = Field(gt=0)
    packing_efficiency: float = Field(gt=0, le=1)
    days: list[str]
    tokenizer_path: str
    blend: str | None = None  # the data blend (configs/blends/) that decided what went in
    blend_fingerprint: str | None = None
    num_shards: int | None = None
    quarantined_rows: int = 0  # bad input rows set aside (on_error: quarantine), listed in quarantine_path
    quarantine_path: str | None = None
    held_out_samples: int = 0  # on the frozen eval set's side (core.eval_set): in neither split
    shards_reused: int = 0  # taken from the shard store (packed by an earlier snapshot), not packed again
    # rows whose sample_id an earlier day also holds: kept on the earliest day, left out of the later ones
    cross_day_duplicates_dropped: int = 0

    @field_validator("train_path", "validation_path", "train_jsonl_path", "validation_jsonl_path")
    @classmethod
    def _exists(cls, v: str) -> str:
        if "://" not in v and not Path(v).exists():
            raise ValueError(f"dataset file does not exist: {v}")
        return v


class PreferenceDataset(Artifact):
    """Packed preference pairs (``core/packaging/preference_dataset.py``): split manifests of store shards."""

    run_hash: str = Field(min_length=8)
    root: str
    train_path: str
    validation_path: str
    train_pairs: int = Field(gt=0)
    validation_pairs: int = Field(gt=0)
    days: list[str]
    tokenizer_path: str
    shards_reused: int = 0


class Checkpoint(Artifact):
    checkpoint_id: str = Field(min_length=1)
    path: str
    num_steps: int = Field(ge=0)
    training_loss: float | None = None
    validation_loss: float | None = None
    dataset_run_hash: str | None = None
    dataset_validation_path: str | None = None
    model_preset: str | None = None
    scale: str | None = None
    training_run_id: str | None = None  # the Dagster run that trained it
    mlflow_run_id: str | None = None
    parameters_total: int | None = None
    parameters_active: int | None = None
    stage: str = (
        "sft"  # "sft" (moe_checkpoint), "pretrain" (base_model), "preference" (preference_checkpoint), "rl"
    )
    # preference checkpoints: reward margin and accuracy on the held-out pairs, with their n, as training measured
    preference_metrics: dict[str, float] | None = None
    # RL checkpoints: first and last rollout reward, held-out reward with its n, rollout and update seconds
    rl_metrics: dict[str, float] | None = None
    parent: str | None = (
        None  # what its weights started from: scratch, base:<id>, production:<id>, path:<dir>
    )
    # what init_from asked for; "base" with parent "scratch": no base model existed yet (a fresh instance)
    init_requested: str | None = None
    # base models: the corpus documents (ids) it never trained on, left out as contaminated, and the share of
    # documents on the frozen eval set's side (also left out): what an evaluation of its descendants subtracts
    excluded_documents: list[str] | None = None
    eval_side_fraction: float | None = None

    def record(self, data_root: str) -> dict[str, Any]:
        """What ``checkpoint.json`` holds: this record with its paths relative to ``data_root`` (a moved or copied
        data root keeps it valid; readers take the model from the folder the record lies in)."""
        return {
            **self.model_dump(),
            "path": roots.relative_to(self.path, data_root),
            "dataset_validation_path": roots.relative_to(self.dataset_validation_path, data_root)
            if self.dataset_validation_path
            else None,
        }

    @field_validator("path")
    @classmethod
    def _is_hf_dir(cls, v: str) -> str:
        p = Path(v)
        if not (p / "config.json").exists():
            raise ValueError(f"checkpoint {v} has no config.json (not a Hugging Face model directory)")
        if not any(p.glob("*.safetensors")):
            raise ValueError(f"checkpoint {v} has no .safetensors weights")
        return v


class EvalReport(Artifact):
    """One checkpoint measured on one frozen eval-set version (``core.eval_set``), and the gate's decision.

    The ``eval_*`` fields are comparable across every report of the same ``eval_set_version``; the production
    fields and the difference come from scoring production on the same examples in the same run."""

    checkpoint_id: str
    checkpoint_path: str
    eval_set_version: int | None = None  # None: a report written before eval sets existed (not comparable)
    # the version's content hash (core.evaluation.eval_set.content_sha256): two reports that say the same version
    # measured the same data when these agree (None: a report written before it was recorded)
    eval_set_sha256: str | None = None
    eval_loss: float | None = None
    eval_examples: int | None = Field(default=None, gt=0)
    eval_tokens: int | None = Field(default=None, gt=0)
    perplexity: float = Field(ge=1)
    validation_loss: float | None = None  # the checkpoint's own validation split, as training recorded it
    validation_tokens: int | None = None
    judge_score: float | None = Field(default=None, ge=1, le=5)
    judge_method: str | None = None
    num_heldout_prompts: int = Field(ge=0)
    dataset_run_hash: str | None = None
    win_rate_vs_production: float | None = Field(default=None, ge=0, le=1)
    production_checkpoint_id: str | None = None
    production_eval_loss: float | None = None
    eval_loss_difference: float | None = None  # candidate - production on the same examples
    eval_loss_difference_interval: tuple[float, float] | None = None
    win_rate_interval: tuple[float, float] | None = None
    # the prompts the judge gave a verdict on (pairwise: both orders of each answer pair; pointwise: each answer
    # scored alone); only the usable ones (order-consistent, or decisive) count in the win rate's n
    win_rate_verdicts: int | None = None
    judge_mode: str | None = None  # pairwise | pointwise (promotion.yaml preference.judge_mode)
    win_rate_headline: float | None = None  # flips (pairwise) and ties (pointwise) counted as half a win
    judge_order_consistency: float | None = (
        None  # pairwise: share of judged prompts whose verdict survived the swap
    )
    judge_flips: int | None = None  # pairwise: readable in both orders, a different winner
    judge_ties: int | None = None  # pointwise: both answers scored the same (within tie_epsilon)
    judge_unreadable: int | None = None  # prompts with no readable verdict, counted apart from flips
    gate_decision: str | None = None  # promote | hold back | insufficient evidence
    gate_reason: str | None = None
    gate_metric: str | None = None  # what the gate compared (promotion.yaml's metric)
    gate_n: int | None = None  # the evidence it rested on: examples, consistent verdicts or benchmark samples
    gate_method: str | None = None  # how its interval was computed
    gate_rule: str | None = None  # the rule that decided, e.g. "interval high < -0.0", "n >= 30"
    # its place among the gate decisions on its eval-set version against its production model, and the two-sided
    # confidence of every interval it computed (core.evaluation.attempts: each earlier decision halves the error)
    gate_attempt: int | None = None
    gate_confidence: float | None = None
    # the share of the eval set (or of the gate's benchmark items) whose n-grams occur in the candidate's training
    # data (None: unknown, e.g. a checkpoint copied in without its dataset), and which items
    contamination: float | None = None
    contaminated_items: list[str] = Field(default_factory=list)
    stage: str = "sft"  # the checkpoint's: sft or preference
    length_controlled_win_rate: float | None = None  # the win rate at a zero length difference (AlpacaEval's)
    mean_length_change: float | None = None  # candidate minus production, characters per answer
    preference_metrics: dict[str, float] | None = None  # held-out reward accuracy and margin, from training
    guards: list[str] = Field(default_factory=list)  # the guards that held it back, if any (each reason)
    # core.evaluation.guards' figures on the per-example differences (skewness, regressed share, slices), whatever
    # it decided; None: nothing per example was guarded (no production, pairwise verdicts, a benchmark gate)
    guard: dict[str, Any] | None = None
    # RL checkpoints: the reward gate's figures (both models' mean held-out reward, the paired difference with its
    # interval, n, the reward names, the RL eval set's version and hash) and training's rl_metrics
    reward_gate: dict[str, Any] | None = None
    report_json: str
    report_markdown: str
    parent: str | None = None  # what the checkpoint's weights started from (Checkpoint.parent)
    init_requested: str | None = None  # what its training's init_from asked for (Checkpoint.init_requested)
    # lm-evaluation-harness scores, {"tasks": {task: {metric: {value, stderr, higher_is_better}}}, ...}
    benchmarks: dict[str, Any] | None = None
    production_benchmarks: dict[str, Any] | None = None


class BaseModelEval(Artifact):
    """One base model measured on one frozen eval-set version's corpus documents (``core.eval_set``).

    Every report of the same ``eval_set_version`` is measured on the same documents (``documents_sha256``), so a
    base model trained on a bigger, later corpus compares with an earlier one."""

    checkpoint_id: str
    checkpoint_path: str
    eval_set_version: int
    eval_set_sha256: str | None = None  # the version's content hash, as EvalReport's
    corpus_run_hash: str | None = None  # the corpus the base model trained on
    eval_corpus_run_hash: str | None = None  # the corpus the eval set's documents were frozen from
    documents: int = Field(gt=0)
    tokens: int = Field(gt=0)
    loss: float
    loss_interval: tuple[float, float]
    perplexity: float = Field(ge=1)
    perplexity_interval: tuple[float, float]
    documents_sha256: str  # of the frozen corpus.parquet: the same for every report of this version
    report_json: str
    mlflow_run_id: str | None = None
