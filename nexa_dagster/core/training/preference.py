"""The DPO family as an objective of the one training loop (``loop.train``): preference pairs -> DPO loss.

What this objective brings to the loop (``core/training/objective.py`` says what the loop owns):

1. the pairs (``preference_data.load_pairs``), checked before a model is built, packed into micro-batches of one
   fixed shape (``preference_data.PairLayout``): prompt+chosen and prompt+rejected as documents of packed rows, with
   attention within documents, as SFT packs samples;
2. the reference log-probabilities of every pair (train and validation) from a file beside the pairs; when it is
   missing, the reference checkpoint (by default ``init_from``: the weights before any update) scores the pairs
   once, in eval mode without gradients, through the same packed batches, every rank its share, and rank 0 writes
   the file. Training then never holds a second model, and a resumed attempt reads the file its first attempt wrote;
3. the loss: the model returns each token's log-probability (``NexaMoEForCausalLM.token_logps``), summed per
   document (``segment_sums``), and the loss is DPO's ``-log sigmoid(beta * ((pc - rc) - (pr - rr)))``
   (``sigmoid``), or with each log-ratio divided by its completion's token count (``sigmoid_norm``), averaged over
   the pairs of the global batch, plus ``router_aux_loss_coef x`` the router's load-balancing loss (padding left
   out): exactly TRL's ``DPOTrainer`` whatever the layout;
4. logged per step: the DPO loss, reward margin and accuracy, chosen and rejected rewards and log-probabilities;
   at the end the validation pairs give the held-out reward accuracy and margin (``TrainingResult``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from nexa_dagster import settings
from nexa_dagster.core.llm.model_identity import model_fingerprint
from nexa_dagster.core.training.collectives import all_reduce_sum, barrier_if_distributed
from nexa_dagster.core.training.data import Batch
from nexa_dagster.core.training.init import load_mixtral_checkpoint, read_config
from nexa_dagster.core.training.job import DPOObjective, TrainingJob
from nexa_dagster.core.training.objective import MessageFn, MicroTerms, StepHooks
from nexa_dagster.core.training.preference_data import (
    PAIR_COUNT,
    PAIR_HOST_KEYS,
    REAL_TOKENS,
    PairLayout,
    Pairs,
    check_disjoint,
    load_pairs,
    pair_batches,
    pair_layout,
    read_reference_logps,
    reference_logps_file,
    scoring_batches,
    write_reference_logps,
)

STEP_METRICS = (
    "reward_chosen",
    "reward_rejected",
    "reward_margin",
    "reward_accuracy",
    "logps_chosen",
    "logps_rejected",
    "sft_loss",  # the chosen answers' mean token NLL (TRL's `sft` loss), trained on when sft_weight > 0
)


class DPOLoss(StepHooks):
    """``objective: {kind: dpo, ...}``: DPO on packed pairs against stored reference log-probabilities."""

    metric_keys = STEP_METRICS
    host_keys = PAIR_HOST_KEYS

    def __init__(self, job: TrainingJob, tokenizer: Any, say: MessageFn) -> None:
        """Pairs and stored reference values, every input checked before a model is built."""
        self.job, self.config = job, dpo_config(job)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        max_length = int(read_config(job.init_from).get("max_position_embeddings", 0)) or 1 << 30
        self.train = load_pairs(job.train_path, tokenizer, max_length)
        self.validation = load_pairs(job.validation_path, tokenizer, max_length)
        check_disjoint(self.train, self.validation)
        self.layout = pair_layout(
            [self.train, self.validation], job.settings.micro_batch_size, self.config.pack_length
        )
        self.seq_len = self.layout.length
        self.reference_id, self.reference_file, self.reference = reference_values(
            job, self.train, self.validation, say
        )

    def describe(self) -> str:
        return (
            f"{len(self.train)} training pairs, {len(self.validation)} validation pairs packed into "
            f"{self.layout.rows} rows of {self.layout.length} tokens per micro-batch, DPO {self.config.loss} "
            f"beta {self.config.beta}"
            + (f" + sft x{self.config.sft_weight}" if self.config.sft_weight else "")
        )

    def prepare(self, engine: Any, device: torch.device, say: MessageFn) -> None:
        """The reference values, computed now when no file holds them: before any update and before resuming, so
        the engine's model is still ``init_from``."""
        if self.reference is None:
            self.reference = compute_reference_values(
                self.job,
                engine,
                self.train,
                self.validation,
                self.reference_id,
                self.reference_file,
                self.layout,
                self.pad_id,
                device,
                say,
            )
        self.train.with_reference(self.reference)
        self.validation.with_reference(self.reference)

    def batches(self, micro_batch: int, seed: int, rank: int, world_size: int, start: int) -> Iterator[Batch]:
        return pair_batches(self.train, self.layout, seed, rank, world_size, self.pad_id, start=start)

    def units(self, batch: Batch) -> int:
        return int(batch[PAIR_COUNT])  # every pair of the global batch weighs the same

    def tokens(self, batch: Batch) -> int:
        return int(batch[REAL_TOKENS])  # real tokens (a host count): padding is not trained on

    def terms(self, model: Callable[..., Any], batch: Batch) -> MicroTerms:
        terms = preference_terms(model, batch, self.config.beta, self.config.loss)
        return dpo_micro_terms(terms, self.config.sft_weight)

    def evaluate(self, model: torch.nn.Module, device: torch.device, say: MessageFn) -> dict[str, Any]:
        held_out = validation_pair_figures(
            model, self.validation, self.config.beta, self.config.loss, self.layout, self.pad_id, device
        )
        say(
            f"validation: {held_out.pairs} pairs, DPO loss {held_out.loss:.4f}, reward accuracy "
            f"{held_out.reward_accuracy:.3f}, reward margin {held_out.reward_margin:.4f}"
        )
        return {
            "validation_loss": held_out.loss,
            "reward_accuracy": held_out.reward_accuracy,
            "reward_margin": held_out.reward_margin,
            "validation_pairs": held_out.pairs,
        }


def dpo_config(job: TrainingJob) -> DPOObjective:
    """The job's DPO section (a preference job always has one: ``TrainingJob`` checks it)."""
    if not isinstance(job.objective, DPOObjective):
        raise ValueError(f"training job {job.run_id}: objective {job.objective.kind} is not DPO")
    return job.objective


# -- the loss ---------------------------------------------------------------------------------------------------
@dataclass
class DPOTerms:
    """One micro-batch's DPO terms: per-pair losses (with gradient) and what the metrics report (detached)."""

    losses: torch.Tensor  # [pairs]
    chosen_rewards: torch.Tensor  # beta * (chosen logps - reference chosen logps), [pairs]
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    chosen_nll: (
        torch.Tensor
    )  # the chosen completions' mean token NLL over the micro-batch (TRL's `sft` loss), with grad
    aux_loss: torch.Tensor  # the router's load-balancing loss over the micro-batch's real tokens
    expert_load: torch.Tensor

    def metric_sums(self) -> dict[str, torch.Tensor]:
        """Sums over the pairs of the step metrics (device scalars; nothing is read back)."""
        return {
            "reward_chosen": self.chosen_rewards.sum(),
            "reward_rejected": self.rejected_rewards.sum(),
            "reward_margin": (self.chosen_rewards - self.rejected_rewards).sum(),
            "reward_accuracy": (self.chosen_rewards > self.rejected_rewards).float().sum(),
            "logps_chosen": self.chosen_logps.sum(),
            "logps_rejected": self.rejected_logps.sum(),
        }


def dpo_micro_terms(terms: DPOTerms, sft_weight: float) -> MicroTerms:
    """What the loop sums for one micro-batch: the pairs' DPO losses, plus ``sft_weight`` times the chosen answers'
    mean token NLL counted once per pair (the loop divides by the pairs: one micro-batch then gives TRL's
    ``loss_type=["sigmoid", "sft"]``, ``loss_weights=[1, sft_weight]``)."""
    pairs = terms.losses.shape[0]
    loss_sum = terms.losses.sum() + (sft_weight * pairs * terms.chosen_nll if sft_weight else 0.0)
    metrics = {**terms.metric_sums(), "sft_loss": terms.chosen_nll.detach() * pairs}
    return MicroTerms(loss_sum, terms.aux_loss, terms.expert_load, metrics)


def dpo_losses(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    loss_type: str,
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-pair DPO loss: ``-log sigmoid(beta * delta)`` with ``delta`` the chosen log-ratio minus the rejected one,
    each divided by its completion's token count for ``sigmoid_norm`` (TRL's two losses of those names)."""
    chosen_ratio, rejected_ratio = chosen_logps - ref_chosen, rejected_logps - ref_rejected
    if loss_type == "sigmoid_norm":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("sigmoid_norm needs the completions' token counts")
        delta = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
    elif loss_type == "sigmoid":
        delta = chosen_ratio - rejected_ratio
    else:
        raise ValueError(f"unknown DPO loss {loss_type!r}; sigmoid or sigmoid_norm")
    return -F.logsigmoid(beta * delta)


def segment_sums(token_logps: torch.Tensor, segments: torch.Tensor, slots: int) -> torch.Tensor:
    """``[slots]``: the token log-probabilities summed per document slot (``collate_packed``'s ``segments``; slot
    ``slots`` collects the padding and is dropped)."""
    sums = token_logps.new_zeros(slots + 1)
    return sums.index_add(0, segments.reshape(-1), token_logps.reshape(-1))[:slots]


def sequence_logps(model: Callable[..., Any], batch: Batch) -> tuple[torch.Tensor, Any]:
    """(``[2P]`` summed completion log-probabilities, chosen then rejected, of the batch's ``P`` pairs; the model's
    output for its aux loss and expert load)."""
    out = model(
        input_ids=batch["input_ids"],
        labels=batch["labels"],
        position_ids=batch["position_ids"],
        attention_mask=batch["attention_mask"],
        per_token=True,
    )
    return segment_sums(out.token_logps, batch["segments"], 2 * batch["pair_index"].shape[0]), out


def preference_terms(model: Callable[..., Any], batch: Batch, beta: float, loss_type: str) -> DPOTerms:
    """Score a packed micro-batch with ``model`` (a ``NexaMoEForCausalLM`` or the DeepSpeed engine that wraps one)
    and turn the pairs' sequence log-probabilities into DPO terms against the batch's reference values."""
    logps, out = sequence_logps(model, batch)
    pairs, tokens = batch["pair_index"].shape[0], batch["completion_tokens"]
    chosen, rejected = logps[:pairs], logps[pairs:]
    losses = dpo_losses(
        chosen,
        rejected,
        batch["ref_chosen"],
        batch["ref_rejected"],
        beta,
        loss_type,
        tokens[:pairs],
        tokens[pairs:],
    )
    return DPOTerms(
        losses=losses,
        chosen_rewards=beta * (chosen - batch["ref_chosen"]).detach(),
        rejected_rewards=beta * (rejected - batch["ref_rejected"]).detach(),
        chosen_logps=chosen.detach(),
        rejected_logps=rejected.detach(),
        chosen_nll=-chosen.sum() / tokens[:pairs].sum().clamp(min=1),
        aux_loss=out.aux_loss,
        expert_load=out.expert_load,
    )


# -- scoring whole splits: the reference values and the held-out rewards ----------------------------------------
@torch.no_grad()
def score_pairs(
    model: torch.nn.Module, pairs: Pairs, layout: PairLayout, pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every pair's (chosen, rejected) summed completion log-probabilities under ``model``, float64 on the host.

    Eval mode, no gradients, the training batches' shape (``scoring_batches``); each rank scores its share and the
    shares are summed over ranks (each value comes from one rank, zeros elsewhere: the sum is exact).
    """
    world_size = int(settings.WORLD_SIZE.get())
    chosen = torch.zeros(len(pairs), dtype=torch.float64)
    rejected = torch.zeros(len(pairs), dtype=torch.float64)
    was_training = model.training
    model.eval()
    try:
        for batch, mine in scoring_batches(pairs, layout, pad_id, int(settings.RANK.get()), world_size):
            on_device = {k: v.to(device) for k, v in batch.items()}
            logps = sequence_logps(model, on_device)[0].double().cpu()
            if mine:
                index, n = batch["pair_index"], batch["pair_index"].shape[0]
                chosen[index], rejected[index] = logps[:n], logps[n:]
    finally:
        model.train(was_training)
    if world_size > 1:
        summed = torch.tensor(all_reduce_sum(*chosen.tolist(), *rejected.tolist()), dtype=torch.float64)
        chosen, rejected = summed[: len(pairs)], summed[len(pairs) :]
    return chosen, rejected


@dataclass
class HeldOut:
    loss: float
    reward_accuracy: float
    reward_margin: float
    pairs: int


def validation_pair_figures(
    model: torch.nn.Module,
    pairs: Pairs,
    beta: float,
    loss_type: str,
    layout: PairLayout,
    pad_id: int,
    device: torch.device,
) -> HeldOut:
    """The validation pairs' mean DPO loss, reward accuracy (chosen reward strictly above rejected) and margin."""
    chosen, rejected = score_pairs(model, pairs, layout, pad_id, device)
    assert pairs.ref_chosen is not None and pairs.ref_rejected is not None
    ref_chosen, ref_rejected = pairs.ref_chosen.double(), pairs.ref_rejected.double()
    chosen_rewards, rejected_rewards = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
    losses = dpo_losses(
        chosen,
        rejected,
        ref_chosen,
        ref_rejected,
        beta,
        loss_type,
        torch.tensor([float(c.size) for c in pairs.chosen], dtype=torch.float64),
        torch.tensor([float(r.size) for r in pairs.rejected], dtype=torch.float64),
    )
    return HeldOut(
        loss=float(losses.mean()),
        reward_accuracy=float((chosen_rewards > rejected_rewards).double().mean()),
        reward_margin=float((chosen_rewards - rejected_rewards).mean()),
        pairs=len(pairs),
    )


def reference_values(
    job: TrainingJob,
    train: Pairs,
    validation: Pairs,
    say: MessageFn,
) -> tuple[str, str, dict[str, tuple[float, float]] | None]:
    """(reference id, file, stored values or None): the file this run's reference values live in, read when a
    complete one is there. Called before any model is built, so a file of another checkpoint fails at once."""
    config = dpo_config(job)
    reference_dir = config.reference_path or job.init_from
    reference_id = model_fingerprint(reference_dir)
    path = config.reference_logps_path or reference_logps_file(job.train_path, reference_id)
    stored = read_reference_logps(
        path, reference_id, job.dataset_run_hash, train.pair_ids + validation.pair_ids
    )
    if stored is not None:
        say(f"reference log-probabilities of {len(stored)} pairs read from {path}")
    return reference_id, path, stored


def compute_reference_values(
    job: TrainingJob,
    engine: Any,
    train: Pairs,
    validation: Pairs,
    reference_id: str,
    path: str,
    layout: PairLayout,
    pad_id: int,
    device: torch.device,
    say: MessageFn,
) -> dict[str, tuple[float, float]]:
    """Score every pair with the reference checkpoint and store the values (rank 0 writes, atomically).

    The reference is ``init_from`` unless ``reference_path`` names another checkpoint: then the engine's model,
    not yet updated nor resumed, is the reference itself, in the dtype it trains in; another checkpoint is loaded
    for the scoring alone and dropped.
    """
    rank = int(settings.RANK.get())
    start = time.perf_counter()
    config = dpo_config(job)
    same = not config.reference_path or Path(config.reference_path).resolve() == Path(job.init_from).resolve()
    scorer = engine.module
    if not same:
        dtype = next(engine.module.parameters()).dtype
        scorer = load_mixtral_checkpoint(config.reference_path, attention=job.settings.attention).to(
            device, dtype
        )
    values: dict[str, tuple[float, float]] = {}
    for pairs in (train, validation):
        chosen, rejected = score_pairs(scorer, pairs, layout, pad_id, device)
        values.update(zip(pairs.pair_ids, zip(chosen.tolist(), rejected.tolist(), strict=True), strict=True))
    del scorer
    if rank == 0:
        ids = train.pair_ids + validation.pair_ids
        write_reference_logps(
            path,
            reference_id,
            config.reference_path or job.init_from,
            job.dataset_run_hash,
            ids,
            [values[p][0] for p in ids],
            [values[p][1] for p in ids],
        )
    barrier_if_distributed()  # the file is whole before any rank trains (a killed rank 0 leaves no sidecar)
    say(
        f"reference log-probabilities of {len(values)} pairs computed in {time.perf_counter() - start:.1f} s "
        f"with {config.reference_path or job.init_from} ({reference_id}), stored in {path}"
    )
    return values
