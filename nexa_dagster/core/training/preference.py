"""DPO in the project's own training worker: preference pairs -> DeepSpeed engine -> Hugging Face MoE checkpoint.

The same run as ``loop.train`` (read it first), with a preference objective instead of the LM loss: the model,
engine, resumable state, stop on SIGTERM, non-finite guard, stall watchdog, progress, metrics lines and export are
``loop.py``'s own. What differs:

1. the reference log-probabilities of every pair (train and validation) come from a file beside the pairs; when
   it is missing, the reference checkpoint (by default ``init_from``: the weights before any update) scores the
   pairs once, in eval mode without gradients, every rank its share, and rank 0 writes the file. Training then
   never holds a second model, and a resumed attempt reads the file its first attempt wrote;
2. a step's micro-batches are ``2b`` rows of ``b`` pairs (``preference_data.collate_pairs``); the model returns
   each row's summed completion log-probability (``NexaMoEForCausalLM.sequence_logps``) and the loss is DPO's
   ``-log sigmoid(beta * ((pc - rc) - (pr - rr)))`` (``sigmoid``), or with each log-ratio divided by its
   completion's token count (``sigmoid_norm``), averaged over the global batch, plus
   ``router_aux_loss_coef x`` the router's load-balancing loss (padding left out), exactly as TRL's
   ``DPOTrainer`` computes it;
3. logged per step: the DPO loss, reward margin and accuracy, chosen and rejected rewards and log-probabilities;
   at the end the validation pairs give the held-out reward accuracy and margin (``TrainingResult``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nexa_dagster import settings
from nexa_dagster.core.common.faults import NAN_AT_STEP, STALL_AT_STEP, fault_point
from nexa_dagster.core.common.progress import Progress
from nexa_dagster.core.llm.model_identity import model_fingerprint
from nexa_dagster.core.training import monitor
from nexa_dagster.core.training.data import Batch, Prefetcher
from nexa_dagster.core.training.init import load_mixtral_checkpoint, read_config
from nexa_dagster.core.training.job import TrainingJob, TrainingResult
from nexa_dagster.core.training.loop import (
    Control,
    LogFn,
    MessageFn,
    MetricsWindow,
    RunTotals,
    all_reduce_sum,
    build_engine,
    build_model,
    count_parameters,
    finish_run,
    load_state,
    load_tokenizer,
    open_run,
    save_state,
    state_dir,
)
from nexa_dagster.core.training.nonfinite import NonFiniteGuard
from nexa_dagster.core.training.preference_data import (
    PAIR_HOST_KEYS,
    REAL_TOKENS,
    Pairs,
    check_disjoint,
    collate_pairs,
    load_pairs,
    pair_batches,
    rank_rounds,
    read_reference_logps,
    reference_logps_file,
    write_reference_logps,
)
from nexa_dagster.core.training.stop import STOP, StopRequested

STEP_METRICS = (
    "reward_chosen",
    "reward_rejected",
    "reward_margin",
    "reward_accuracy",
    "logps_chosen",
    "logps_rejected",
)


# -- the objective ----------------------------------------------------------------------------------------------
@dataclass
class DPOTerms:
    """One micro-batch's DPO terms: per-pair losses (with gradient) and what the metrics report (detached)."""

    losses: torch.Tensor  # [pairs]
    chosen_rewards: torch.Tensor  # beta * (chosen logps - reference chosen logps), [pairs]
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    aux_loss: torch.Tensor  # the router's load-balancing loss over the 2b rows, padding left out
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


def preference_terms(model: Callable[..., Any], batch: Batch, beta: float, loss_type: str) -> DPOTerms:
    """Score a micro-batch's ``2b`` rows with ``model`` (a ``NexaMoEForCausalLM`` or the DeepSpeed engine that
    wraps one) and turn the sequence log-probabilities into DPO terms against the batch's reference values."""
    out = model(
        input_ids=batch["input_ids"],
        labels=batch["labels"],
        attention_mask=batch["attention_mask"],
        per_sequence=True,
    )
    pairs = batch["ref_chosen"].shape[0]
    logps, tokens = out.sequence_logps, batch["completion_tokens"]
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
        aux_loss=out.aux_loss,
        expert_load=out.expert_load,
    )


def micro_batch_objective(
    terms: DPOTerms, weight: float, aux_coef: float, accumulation: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(DPO part, whole objective) of one micro-batch's backward: the per-pair losses summed and weighted by
    ``world_size / global pairs`` (DeepSpeed averages gradients over ranks), plus the router's aux loss, a mean
    per micro-batch as in SFT. One micro-batch of ``b`` pairs on one rank: ``mean(losses) + coef * aux``."""
    dpo = terms.losses.sum() * weight
    return dpo, dpo + aux_coef * terms.aux_loss / accumulation


@dataclass
class StepTotals:
    """A step's sums over its micro-batches, this rank's share (device tensors: reading them waits for the GPU)."""

    loss: Any  # DPO loss (world_size x this rank's share of the global mean)
    aux_loss: Any
    objective: Any  # what the backward passes minimised: loss + router_aux_loss_coef * aux_loss
    metrics: dict[str, Any]
    tokens: int  # real (non-padding) tokens, counted on the host
    expert_load: Any


def preference_step(
    engine: Any,
    batches: Iterator[Batch],
    accumulation: int,
    control: Control,
    guard: NonFiniteGuard,
    step: int,
    beta: float,
    loss_type: str,
    poison: bool = False,
) -> StepTotals:
    """One optimizer step over ``accumulation`` micro-batches of pairs (``loop.optimizer_step`` with DPO's loss).

    Every pair of the global batch (all micro-batches, all ranks) weighs the same. Raises ``StopRequested``
    before the step when any rank was asked to stop; a non-finite loss never reaches the weights
    (``NonFiniteGuard``). ``poison`` (tests) turns the loss into NaN.
    """
    micro = [next(batches) for _ in range(accumulation)]
    _, stop = control.agree(0, STOP.is_set())
    if stop:
        raise StopRequested(step - 1)
    global_pairs = sum(b["ref_chosen"].shape[0] for b in micro) * control.world_size
    weight = control.world_size / global_pairs
    aux_coef = engine.module.config.router_aux_loss_coef
    loss = aux = objective = expert_load = 0
    metrics: dict[str, Any] = dict.fromkeys(STEP_METRICS, 0)
    tokens = 0
    for i, batch in enumerate(micro):
        terms = preference_terms(engine, batch, beta, loss_type)
        dpo, total = micro_batch_objective(terms, weight, aux_coef, accumulation)
        if poison:
            dpo, total = dpo * float("nan"), total * float("nan")
        loss = loss + dpo.detach()
        aux = aux + terms.aux_loss.detach() / accumulation
        objective = objective + total.detach()
        for key, value in terms.metric_sums().items():
            metrics[key] = metrics[key] + value * weight
        if i == accumulation - 1:  # on device: a non-finite step loss makes every gradient non-finite
            guard.record(step, loss + aux)
            total = total * guard.gate(loss + aux)
        engine.backward(total, scale_wrt_gas=False)
        expert_load = expert_load + terms.expert_load / accumulation
        tokens += int(batch[REAL_TOKENS])  # a host count (collate_pairs): no GPU sync
        if i == accumulation - 1:
            guard.before_update(step)
        engine.step()
        if i == accumulation - 1:
            guard.after_update(engine, step)
    return StepTotals(loss, aux, objective, metrics, tokens, expert_load)


# -- scoring whole splits: the reference values and the held-out rewards ----------------------------------------
@torch.no_grad()
def score_pairs(
    model: torch.nn.Module, pairs: Pairs, micro_batch: int, pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every pair's (chosen, rejected) summed completion log-probabilities under ``model``, float64 on the host.

    Eval mode, no gradients; each rank scores its share (``rank_rounds``) and the shares are summed over ranks
    (each value comes from one rank, zeros elsewhere: the sum is exact).
    """
    rank, world_size = int(settings.RANK.get()), int(settings.WORLD_SIZE.get())
    chosen = torch.zeros(len(pairs), dtype=torch.float64)
    rejected = torch.zeros(len(pairs), dtype=torch.float64)
    was_training = model.training
    model.eval()
    try:
        for mine in rank_rounds(len(pairs), micro_batch, rank, world_size):
            indices = mine or [0]  # a filler batch keeps the ranks' forward counts equal (ZeRO-3)
            batch = collate_pairs(pairs, indices, pad_id)
            logps = (
                model(
                    input_ids=batch["input_ids"].to(device),
                    labels=batch["labels"].to(device),
                    attention_mask=batch["attention_mask"].to(device),
                    per_sequence=True,
                )
                .sequence_logps.double()
                .cpu()
            )
            if mine:
                chosen[mine], rejected[mine] = (
                    logps[: len(mine)],
                    logps[len(indices) : len(indices) + len(mine)],
                )
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


def held_out_rewards(
    model: torch.nn.Module,
    pairs: Pairs,
    beta: float,
    loss_type: str,
    micro_batch: int,
    pad_id: int,
    device: torch.device,
) -> HeldOut:
    """The validation pairs' mean DPO loss, reward accuracy (chosen reward strictly above rejected) and margin."""
    chosen, rejected = score_pairs(model, pairs, micro_batch, pad_id, device)
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
    reference_dir = job.reference_path or job.init_from
    reference_id = model_fingerprint(reference_dir)
    path = job.reference_logps_path or reference_logps_file(job.train_path, reference_id)
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
    same = not job.reference_path or Path(job.reference_path).resolve() == Path(job.init_from).resolve()
    scorer = engine.module
    if not same:
        dtype = next(engine.module.parameters()).dtype
        scorer = load_mixtral_checkpoint(job.reference_path, attention=job.settings.attention).to(
            device, dtype
        )
    micro = job.settings.micro_batch_size
    values: dict[str, tuple[float, float]] = {}
    for pairs in (train, validation):
        chosen, rejected = score_pairs(scorer, pairs, micro, pad_id, device)
        values.update(zip(pairs.pair_ids, zip(chosen.tolist(), rejected.tolist(), strict=True), strict=True))
    del scorer
    if rank == 0:
        ids = train.pair_ids + validation.pair_ids
        write_reference_logps(
            path,
            reference_id,
            job.reference_path or job.init_from,
            job.dataset_run_hash,
            ids,
            [values[p][0] for p in ids],
            [values[p][1] for p in ids],
        )
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()  # the file is whole before any rank trains (a killed rank 0 leaves no sidecar)
    say(
        f"reference log-probabilities of {len(values)} pairs computed in {time.perf_counter() - start:.1f} s "
        f"with {job.reference_path or job.init_from} ({reference_id}), stored in {path}"
    )
    return values


# -- the run ----------------------------------------------------------------------------------------------------
def train_preference(
    job: TrainingJob, on_log: LogFn | None = None, on_message: MessageFn | None = None
) -> TrainingResult:
    """Train ``job`` (``data_kind: preference``) with DPO in this process (one rank); rank 0 saves the checkpoint.

    ``on_log(step, metrics)`` gets, besides ``loop.train``'s metrics (``loss`` is the DPO loss), ``reward_margin``,
    ``reward_accuracy``, ``reward_chosen``, ``reward_rejected``, ``logps_chosen`` and ``logps_rejected``.
    """
    t_start = time.perf_counter()
    s = job.settings
    rank, world_size, say, output_dir = open_run(job, on_message)

    # 1. pairs, tokenizer and reference values: every input checked before a model is built
    tokenizer = load_tokenizer(job)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    max_length = int(read_config(job.init_from).get("max_position_embeddings", 0)) or 1 << 30
    train_pairs = load_pairs(job.train_path, tokenizer, max_length)
    val_pairs = load_pairs(job.validation_path, tokenizer, max_length)
    check_disjoint(train_pairs, val_pairs)
    reference_id, reference_file, reference = reference_values(job, train_pairs, val_pairs, say)

    # 2. model and engine
    model = build_model(job, len(tokenizer), tokenizer)
    say(f"weights from {job.parent} ({job.init_from})")
    total_params, active_params = count_parameters(model)
    engine = build_engine(model, job, world_size, say)
    device = engine.device if isinstance(engine.device, torch.device) else torch.device(engine.device)
    longest = max(
        p.size + max(c.size, r.size)
        for p, c, r in zip(train_pairs.prompt, train_pairs.chosen, train_pairs.rejected, strict=True)
    )
    per_token_flops = monitor.flops_per_token(
        active_params, model.config.num_hidden_layers, model.config.hidden_size, longest
    )
    peak = monitor.peak_flops(device)
    say(
        f"engine ready: {total_params:,} parameters ({active_params:,} active), ZeRO stage "
        f"{engine.zero_optimization_stage()}, {len(train_pairs)} training pairs, {len(val_pairs)} validation "
        f"pairs, DPO {job.dpo_loss} beta {job.dpo_beta}, world size {world_size}, device {device}"
    )

    # 3. reference values (before any update and before resuming: the engine's model is still init_from)
    if reference is None:
        reference = compute_reference_values(
            job, engine, train_pairs, val_pairs, reference_id, reference_file, pad_id, device, say
        )
    train_pairs.with_reference(reference)
    val_pairs.with_reference(reference)

    # 4. resume from the last saved state of an earlier attempt of this run, if there is one
    start_step, metrics_log, tokens_seen, tokens_before = 0, [], 0, 0
    resumed = load_state(engine, job)
    if resumed is not None:
        start_step, metrics_log, tokens_seen = resumed["step"], resumed["metrics_log"], resumed["tokens_seen"]
        tokens_before = tokens_seen
        say(f"resumed from step {start_step} ({state_dir(job)})")

    # 5. the loop
    accumulation = s.gradient_accumulation_steps
    batches = Prefetcher(
        pair_batches(
            train_pairs, s.micro_batch_size, s.seed, rank, world_size, pad_id, start=start_step * accumulation
        ),
        device,
        depth=s.prefetch,
        host_keys=PAIR_HOST_KEYS,
    )
    step = start_step
    watchdog = monitor.StallWatchdog(s.stall_timeout_s, lambda: f"rank {rank}, last completed step {step}")
    control = Control(world_size)
    guard = NonFiniteGuard(engine, device, control.group)
    window = MetricsWindow(batches, world_size, per_token_flops, peak, device, last_step=start_step)
    train_start = time.perf_counter()
    with contextlib.ExitStack() as running:
        running.callback(watchdog.stop)
        running.callback(batches.close)
        progress = running.enter_context(Progress(say, "training steps", every_s=s.progress_every_s))
        progress(start_step, s.max_steps)

        def log_line(step: int, totals: StepTotals, lr: float) -> None:
            nonlocal tokens_seen
            guard.check(step)  # the one host read of the on-device non-finite flag, at log steps only
            metrics = window.close(
                step,
                totals.loss,
                totals.aux_loss,
                lr,
                engine.get_global_grad_norm(),
                totals.expert_load,
                extra=totals.metrics,
            )
            metrics_log.append(metrics)
            tokens_seen += int(metrics["tokens"])
            if on_log and rank == 0:
                on_log(step, {k: v for k, v in metrics.items() if k != "step"})

        last: tuple[StepTotals, float] | None = None
        for step in range(start_step + 1, s.max_steps + 1):
            lr = engine.get_lr()[0]
            try:
                totals = preference_step(
                    engine,
                    batches,
                    accumulation,
                    control,
                    guard,
                    step,
                    job.dpo_beta,
                    job.dpo_loss,
                    poison=fault_point(NAN_AT_STEP, step=step),
                )
            except StopRequested as stop:  # every rank is here, at the same step: save together, then leave
                if stop.step > start_step:
                    if stop.step > window.last_step and last is not None:
                        log_line(stop.step, *last)
                    save_state(engine, job, stop.step, metrics_log, tokens_seen)
                    say(f"saved resumable state at step {stop.step}; stopping as asked (SIGTERM)")
                raise
            last = (totals, lr)
            window.add(totals.tokens)
            watchdog.beat()
            progress(step, s.max_steps)
            fault_point(STALL_AT_STEP, step=step, stall_s=10 * s.stall_timeout_s)  # test-only
            if step == 1 or step % s.log_every == 0 or step == s.max_steps:
                log_line(step, *last)
            if s.checkpoint_every and step % s.checkpoint_every == 0 and step < s.max_steps:
                save_state(engine, job, step, metrics_log, tokens_seen)
                say(f"saved resumable state at step {step}")
    train_s = time.perf_counter() - train_start

    # 6. held-out rewards, then save (rank 0)
    held_out = held_out_rewards(
        engine.module, val_pairs, job.dpo_beta, job.dpo_loss, s.micro_batch_size, pad_id, device
    )
    say(
        f"validation: {held_out.pairs} pairs, DPO loss {held_out.loss:.4f}, reward accuracy "
        f"{held_out.reward_accuracy:.3f}, reward margin {held_out.reward_margin:.4f}"
    )
    return finish_run(
        job,
        engine,
        tokenizer,
        metrics_log,
        RunTotals(start_step, tokens_seen, tokens_before, train_s, t_start, total_params, active_params),
        say,
        validation_loss=held_out.loss,
        reward_accuracy=held_out.reward_accuracy,
        reward_margin=held_out.reward_margin,
        validation_pairs=held_out.pairs,
    )
