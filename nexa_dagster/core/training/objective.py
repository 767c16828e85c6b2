"""What a training objective plugs into the one training loop (``loop.train``), torchtitan's shape.

The loop owns everything a run does whatever it minimises: the engine, resume, the prefetching loader, the stall
watchdog, stop on SIGTERM, the non-finite guard, metrics lines, resumable state and the export. An objective owns
what differs: its data (loaded and checked before a model is built), the micro-batches it feeds the model, the
forward pass and loss of one micro-batch, what a step's mean is taken over (loss tokens for the language-model
loss, pairs for DPO, completions for GRPO) and the held-out figures at the end. Three exist:
``lm_objective.LanguageModelLoss`` (pretraining, SFT), ``preference.DPOLoss`` (the DPO family) and
``grpo.GRPOLoss`` (online RL); ``objectives.build_objective`` picks one from the job's typed ``objective`` section.

An objective whose batches depend on the weights (GRPO samples its completions from the current policy) makes them
in ``rollout``, which the loop calls in the training thread at the start of each step with the step's micro-batches
as the prefetching thread prepared them; ``resume_state``/``restore`` let it save and check its own position with
the engine's state. ``StepHooks`` gives the objectives that need neither the identity.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from nexa_dagster.core.training.data import Batch

MessageFn = Callable[[str], None]


@dataclass
class MicroTerms:
    """One micro-batch's share of a step: what the loop weights, sums and backpropagates."""

    loss_sum: (
        torch.Tensor
    )  # the objective summed over this micro-batch's units (tokens, pairs), with gradient
    aux_loss: torch.Tensor  # the router's load-balancing loss of the micro-batch (a mean, padding left out)
    expert_load: torch.Tensor  # [layers, experts], detached
    metric_sums: dict[str, torch.Tensor] = field(default_factory=dict)  # summed over units, detached


def micro_objective(
    terms: MicroTerms, weight: float, aux_coef: float, accumulation: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the objective's part, the whole loss) of one micro-batch's backward: the summed loss weighted by
    ``world_size / global units`` (DeepSpeed averages gradients over ranks), plus the router's aux loss as a mean
    per micro-batch. One micro-batch on one rank: ``mean loss + aux_coef * aux``."""
    main = terms.loss_sum * weight
    return main, main + aux_coef * terms.aux_loss / accumulation


class Objective(Protocol):
    """A pluggable objective (see the module docstring); every method but ``terms`` runs on the host."""

    metric_keys: tuple[str, ...]  # step metrics beyond the loss, each a mean over the step's units
    host_keys: frozenset[str]  # batch entries the loader leaves on the host (counts read without a GPU sync)
    seq_len: int  # tokens per row the model sees (the FLOPs estimate's attention term)

    def describe(self) -> str:
        """What the data is, for the "engine ready" line."""

    def prepare(self, engine: Any, device: torch.device, say: MessageFn) -> None:
        """Work before the first update and before resuming (DPO: the reference log-probabilities)."""

    def batches(self, micro_batch: int, seed: int, rank: int, world_size: int, start: int) -> Iterator[Batch]:
        """This rank's micro-batches from global micro-batch number ``start`` on: a pure function of the seed and
        the position, so a resumed run gets what an uninterrupted one would have seen next."""

    def units(self, batch: Batch) -> int:
        """What the step's mean is over, in this micro-batch (a host count)."""

    def tokens(self, batch: Batch) -> int:
        """Tokens trained on in this micro-batch (a host count)."""

    def terms(self, model: Callable[..., Any], batch: Batch) -> MicroTerms:
        """Forward pass and loss of one micro-batch (``model``: the engine or the bare model)."""

    def evaluate(self, model: torch.nn.Module, device: torch.device, say: MessageFn) -> dict[str, Any]:
        """Held-out figures for ``TrainingResult`` (``validation_loss`` always)."""

    def rollout(self, engine: Any, micro: list[Batch], step: int) -> list[Batch]:
        """The step's micro-batches made from what the loader gave, with the current weights (GRPO's samples)."""

    def resume_state(self, step: int) -> dict[str, Any]:
        """What the objective saves with the engine's state at ``step``."""

    def restore(self, state: dict[str, Any] | None, step: int) -> None:
        """Check (and take back) what ``resume_state`` saved, before resuming at ``step``; raise if it cannot."""


class StepHooks:
    """The step hooks of an objective whose batches do not depend on the weights: nothing to do."""

    def rollout(self, engine: Any, micro: list[Batch], step: int) -> list[Batch]:
        return micro

    def resume_state(self, step: int) -> dict[str, Any]:
        return {}

    def restore(self, state: dict[str, Any] | None, step: int) -> None:
        """Its position is the step's: ``batches(start=...)`` alone restores it."""
