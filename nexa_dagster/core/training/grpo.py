"""GRPO as an objective of the one training loop (``loop.train``): prompts -> on-policy rollouts -> rewards -> loss.

What this objective brings to the loop (``core/training/objective.py`` says what the loop owns):

1. the prompts (``grpo_rollout.load_prompts``) and the reward functions (``core/rl/rewards.py``), checked before a
   model is built; one prompt per micro-batch, so ``micro_batch_size`` is K (``num_generations``) and
   ``gradient_accumulation_steps x ranks`` is B (``prompts_per_step``);
2. the rollout phase, **on policy**: the loop's prefetching thread only prepares prompt *indices* (a pure function
   of the seed and the position); at the start of every step, in the training thread, ``rollout`` samples the K
   completions of each of the step's prompts from the weights of the last update, all K x B of this rank in one
   batched call (``rollout_engine``: ``transformers``, ``grpo_rollout.BatchedSampler``, transformers' Mixtral
   aliased onto the training tensors; or ``vllm``, ``vllm_sampler.VLLMSampler``, a vLLM engine the weights are
   synced to before each rollout), scores them, and turns each group into a micro-batch. Nothing sampled ahead of
   an update is ever trained on, whatever the prefetch depth. On vLLM, each completion's loss is weighted by the
   ratio of the trainer's probability of it to the engine's (``sampling_correction``, TRL's
   ``vllm_importance_sampling_correction``: the kernels differ, so the two disagree slightly);
3. advantages within each prompt's group: reward minus the group's mean, divided by the group's std (``group``),
   the whole batch's std (``batch``) or nothing (``none``) — TRL's ``scale_rewards``, with its ``+ 1e-4``;
4. the loss, TRL's ``GRPOTrainer._compute_loss``: per token ``-min(r A, clip(r, 1-eps, 1+eps) A) + beta KL`` with
   ``r = exp(logp - logp_old)`` and TRL's estimator ``KL = (exp(ref - logp) - (ref - logp) - 1) r`` (times the
   ratio: TRL 1.16's default, ``GRPOConfig.use_bias_correction_kl = True``; the oracle test checks that default
   and equals TRL's loss and gradients with it); ``grpo``: each
   completion's token mean, then the mean over completions; ``dr_grpo``: the token sum over completions x
   ``max_completion_tokens``. One update per rollout (TRL's ``num_iterations = 1``), so ``logp_old`` is the
   detached ``logp`` of the same forward pass: the ratio is 1 and ``clip_ratio`` is 0 by construction, as in TRL;
   token log-probabilities are those of the sampling distribution (logits / temperature), as TRL's;
5. the reference for ``beta > 0``: the starting weights, kept as a frozen copy (eval mode, no gradients). DPO
   stores its reference values once because its completions are fixed; GRPO's are new every step, so the
   reference must score them every step and the copy cannot be avoided. ``beta = 0`` (the default) keeps none;
6. the sampling RNG: each rollout's sampling is seeded by ``(seed, step, rank)`` inside a forked RNG, so a resumed
   run samples what an uninterrupted one would have without state to save (a stateful generator saved in the
   checkpoint would also work, but could be restored wrongly; a pure function of the position cannot). The
   resumable state (``resume_state``) holds what must match for a resume not to skip or replay prompts;
7. logged each step: the summed reward's mean and std, each reward's mean, ``frac_reward_zero_std``, ``clip_ratio``
   and ``kl`` (beta > 0) as TRL logs them (``clip_ratio/region_mean``, ``kl``: token means per micro-batch, averaged), the completions' mean length and the rollout's seconds (generation and rewards; the step's
   update takes ``step_s - rollout_s``); at the end the held-out prompts' mean reward of greedy completions.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F

from nexa_dagster import settings
from nexa_dagster.core.common.faults import KILL_AFTER_ROLLOUT, fault_point
from nexa_dagster.core.rl.rewards import check_columns, combined_reward
from nexa_dagster.core.training.collectives import all_reduce_sum
from nexa_dagster.core.training.data import Batch
from nexa_dagster.core.training.grpo_rollout import (
    PROMPT_INDEX,
    BatchedSampler,
    PromptSet,
    load_prompts,
    prompt_batches,
    sampling_seed,
)
from nexa_dagster.core.training.init import load_mixtral_checkpoint, read_config
from nexa_dagster.core.training.job import GRPOObjective, TrainingJob
from nexa_dagster.core.training.objective import MessageFn, MicroTerms
from nexa_dagster.core.training.ptx import PtxRows, ptx_loss_sum

if TYPE_CHECKING:
    from nexa_dagster.core.training.vllm_sampler import VLLMSampler

IGNORE_INDEX = -100
COMPLETIONS, REAL_TOKENS = "completions", "real_tokens"  # host counts of a micro-batch
ROLLOUT_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "completion_length", "rollout_s")
STD_EPS = 1e-4  # TRL's: advantages / (std + 1e-4)
# Compiled layers (``settings.compile``, CUDA) are traced per row width: a group's width is its prompt plus its
# longest completion, new at nearly every micro-batch, and on an H200 every new width recompiled the layers until
# torch's recompile limit (8 graphs), then FlexAttention on every step after (2-5 s a step for 50 ms of work,
# 100 s for the first). So compiled widths are rounded up to one of WIDTH_BUCKETS lengths in whole FlexAttention
# blocks: 4, half of torch's limit of 8 graphs, leaving room for the other guards a trace may fail on (a pass
# without autograd, a view's base size) before the limit sends a layer back to eager.
FLEX_BLOCK = 128
WIDTH_BUCKETS = 4


# -- the loss -----------------------------------------------------------------------------------------------------
def grpo_token_losses(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    beta: float,
    epsilon: float,
    sampling_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(per-token loss, ratio, per-token KL or None): the clipped surrogate (times ``sampling_weights``, the
    engine/trainer correction, when the rollouts came from another engine) plus ``beta`` x KL, ``[rows, tokens]``."""
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon)
    adv = advantages.unsqueeze(1)
    per_token = -torch.min(ratio * adv, clipped * adv)
    if sampling_weights is not None:  # before the KL, as TRL's _compute_loss
        per_token = per_token * sampling_weights
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference log-probabilities")
        # TRL's k3 estimator times the ratio: TRL 1.16's default (GRPOConfig.use_bias_correction_kl = True in
        # trl/trainer/grpo_config.py; DeepSeek-V3.2), not an option here. The ratio is 1 on policy, but its
        # gradient makes the KL's the unbiased reverse-KL gradient
        kl = (torch.exp(ref_logps - logps) - (ref_logps - logps) - 1) * ratio
        per_token = per_token + beta * kl
    return per_token, ratio, kl


def sampling_correction(
    trainer_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, mode: str, clip_max: float
) -> torch.Tensor:
    """The weights of the loss for completions sampled by another engine: TRL 1.16's
    ``vllm_importance_sampling_correction`` (``GRPOTrainer._generate_and_score_completions``), with its modes and
    ``clip_min`` unset. The ratio of the trainer's probability to the engine's, per token (``token_*``, ``[rows,
    tokens]``) or per completion (``sequence_*``, the product over its tokens, ``[rows, 1]``); above ``clip_max``
    truncated to it (``*_truncate``) or zeroed (``*_mask``: the completion, or the token, is not trained on)."""
    diff = (trainer_logps - sampling_logps) * mask
    if mode.startswith("sequence_"):
        diff = diff.sum(-1, keepdim=True)
    elif not mode.startswith("token_"):
        raise ValueError(f"unknown vllm_importance_sampling_mode {mode!r}")
    ratio = torch.exp(diff)
    if mode.endswith("_truncate"):
        return ratio.clamp(max=clip_max)
    if mode.endswith("_mask"):
        return ratio.masked_fill(ratio > clip_max, 0.0)
    raise ValueError(f"unknown vllm_importance_sampling_mode {mode!r}")


def grpo_loss_sum(
    per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, max_completion_tokens: int
) -> torch.Tensor:
    """The loss summed over the micro-batch's completions (the loop divides by all completions of the step):
    ``grpo`` each completion's token mean, ``dr_grpo`` its token sum / ``max_completion_tokens``."""
    summed = (per_token * mask).sum(-1)
    if loss_type == "grpo":
        return (summed / mask.sum(-1).clamp(min=1.0)).sum()
    if loss_type == "dr_grpo":
        return summed.sum() / max_completion_tokens
    raise ValueError(f"unknown GRPO loss type {loss_type!r}; grpo or dr_grpo")


def token_mean_metric(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A micro-batch's share of a step metric that is a token mean, as TRL logs ``kl`` and
    ``clip_ratio/region_mean`` (``global_masked_mean``: the mean over the micro-batch's completion tokens, averaged
    over micro-batches). The loop divides a metric's sum by the step's completions, and every micro-batch holds one
    group of K, so the token mean is multiplied by the micro-batch's completions: the step logs the mean of its
    micro-batches' token means, TRL's figure."""
    return ((values * mask).sum() / mask.sum().clamp(min=1.0) * mask.shape[0]).detach()


def group_advantages(
    rewards: torch.Tensor, group: int, scale: str, batch_std: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, the std each was scaled by) of rewards in consecutive groups of ``group`` (TRL's
    ``scale_rewards``; ``batch_std``: the whole global batch's, when it spans ranks)."""
    grouped = rewards.view(-1, group)
    mean = grouped.mean(1).repeat_interleave(group)
    if scale in ("group", "none"):
        std = grouped.std(1).repeat_interleave(group)  # unbiased, as TRL's nanstd
    elif scale == "batch":
        std = torch.full_like(rewards, rewards.std().item() if batch_std is None else batch_std)
    else:
        raise ValueError(f"unknown scale_rewards {scale!r}; group, batch or none")
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + STD_EPS)
    return advantages, std


def completion_batch(
    prompt: list[int],
    completions: list[list[int]],
    advantages: torch.Tensor,
    pad_id: int,
    device: torch.device,
    sampling_logps: list[list[float]] | None = None,
    longest: int = 0,
    share_prompt: bool = True,
) -> Batch:
    """One prompt's group as a micro-batch: only the completions labelled, and where each completion's tokens are
    (``completion_index``, ``completion_mask``: ``[K, longest completion]``, what the loss reads); with the engine's
    log-probability of each completion token where another engine sampled them (``sampling_logps``, the same shape).

    ``share_prompt`` (the default) lays the group out as one row: the prompt but its last token once (the trunk),
    then per completion a branch of the prompt's last token and the completion (``branch_ids``: each branch attends
    to the trunk and itself, at the positions it would have as a row of its own). A group's K rows repeat one prompt
    of ~140 tokens before completions of a few: the trunk computed once is most of the update's work saved, with the
    same log-probabilities and gradients (``tests/unit/core/training/test_grpo_loss.py``). The last prompt token
    opens every branch because its hidden state predicts each completion's first token. ``attention_mask`` weighs a
    trunk token K times in the router's statistics, as K rows would. ``share_prompt=False``: K right-padded rows
    (the layout before; ``bench/rl.py``'s baseline). With ``longest`` (a run's longest micro-batch, for compiled
    layers) the width is rounded up to its ``bucket_width``: more padding, unlabelled and attended by nothing, so
    the same loss and gradients."""
    rows, widest = len(completions), max(len(c) for c in completions)
    layout = _shared_layout if share_prompt else _row_layout
    laid_out = layout(prompt, completions, pad_id)
    if longest:
        laid_out = _padded(laid_out, bucket_width(laid_out.ids.shape[1], longest), pad_id)
    mask = torch.zeros((rows, widest))
    for row, completion in enumerate(completions):
        mask[row, : len(completion)] = 1
    batch = {
        "input_ids": laid_out.ids,
        "labels": laid_out.labels,
        "attention_mask": laid_out.weights,
        "position_ids": laid_out.positions,
        "advantages": advantages.float(),
        "completion_index": laid_out.index,
        "completion_mask": mask,
    }
    if share_prompt:
        batch["branch_ids"] = laid_out.branches
    if sampling_logps is not None:
        sampled = torch.zeros((rows, widest), dtype=torch.float32)
        for row, values in enumerate(sampling_logps):
            sampled[row, : len(values)] = torch.tensor(values)
        batch["sampling_logps"] = sampled
    real_tokens = laid_out.weights.sum()  # the K rows' real tokens, whichever the layout
    batch = {k: v.to(device) for k, v in batch.items()}
    batch[COMPLETIONS], batch[REAL_TOKENS] = torch.tensor(rows), real_tokens.long()
    return batch


class GroupLayout(NamedTuple):
    """A group's tokens as the model reads them (``[rows, width]`` each) and where its completions' tokens are."""

    ids: torch.Tensor
    labels: torch.Tensor  # the completion tokens, IGNORE_INDEX elsewhere
    positions: torch.Tensor
    branches: torch.Tensor  # 0: the shared trunk; j: completion j's branch
    # a token's weight in the router's statistics: the rows it stands for, 0 for padding
    weights: torch.Tensor
    index: torch.Tensor  # [K, longest completion]: each completion token's place in the flattened rows


def _padded(layout: GroupLayout, padded: int, pad_id: int) -> GroupLayout:
    """``layout`` with its rows ``padded`` wide: padding unlabelled, weighing nothing in the router's statistics, at
    the positions after the last and in a branch of its own (it attends to the trunk and itself; nothing attends to
    it), so the same loss and gradients; the completion index follows each row's new start."""
    width, extra = layout.ids.shape[1], padded - layout.ids.shape[1]
    tail = layout.positions[:, -1:] + torch.arange(1, extra + 1)
    return GroupLayout(
        ids=F.pad(layout.ids, (0, extra), value=pad_id),
        labels=F.pad(layout.labels, (0, extra), value=IGNORE_INDEX),
        positions=torch.cat([layout.positions, tail], 1),
        branches=torch.cat([layout.branches, torch.full_like(tail, int(layout.branches.max()) + 1)], 1),
        weights=F.pad(layout.weights, (0, extra)),
        index=layout.index // width * padded + layout.index % width,
    )


def _shared_layout(prompt: list[int], completions: list[list[int]], pad_id: int) -> GroupLayout:
    """One row: the trunk ``prompt[:-1]``, then one branch ``[prompt[-1], *completion]`` per completion."""
    trunk, head, k = prompt[:-1], prompt[-1], len(completions)
    ids, labels, positions, branches = (
        list(trunk),
        [IGNORE_INDEX] * len(trunk),
        list(range(len(trunk))),
        [0] * len(trunk),
    )
    weights = [float(k)] * len(trunk)
    index = torch.zeros((k, max(len(c) for c in completions)), dtype=torch.long)
    for j, completion in enumerate(completions, start=1):
        start = len(ids) + 1  # the branch's first completion token
        index[j - 1, : len(completion)] = torch.arange(start, start + len(completion))
        ids += [head, *completion]
        labels += [IGNORE_INDEX, *completion]
        positions += range(len(trunk), len(trunk) + 1 + len(completion))
        branches += [j] * (1 + len(completion))
        weights += [1.0] * (1 + len(completion))
    row = [torch.tensor([values]) for values in (ids, labels, positions, branches, weights)]
    return GroupLayout(*row, index=index)


def _row_layout(prompt: list[int], completions: list[list[int]], pad_id: int) -> GroupLayout:
    """The same group as K rows of prompt + completion, right-padded with ``pad_id`` (``[K, width]``)."""
    rows, width = len(completions), len(prompt) + max(len(c) for c in completions)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    labels = torch.full((rows, width), IGNORE_INDEX, dtype=torch.long)
    weights = torch.zeros((rows, width))
    index = torch.zeros((rows, width - len(prompt)), dtype=torch.long)
    for row, completion in enumerate(completions):
        end = len(prompt) + len(completion)
        ids[row, :end] = torch.tensor(prompt + completion)
        labels[row, len(prompt) : end] = torch.tensor(completion)
        weights[row, :end] = 1
        index[row, : len(completion)] = row * width + torch.arange(len(prompt), end)
    positions = torch.arange(width).expand(rows, width).contiguous()
    return GroupLayout(ids, labels, positions, torch.zeros_like(ids), weights, index)


def bucket_width(width: int, longest: int, buckets: int = WIDTH_BUCKETS, block: int = FLEX_BLOCK) -> int:
    """``width`` rounded up to a multiple of a step of whole ``block``s chosen so that at most ``buckets`` widths
    cover every width up to ``longest`` (a run's longest prompt plus its completion limit)."""
    step = block * max(1, math.ceil(longest / (buckets * block)))
    return step * math.ceil(width / step)


def completion_logps(model: Callable[..., Any], batch: Batch, temperature: float) -> tuple[Any, torch.Tensor]:
    """(the model's output, ``[K, longest completion]`` log-probabilities of each completion's tokens at
    ``temperature``, 0 past its end), whichever layout ``completion_batch`` chose."""
    out = model(
        input_ids=batch["input_ids"],
        labels=batch["labels"],
        position_ids=batch["position_ids"],
        attention_mask=batch["attention_mask"],
        per_token=True,
        temperature=temperature,
        **({"branch_ids": batch["branch_ids"]} if "branch_ids" in batch else {}),
    )
    flat = out.token_logps.reshape(-1)
    return out, flat[batch["completion_index"]] * batch["completion_mask"]


def grpo_terms(model: Callable[..., Any], batch: Batch, c: GRPOObjective) -> MicroTerms:
    """Forward pass and GRPO loss of one micro-batch (a group of completions), with its step metrics' sums.

    ``old_logps`` in the batch (the sampling policy's, for more than one update per rollout) is used when present,
    else the detached log-probabilities of this pass (one update per rollout: ratio 1, TRL's shortcut).
    """
    out, logps = completion_logps(model, batch, c.temperature)
    mask = batch["completion_mask"]
    old = batch["old_logps"] if "old_logps" in batch else logps.detach()
    weights = None
    # another engine sampled them: TRL's correction, against the trainer's old_logps
    if "sampling_logps" in batch:
        weights = sampling_correction(
            old,
            batch["sampling_logps"],
            mask,
            c.vllm_importance_sampling_mode,
            c.vllm_importance_sampling_clip_max,
        )
    per_token, ratio, kl = grpo_token_losses(
        logps, old, batch.get("ref_logps"), batch["advantages"], c.beta, c.epsilon, weights
    )
    loss_sum = grpo_loss_sum(per_token, mask, c.loss_type, c.max_completion_tokens)
    adv = batch["advantages"].unsqueeze(1)
    clipped = ((ratio < 1 - c.epsilon) & (adv < 0)) | ((ratio > 1 + c.epsilon) & (adv > 0))
    metrics = {k[2:]: v.to(logps.device) for k, v in batch.items() if k.startswith("m:")}
    metrics["clip_ratio"] = token_mean_metric(clipped.float(), mask)
    if kl is not None:
        metrics["kl"] = token_mean_metric(kl, mask)
    if weights is not None:  # TRL's sampling/ figures: how far the engine's log-probs are from the trainer's
        metrics["sampling_logp_diff"] = token_mean_metric((old - batch["sampling_logps"]).abs(), mask)
        metrics["is_ratio"] = token_mean_metric(weights.expand_as(mask), mask)
    return MicroTerms(loss_sum, out.aux_loss, out.expert_load, metrics)


class GRPOLoss:
    """``objective: {kind: grpo, ...}``: GRPO on prompts with on-policy rollouts (see the module docstring)."""

    host_keys = frozenset({PROMPT_INDEX, COMPLETIONS, REAL_TOKENS})

    def __init__(self, job: TrainingJob, tokenizer: Any, say: MessageFn) -> None:
        """Prompts, rewards and the batch shape, every input checked before a model is built."""
        self.job, self.config, self.tokenizer = job, grpo_config(job), tokenizer
        self.rank, self.world_size = int(settings.RANK.get()), int(settings.WORLD_SIZE.get())
        check_batch_shape(job, self.config, self.world_size)
        limit = int(read_config(job.init_from).get("max_position_embeddings", 0)) or 1 << 30
        self.max_prompt = limit - self.config.max_completion_tokens
        if self.config.rollout_engine == "vllm":  # refused now, not after the model and engine are built
            # the engine's pipe and process: only for vLLM rollouts
            from nexa_dagster.core.training.vllm_sampler import check_vllm_can_sample

            check_vllm_can_sample(job.init_from)
        self.train = self._prompts(self.config.prompts_path)
        self.held_out = self._prompts(self.config.held_out_path) if self.config.held_out_path else None
        self.reward = combined_reward(self.config.rewards)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        longest_prompt, c = max(len(p) for p in self.train.token_ids), self.config
        self.seq_len = longest_prompt + c.max_completion_tokens
        # compiled layers: micro-batches padded to a few widths up to the widest (bucket_width), a group's one row
        # of the trunk and K branches of the last prompt token and a completion; 0: each group's own width
        widest = longest_prompt - 1 + c.num_generations * (1 + c.max_completion_tokens)
        self.bucket_longest = widest if job.compiles_layers else 0
        self.ptx = (
            PtxRows(self.config.ptx_path, job.settings.seed, len(tokenizer), not job.compiles_layers)
            if self.config.ptx_coef
            else None
        )
        extra = (
            *(("kl",) if self.config.beta else ()),
            *(("ptx_loss",) if self.ptx else ()),
            *(("sampling_logp_diff", "is_ratio") if self.config.rollout_engine == "vllm" else ()),
        )
        self.metric_keys = (
            *ROLLOUT_METRICS,
            "clip_ratio",
            *extra,
            *(f"reward/{n}" for n in self.reward.functions),
        )
        self.sampler: BatchedSampler | VLLMSampler | None = None
        self.reference: torch.nn.Module | None = None
        # step -> (reward sum, completions, share of groups with no reward spread, mean completion tokens), all ranks
        self.history: dict[int, tuple[float, ...]] = {}
        self.rollout_s = self.update_s = 0.0
        self.rollout_tokens = 0
        self._last_rollout_end: float | None = None

    def _prompts(self, path: str) -> PromptSet:
        prompts = load_prompts(path, self.tokenizer, self.max_prompt)
        check_columns([r.name for r in self.config.rewards], set(prompts.columns), path)
        return prompts

    def describe(self) -> str:
        c = self.config
        held = f", {len(self.held_out)} held-out" if self.held_out else ""
        return (
            f"{len(self.train)} prompts{held}, GRPO {c.loss_type}: K={c.num_generations} completions x "
            f"B={c.prompts_per_step} prompts per step, up to {c.max_completion_tokens} tokens, beta {c.beta}, "
            f"rewards {', '.join(f'{r.name} x{r.weight:g}' for r in c.rewards)}"
            + (f", ptx {c.ptx_coef:g} x the LM loss of {self.ptx.count} SFT rows" if self.ptx else "")
        )

    def prepare(self, engine: Any, device: torch.device, say: MessageFn) -> None:
        """The sampler on the engine's weights and, for beta > 0, the frozen reference (the starting weights)."""
        if engine.zero_optimization_stage() >= 3:
            raise ValueError("GRPO rollouts need whole parameters on every rank: use ZeRO stage 0-2, not 3")
        module = engine.module
        self.sampler = self._sampler(module)
        if self.config.beta:
            dtype = next(module.parameters()).dtype
            self.reference = load_mixtral_checkpoint(
                self.job.init_from, attention=self.job.settings.attention
            )
            self.reference = self.reference.to(device, dtype).eval().requires_grad_(False)
        c = self.config
        say(
            f"rollouts ({c.rollout_engine}): {self.sampler.describe()}, "
            f"{c.num_generations * c.prompts_per_step // self.world_size} completions per call and rank"
            + (f"; reference for the KL: {self.job.init_from}" if self.reference is not None else "")
        )

    def _sampler(self, module: torch.nn.Module) -> BatchedSampler | VLLMSampler:
        """The rollout engine ``rollout_engine`` names; never another one in its place."""
        eos = self.tokenizer.eos_token_id
        if self.config.rollout_engine == "transformers":
            return BatchedSampler(module, self.pad_id, eos)
        # the engine's pipe, its process and its weight files: only for vLLM rollouts
        from nexa_dagster.core.training.vllm_sampler import VLLMSampler

        return VLLMSampler(module, self.job.init_from, Path(self.job.output_dir), eos, self.seq_len)

    def batches(self, micro_batch: int, seed: int, rank: int, world_size: int, start: int) -> Iterator[Batch]:
        return prompt_batches(len(self.train), seed, rank, world_size, start)

    def units(self, batch: Batch) -> int:
        return int(
            batch[COMPLETIONS]
        )  # every completion of the step weighs the same (grpo and dr_grpo alike)

    def tokens(self, batch: Batch) -> int:
        return int(batch[REAL_TOKENS])

    # -- the rollout phase ----------------------------------------------------------------------------------------
    def rollout(self, engine: Any, micro: list[Batch], step: int) -> list[Batch]:
        """The step's completions from the current weights, scored, as micro-batches (called by the loop in the
        training thread, after the previous update and before this step's first forward pass)."""
        start = time.perf_counter()
        if self._last_rollout_end is not None:
            self.update_s += start - self._last_rollout_end
        assert self.sampler is not None, "prepare() builds the sampler"
        c, k = self.config, self.config.num_generations
        indices = [int(b[PROMPT_INDEX].reshape(-1)[0]) for b in micro]
        prompts = [self.train.token_ids[i] for i in indices for _ in range(k)]
        seed = sampling_seed(self.job.settings.seed, step, self.rank)
        completions = self.sampler.generate(prompts, c.max_completion_tokens, c.temperature, c.top_p, seed)
        # the fault tests' kill between a weight sync and its update
        fault_point(KILL_AFTER_ROLLOUT, step=step)
        texts = [self.tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in completions]
        totals, per_name = self.reward(texts, **self.train.rows(indices, k))
        batches = self._score(indices, completions, totals, per_name, step, self.sampler.last_logprobs)
        if self.rank == 0:
            if (
                self._last_rollout_end is None
            ):  # this process's first step: drop what a crashed attempt sampled
                truncate_rollouts(rollouts_file(self.job), step - 1)  # after its state (sampled again now)
            append_rollouts(
                rollouts_file(self.job), step, [i for i in indices for _ in range(k)], texts, totals
            )
        self.rollout_tokens += sum(len(ids) for ids in completions)
        elapsed = time.perf_counter() - start
        self.rollout_s += elapsed
        if self.ptx is not None:  # one SFT row per micro-batch, by position: the same on a resumed run
            local = len(batches)
            for j, batch in enumerate(batches):
                position = (step - 1) * c.prompts_per_step + self.rank * local + j
                self.ptx.attach(batch, position, batch["input_ids"].device)
        for batch in batches:
            batch["m:rollout_s"] = torch.tensor(
                elapsed * k
            )  # a per-rank figure: x units averages it over ranks
        self._last_rollout_end = time.perf_counter()
        return batches

    def _score(
        self,
        indices: list[int],
        completions: list[list[int]],
        totals: list[float],
        per_name: dict[str, list[float]],
        step: int,
        sampling_logps: list[list[float]] | None = None,
    ) -> list[Batch]:
        """Advantages and the micro-batches of one rollout, with each group's metric sums attached."""
        assert self.sampler is not None
        k, device = self.config.num_generations, self.sampler.device
        rewards = torch.tensor(totals, dtype=torch.float32)
        flat = torch.isclose(rewards.view(-1, k).std(1), torch.zeros(len(indices)))  # groups with no spread
        count, total, squares, groups, flat_groups, tokens = all_reduce_sum(
            float(len(totals)),
            float(rewards.sum()),
            float((rewards**2).sum()),
            float(len(indices)),
            float(flat.sum()),
            float(sum(len(c) for c in completions)),
        )
        self.history[step] = (total, count, flat_groups / groups, tokens / count)
        batch_std = math.sqrt(max(squares - total**2 / count, 0.0) / max(count - 1, 1))
        advantages, std = group_advantages(rewards, k, self.config.scale_rewards, batch_std)
        batches = []
        for g, index in enumerate(indices):
            rows = slice(g * k, (g + 1) * k)
            batch = completion_batch(
                self.train.token_ids[index],
                completions[rows],
                advantages[rows],
                self.pad_id,
                device,
                sampling_logps[rows] if sampling_logps is not None else None,
                longest=self.bucket_longest,
            )
            batch["m:reward"] = rewards[rows].sum()
            batch["m:reward_std"] = std[rows].sum()
            batch["m:frac_reward_zero_std"] = torch.isclose(std[rows], torch.zeros(k)).float().sum()
            batch["m:completion_length"] = torch.tensor(float(sum(len(c) for c in completions[rows])))
            for name, values in per_name.items():
                batch[f"m:reward/{name}"] = torch.tensor(float(sum(values[rows])))
            if self.reference is not None:
                with torch.no_grad():
                    batch["ref_logps"] = completion_logps(self.reference, batch, self.config.temperature)[1]
            batches.append(batch)
        return batches

    # -- the loss of one micro-batch -----------------------------------------------------------------------------
    def terms(self, model: Callable[..., Any], batch: Batch) -> MicroTerms:
        terms = grpo_terms(model, batch, self.config)
        if self.ptx is None:
            return terms
        added, metric = ptx_loss_sum(model, batch, self.config.ptx_coef, int(batch[COMPLETIONS]))
        terms.metric_sums["ptx_loss"] = metric
        return replace(terms, loss_sum=terms.loss_sum + added)

    # -- resume and the end -------------------------------------------------------------------------------------
    def resume_state(self, step: int) -> dict[str, Any]:
        """What a resume must find unchanged, and the reward history (saved with the engine state)."""
        c = self.config
        return {
            "kind": "grpo",
            "prompts_digest": self.train.digest,
            "prompts_per_step": c.prompts_per_step,
            "num_generations": c.num_generations,
            "prompts_consumed": step * c.prompts_per_step,
            "reward_history": {s: list(v) for s, v in self.history.items() if s <= step},
        }

    def restore(self, state: dict[str, Any] | None, step: int) -> None:
        """Refuse a resume that would skip or replay prompts (verl #7401, open-instruct #1523), else restore."""
        check_resume(state, self.resume_state(step), self.config.prompts_path, step)
        assert state is not None
        self.history = {int(s): tuple(float(x) for x in v) for s, v in state["reward_history"].items()}

    def evaluate(self, model: torch.nn.Module, device: torch.device, say: MessageFn) -> dict[str, Any]:
        if self._last_rollout_end is not None:
            self.update_s += time.perf_counter() - self._last_rollout_end
        figures = self.training_figures()
        if self.held_out is not None:
            figures.update(self.held_out_figures(say))
        if self.sampler is not None:
            figures.update(rollout_engine=self.sampler.engine, weight_sync_s=self.sampler.sync_s)
            self.sampler.close()
        return figures

    def training_figures(self) -> dict[str, Any]:
        steps = sorted(self.history.items())
        curve = [(s, v[0] / v[1]) for s, v in steps]
        return {
            "frac_reward_zero_std": sum(v[2] for _, v in steps) / len(steps) if steps else None,
            "completion_length": sum(v[3] for _, v in steps) / len(steps) if steps else None,
            "validation_loss": None,
            "reward_first": curve[0][1] if curve else None,
            "reward_final": curve[-1][1] if curve else None,
            "reward_curve": curve,
            "rollout_s": self.rollout_s,
            "update_s": self.update_s,
            "rollout_tokens": self.rollout_tokens,
        }

    def held_out_figures(self, say: MessageFn) -> dict[str, Any]:
        """Greedy completions of every held-out prompt (one batched call), scored by the same rewards."""
        assert self.held_out is not None and self.sampler is not None
        completions = self.sampler.generate(
            self.held_out.token_ids, self.config.max_completion_tokens, 0.0, 1.0, 0
        )
        texts = [self.tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in completions]
        totals, _ = self.reward(texts, **self.held_out.rows(range(len(self.held_out))))
        mean = sum(totals) / len(totals)
        say(f"held-out: mean reward {mean:.4f} over {len(totals)} prompts (greedy completions)")
        return {"held_out_reward": mean, "held_out_rewards": totals, "held_out_prompts": len(totals)}


def grpo_config(job: TrainingJob) -> GRPOObjective:
    if not isinstance(job.objective, GRPOObjective):
        raise ValueError(f"training job {job.run_id}: objective {job.objective.kind} is not GRPO")
    return job.objective


def rollouts_file(job: TrainingJob) -> Path:
    """Every rollout of the run, one JSON line per completion (step, prompt index, completion, reward), beside the
    checkpoint: what the policy was rewarded for, to read when the reward rises (or is gamed)."""
    out = Path(job.output_dir)
    return out.with_name(out.name + ".rollouts.jsonl")


def append_rollouts(
    path: Path, step: int, prompts: list[int], texts: list[str], rewards: list[float]
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        for prompt, text, reward in zip(prompts, texts, rewards, strict=True):
            f.write(json.dumps({"step": step, "prompt": prompt, "completion": text, "reward": reward}) + "\n")


def truncate_rollouts(path: Path, step: int) -> None:
    """Keep the rollouts of steps up to ``step`` (a resumed run samples the later ones again)."""
    if path.exists():
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        path.write_text("".join(line for line in lines if json.loads(line)["step"] <= step), encoding="utf-8")


def check_batch_shape(job: TrainingJob, config: GRPOObjective, world_size: int) -> None:
    """One prompt's group per micro-batch, B prompts per step over all ranks (``RLSettings.settings`` sets both)."""
    s = job.settings
    if s.micro_batch_size != config.num_generations:
        raise ValueError(
            f"training job {job.run_id}: GRPO's micro-batch is one prompt's group, so micro_batch_size "
            f"({s.micro_batch_size}) must equal num_generations ({config.num_generations})"
        )
    if s.gradient_accumulation_steps * world_size != config.prompts_per_step:
        raise ValueError(
            f"training job {job.run_id}: gradient_accumulation_steps ({s.gradient_accumulation_steps}) x ranks "
            f"({world_size}) must equal prompts_per_step ({config.prompts_per_step})"
        )


def check_resume(saved: dict[str, Any] | None, now: dict[str, Any], path: str, step: int) -> None:
    """A ValueError naming why resuming at ``step`` would skip or replay prompts; nothing when it would not."""
    if not saved or saved.get("kind") != "grpo":
        raise ValueError(f"the saved state at step {step} has no GRPO position: it cannot be resumed as GRPO")
    if saved["prompts_digest"] != now["prompts_digest"]:
        raise ValueError(
            f"{path} changed since the state at step {step} was saved: resuming would skip or replay prompts"
        )
    for key in ("prompts_per_step", "num_generations"):
        if saved[key] != now[key]:
            raise ValueError(
                f"{key} was {saved[key]} when the state at step {step} was saved and is {now[key]} now: resuming "
                "would skip or replay prompts"
            )
    if saved["prompts_consumed"] != now["prompts_consumed"]:
        raise ValueError(
            f"the state at step {step} consumed {saved['prompts_consumed']} prompts, but resuming would start after "
            f"{now['prompts_consumed']}: prompts would be skipped or replayed"
        )
