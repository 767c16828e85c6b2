"""The language-model objective (pretraining, SFT): next-token cross-entropy over the learned tokens of packed rows.

A step's loss is the token mean over the whole global batch (torchtitan style): each micro-batch's summed token loss
is weighted by ``world_size / global loss tokens``, so a packed row with few assistant tokens weighs what its tokens
weigh, not as much as a full one. The held-out figure is the validation set's mean token NLL.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from nexa_dagster.core.training.collectives import all_reduce_sum
from nexa_dagster.core.training.data import (
    HOST_KEYS,
    IGNORE_INDEX,
    LOSS_TOKENS,
    Batch,
    labels_for,
    load_job_data,
    micro_batches,
)
from nexa_dagster.core.training.job import TrainingJob
from nexa_dagster.core.training.objective import MessageFn, MicroTerms, StepHooks


class LanguageModelLoss(StepHooks):
    """``objective: {kind: language_model}``: the packed rows of ``load_job_data``, the LM loss weighted by tokens."""

    metric_keys: tuple[str, ...] = ()
    host_keys = frozenset(HOST_KEYS)

    def __init__(
        self,
        train: Batch,
        validation: Batch,
        micro_batch: int,
        rank: int = 0,
        world_size: int = 1,
        heldout_documents: int = 0,
    ) -> None:
        self.train, self.validation, self.heldout_documents = train, validation, heldout_documents
        self.seq_len = int(train["input_ids"].shape[1])
        self.micro_batch, self.rank, self.world_size = micro_batch, rank, world_size

    @classmethod
    def for_job(cls, job: TrainingJob, tokenizer: Any, rank: int, world_size: int) -> LanguageModelLoss:
        """The job's packed rows (``load_job_data``), checked for the tokenizer's vocabulary."""
        train, validation, heldout_documents = load_job_data(job, tokenizer)
        return cls(train, validation, job.settings.micro_batch_size, rank, world_size, heldout_documents)

    def describe(self) -> str:
        return f"{self.train['input_ids'].shape[0]} packed rows of {self.seq_len} tokens"

    def prepare(self, engine: Any, device: torch.device, say: MessageFn) -> None:
        """Nothing to prepare: the rows are ready."""

    def batches(self, micro_batch: int, seed: int, rank: int, world_size: int, start: int) -> Iterator[Batch]:
        return micro_batches(self.train, micro_batch, seed, rank, world_size, start=start)

    def units(self, batch: Batch) -> int:
        return int(batch[LOSS_TOKENS])

    def tokens(self, batch: Batch) -> int:
        return batch["input_ids"].numel()  # packed rows: padding is rare, count slots (no GPU sync)

    def terms(self, model: Callable[..., Any], batch: Batch) -> MicroTerms:
        out = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=labels_for(batch)
        )
        return MicroTerms(out.lm_loss_sum, out.aux_loss, out.expert_load)

    def evaluate(self, model: torch.nn.Module, device: torch.device, say: MessageFn) -> dict[str, Any]:
        loss = validation_loss(model, self.validation, device, self.micro_batch, self.rank, self.world_size)
        say(f"validation loss {loss:.4f}")
        return {"validation_loss": loss, "validation_documents": self.heldout_documents}


@torch.no_grad()
def validation_loss(
    model: torch.nn.Module, data: Batch, device: torch.device, micro_batch: int, rank: int, world_size: int
) -> float:
    """Mean token NLL over the loss-mask tokens of the validation set (no router aux loss), all ranks."""
    model.eval()
    rows = torch.arange(rank, data["input_ids"].shape[0], world_size)
    nll, count = 0.0, 0
    for start in range(0, len(rows), micro_batch):
        batch = {k: v[rows[start : start + micro_batch]].to(device) for k, v in data.items()}
        labels = labels_for(batch)
        learned = int(labels[:, 1:].ne(IGNORE_INDEX).sum())
        if learned:
            out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=labels)
            nll += float(out.lm_loss) * learned
            count += learned
    model.train()
    nll, count = all_reduce_sum(nll, count)
    return nll / count if count else float("nan")
