"""The job's typed ``objective`` section -> the objective the training loop runs (``objective.Objective``)."""

from __future__ import annotations

from typing import Any

from nexa_dagster.core.training.grpo import GRPOLoss
from nexa_dagster.core.training.job import DPOObjective, GRPOObjective, TrainingJob
from nexa_dagster.core.training.lm_objective import LanguageModelLoss
from nexa_dagster.core.training.objective import MessageFn, Objective
from nexa_dagster.core.training.preference import DPOLoss


def build_objective(
    job: TrainingJob, tokenizer: Any, rank: int, world_size: int, say: MessageFn
) -> Objective:
    """Load and check the objective's data (before any model is built) and return it."""
    if isinstance(job.objective, DPOObjective):
        return DPOLoss(job, tokenizer, say)
    if isinstance(job.objective, GRPOObjective):
        return GRPOLoss(job, tokenizer, say)
    return LanguageModelLoss.for_job(job, tokenizer, rank, world_size)
