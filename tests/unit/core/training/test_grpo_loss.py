"""GRPO's loss against TRL's own ``GRPOTrainer._compute_loss`` (the oracle), its advantages, its on-policy sampler
and the refusals of a resume that would skip or replay prompts.

Real components: the project's tiny Mixtral and tokenizer (``teacher_dir``), a real TRL 1.16 ``GRPOTrainer`` (a
test-only dependency) built around a copy of the same weights, whose ``_compute_loss`` computes TRL's number.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from nexa_dagster.core.training.grpo import (
    bucket_width,
    check_resume,
    completion_batch,
    group_advantages,
    grpo_terms,
)
from nexa_dagster.core.training.job import GRPOObjective
from nexa_dagster.core.training.objective import micro_objective

K, GROUPS, MAX_COMPLETION = 3, 2, 12


def chat_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """``count`` chat prompts of different lengths, as the chat template renders them for generation."""
    words = ["json", "the pickle module", "csv files", "shelve and its database", "marshal"]
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Which module documents {word} here?"}],
                tokenize=False,
                add_generation_prompt=True,
            ),
            add_special_tokens=False,
        )
        for word in words[:count]
    ]


def fixed_completions(tokenizer: Any, generator: torch.Generator) -> list[list[int]]:
    """K x GROUPS completions of 2..MAX_COMPLETION tokens, some ending with the end-of-turn token, some cut off."""
    out = []
    for i in range(K * GROUPS):
        length = int(torch.randint(2, MAX_COMPLETION + 1, (1,), generator=generator))
        ids = torch.randint(10, len(tokenizer), (length,), generator=generator).tolist()
        if i % 2 == 0:
            ids[-1] = tokenizer.eos_token_id
        out.append(ids)
    return out


def trl_inputs(
    prompts: list[list[int]], completions: list[list[int]], values: dict[str, list[torch.Tensor]], pad: int
) -> dict[str, torch.Tensor]:
    """TRL's batch of one group: its prompt, completions right-padded, per-token values at completion positions."""
    width = max(len(c) for c in completions)
    rows = len(completions)
    completion_ids = torch.full((rows, width), pad)
    completion_mask = torch.zeros((rows, width), dtype=torch.long)
    for r, c in enumerate(completions):
        completion_ids[r, : len(c)], completion_mask[r, : len(c)] = torch.tensor(c), 1
    prompt_ids = torch.tensor([prompts[r // K] for r in range(rows)])
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
    }
    for key, per_row in values.items():
        inputs[key] = torch.stack([torch.nn.functional.pad(v, (0, width - len(v))) for v in per_row])
    return inputs


def ours_layout(per_row: list[torch.Tensor], batch: dict[str, torch.Tensor], rows: slice) -> torch.Tensor:
    """Per-completion values as our micro-batch holds them: ``[K, longest completion]``, 0 past each one's end."""
    out = torch.zeros(batch["completion_mask"].shape)
    for r, v in enumerate(per_row[rows]):
        out[r, : len(v)] = v
    return out


def trl_trainer(tmp_path: Path, policy: Any, tokenizer: Any, case: dict[str, Any]) -> Any:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=K,
        num_generations=K,
        max_completion_length=MAX_COMPLETION,
        beta=case["beta"],
        epsilon=0.2,
        loss_type=case["loss_type"],
        temperature=case["temperature"],
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        report_to="none",
        seed=0,
        dataloader_num_workers=0,
    )
    model = copy.deepcopy(policy).train()
    model.config.output_router_logits = case["aux"] > 0
    model.config.router_aux_loss_coef = case["aux"]
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[lambda completions, **kwargs: [0.0] * len(completions)],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "q"}] * 4),
        processing_class=tokenizer,
    )
    trainer.current_gradient_accumulation_steps = GROUPS
    return trainer


def our_loss(
    policy: Any,
    prompts: list[list[int]],
    completions: list[list[int]],
    advantages: torch.Tensor,
    old: list[torch.Tensor],
    ref: list[torch.Tensor],
    pad: int,
    case: dict[str, Any],
    sampling: list[torch.Tensor] | None = None,
) -> tuple[Any, float, dict[str, float]]:
    """(our model with its gradients, the loss, the step's logged clip ratio and KL) of the batch, one micro-batch
    per group as the loop runs it: each group's summed loss and metrics weighted by 1 / completions, plus the router
    aux loss per micro-batch."""
    from nexa_dagster.core.training.model.moe import NexaMoEForCausalLM

    ours = NexaMoEForCausalLM(policy.config)
    ours.load_state_dict(policy.state_dict(), strict=False)
    ours.train()
    config = GRPOObjective(
        prompts_path="unused.jsonl",
        rewards=[{"name": "exact_answer"}],
        num_generations=K,
        max_completion_tokens=MAX_COMPLETION,
        loss_type=case["loss_type"],
        beta=case["beta"],
        temperature=case["temperature"],
        **({"vllm_importance_sampling_mode": case["sampling"]} if "sampling" in case else {}),
    )
    loss, logged = 0.0, {"clip_ratio": 0.0, "kl": 0.0}
    for g in range(GROUPS):
        rows = slice(g * K, (g + 1) * K)
        batch = completion_batch(
            prompts[g],
            completions[rows],
            advantages[rows],
            pad,
            torch.device("cpu"),
            longest=case.get("longest", 0),
            share_prompt=case.get("share_prompt", True),
        )
        assert batch["input_ids"].shape[0] == (1 if case.get("share_prompt", True) else K), (
            "the layout asked for"
        )
        if case.get("longest"):
            assert batch["input_ids"].shape[1] == 128, "the rows are padded to their bucket"
        batch["old_logps"], batch["ref_logps"] = ours_layout(old, batch, rows), ours_layout(ref, batch, rows)
        if sampling is not None:  # sampled by another engine (vLLM): its log-probabilities
            batch["sampling_logps"] = ours_layout(sampling, batch, rows)
        terms = grpo_terms(ours, batch, config)
        _, total = micro_objective(terms, weight=1 / (K * GROUPS), aux_coef=case["aux"], accumulation=GROUPS)
        total.backward()
        loss += float(total.detach())
        for (
            key
        ) in logged:  # the loop's weighting of a metric: its sum over micro-batches / the step's completions
            logged[key] += float(terms.metric_sums.get(key, 0.0)) / (K * GROUPS)
    return ours, loss, logged


CASES = [
    {"loss_type": "grpo", "beta": 0.0, "temperature": 1.0, "aux": 0.0},
    {"loss_type": "dr_grpo", "beta": 0.0, "temperature": 1.0, "aux": 0.0},
    {"loss_type": "grpo", "beta": 0.0, "temperature": 0.7, "aux": 0.0},
    {"loss_type": "grpo", "beta": 0.04, "temperature": 1.0, "aux": 0.0},
    {"loss_type": "dr_grpo", "beta": 0.04, "temperature": 1.0, "aux": 0.02},
    # sampled by vLLM: TRL's importance-sampling correction, its default mode and a token-level one
    {"loss_type": "dr_grpo", "beta": 0.04, "temperature": 1.0, "aux": 0.0, "sampling": "sequence_mask"},
    {"loss_type": "grpo", "beta": 0.0, "temperature": 1.0, "aux": 0.0, "sampling": "token_truncate"},
    # rows padded to a compiled layer's bucket (128 tokens for rows of ~40): the padding changes nothing
    {"loss_type": "dr_grpo", "beta": 0.04, "temperature": 1.0, "aux": 0.02, "longest": 300},
    # the group as K rows of its own (the layout before the shared prompt; bench/rl.py's baseline), padded too
    {"loss_type": "dr_grpo", "beta": 0.04, "temperature": 1.0, "aux": 0.02, "share_prompt": False},
    {
        "loss_type": "grpo",
        "beta": 0.0,
        "temperature": 1.0,
        "aux": 0.02,
        "share_prompt": False,
        "longest": 300,
    },
]


def trl_importance_sampling_ratio(
    old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, mode: str, clip_max: float = 3.0
) -> torch.Tensor:
    """TRL 1.16's ratio, transcribed from ``GRPOTrainer._generate_and_score_completions`` (``clip_min`` None),
    which computes it inline where no test can call it; ``_compute_loss``, called below, applies it."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode in ["sequence_mask", "sequence_truncate"]:
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        return torch.clamp(ratio, min=None, max=clip_max)
    return ratio.masked_fill((ratio < -math.inf) | (ratio > clip_max), value=0.0)


def test_grpo_loss_and_every_gradient_equal_trls_grpotrainer(tmp_path: Path, teacher_dir: Path) -> None:
    """Same tiny Mixtral weights (the policy: teacher_dir's moved by seeded noise), 2 prompts x 3 fixed completions
    of 2-12 tokens, fixed advantages, old log-probabilities (the policy's, moved by noise, so the ratio leaves the
    clip range both ways) and reference log-probabilities: for grpo and dr_grpo, without and with the KL term, at
    temperature 1 and 0.7, with the router's aux loss, and on completions another engine sampled (TRL's vLLM
    importance-sampling correction, two modes, some completions masked), our loss and every parameter's gradient
    equal those of TRL's ``GRPOTrainer._compute_loss`` within 1e-5, and so do the clip ratio and the KL the step logs against what
    TRL logs for the same micro-batches (``clip_ratio/region_mean`` and ``kl``: token means per micro-batch, averaged
    over the step's micro-batches), with TRL's default bias-corrected KL (k3 times the ratio)."""
    from transformers import AutoTokenizer, MixtralForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    generator = torch.Generator().manual_seed(0)
    policy = MixtralForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=generator))
    prompts = chat_prompts(tokenizer, GROUPS)
    completions = fixed_completions(tokenizer, generator)
    advantages = torch.tensor([1.2, -0.4, -0.8, 0.9, 0.1, -1.0])
    old = [-7.0 + 0.5 * torch.randn(len(c), generator=generator) for c in completions]
    ref = [o - 0.3 * torch.rand(len(o), generator=generator) for o in old]
    sampling = [o + 0.4 * torch.randn(len(o), generator=generator) for o in old]  # the engine's log-probs
    pad = tokenizer.pad_token_id
    for case in CASES:
        trainer = trl_trainer(tmp_path, policy, tokenizer, case)
        assert trainer.args.use_bias_correction_kl, "compared with TRL's default KL estimator (k3 x ratio)"
        values = {"old_per_token_logps": old, "ref_per_token_logps": ref}
        if "sampling" in case:  # _compute_loss applies the ratio when the rollouts came from vLLM
            trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
            values["sampling_per_token_logps"] = sampling
        trl_loss, masked = torch.zeros(()), 0
        for g in range(GROUPS):  # TRL's gradient accumulation over micro-batches of one group, as ours
            rows = slice(g * K, (g + 1) * K)
            group_values = {key: v[rows] for key, v in values.items()}
            inputs = trl_inputs(prompts[g : g + 1], completions[rows], group_values, pad)
            if "sampling" in case:
                inputs["importance_sampling_ratio"] = trl_importance_sampling_ratio(
                    inputs["old_per_token_logps"],
                    inputs.pop("sampling_per_token_logps"),
                    inputs["completion_mask"],
                    case["sampling"],
                )
                masked += int((inputs["importance_sampling_ratio"] == 0).all(-1).sum())
            micro_loss = trainer._compute_loss(trainer.model, inputs | {"advantages": advantages[rows]})
            micro_loss.backward()
            trl_loss = trl_loss + micro_loss.detach()
        trl_metrics = {k: sum(v[-GROUPS:]) / GROUPS for k, v in trainer._metrics["train"].items()}

        ours, loss, logged = our_loss(
            policy,
            prompts,
            completions,
            advantages,
            old,
            ref,
            pad,
            case,
            sampling if "sampling" in case else None,
        )
        assert abs(loss - trl_loss.item()) < 1e-5, (case, loss, trl_loss.item())
        if case.get("sampling") == "sequence_mask":
            assert 0 < masked < K * GROUPS, ("some completions masked, some kept: the mask is tested", masked)
        assert 0 < trl_metrics["clip_ratio/region_mean"] < 1, (
            "the ratio leaves the clip range: clipping is tested"
        )
        assert abs(logged["clip_ratio"] - trl_metrics["clip_ratio/region_mean"]) < 1e-5, (
            case,
            logged,
            trl_metrics,
        )
        theirs = dict(trainer.model.named_parameters())
        worst, largest = 0.0, 0.0
        for name, p in ours.named_parameters():
            assert p.grad is not None and theirs[name].grad is not None, (case, name)
            worst = max(worst, (p.grad - theirs[name].grad).abs().max().item())
            largest = max(largest, p.grad.abs().max().item())
        assert worst < 1e-5, (case, worst)
        assert worst < 1e-3 * largest, (
            case,
            "gradients too small for the comparison to mean anything",
            largest,
        )
        if case["beta"]:
            assert trl_metrics["kl"] > 1e-3, "a KL far from 0: the comparison below means something"
            assert abs(logged["kl"] - trl_metrics["kl"]) < 1e-5, (case, logged, trl_metrics["kl"])
        print(
            f"{case}: |loss - TRL| {abs(loss - trl_loss.item()):.2e}, max |grad - TRL| {worst:.2e}, |clip ratio - "
            f"TRL| {abs(logged['clip_ratio'] - trl_metrics['clip_ratio/region_mean']):.2e}, |kl - TRL| "
            f"{abs(logged['kl'] - trl_metrics.get('kl', 0.0)):.2e}"
        )


def test_group_advantages_follow_trls_scale_rewards() -> None:
    """Group 1 all right (no spread: advantage 0, a zero-std group), group 2 one right of three."""
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    advantages, std = group_advantages(rewards, 3, "group")
    assert advantages[:3].abs().max() == 0 and std[:3].abs().max() == 0
    group_std = float(torch.tensor([1.0, 0.0, 0.0]).std())  # unbiased (n - 1), TRL's nanstd
    assert advantages[3:].tolist() == pytest.approx(
        [(2 / 3) / (group_std + 1e-4), -(1 / 3) / (group_std + 1e-4)] + [-(1 / 3) / (group_std + 1e-4)]
    )
    batch, _ = group_advantages(rewards, 3, "batch")
    assert batch[3] == pytest.approx((2 / 3) / (float(rewards.std()) + 1e-4))
    none, _ = group_advantages(rewards, 3, "none")
    assert none.tolist() == pytest.approx([0, 0, 0, 2 / 3, -1 / 3, -1 / 3])


def test_the_sampler_generates_with_the_weights_of_the_last_update(teacher_dir: Path) -> None:
    """The generator's parameters are the training tensors: after an optimizer step changes them in place, its
    logits are the training model's (to fp32 rounding), with no copy in between."""
    from nexa_dagster.core.training.grpo_rollout import BatchedSampler
    from nexa_dagster.core.training.init import load_mixtral_checkpoint

    model = load_mixtral_checkpoint(str(teacher_dir))
    sampler = BatchedSampler(model, pad_id=0, eos_id=4)
    ids = torch.randint(10, 500, (2, 9), generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    before = sampler.hf(input_ids=ids).logits
    model(input_ids=ids, labels=ids).lm_loss.backward()
    optimizer.step()
    after = sampler.hf(input_ids=ids).logits
    ours = model(input_ids=ids, return_logits=True).logits
    assert (after - before).abs().max() > 1e-3, "the update moved the weights"
    torch.testing.assert_close(after, ours, rtol=1e-4, atol=1e-4)
    first = sampler.generate([[5, 6, 7], [8, 9]], 5, 1.0, 1.0, seed=3)
    assert first == sampler.generate([[5, 6, 7], [8, 9]], 5, 1.0, 1.0, seed=3), "seeded sampling repeats"


def test_a_resume_that_would_skip_or_replay_prompts_is_refused() -> None:
    now = {
        "kind": "grpo",
        "prompts_digest": "abc",
        "prompts_per_step": 4,
        "num_generations": 8,
        "prompts_consumed": 12,
    }
    check_resume(dict(now), now, "p.jsonl", 3)
    with pytest.raises(ValueError, match="no GRPO position"):
        check_resume({}, now, "p.jsonl", 3)
    with pytest.raises(ValueError, match="p.jsonl changed since the state at step 3"):
        check_resume(now | {"prompts_digest": "def"}, now, "p.jsonl", 3)
    with pytest.raises(ValueError, match="prompts_per_step was 2 .* and is 4 now"):
        check_resume(now | {"prompts_per_step": 2}, now, "p.jsonl", 3)
    with pytest.raises(ValueError, match="consumed 8 prompts, but resuming would start after 12"):
        check_resume(now | {"prompts_consumed": 8}, now, "p.jsonl", 3)


def test_the_sampling_correction_masks_or_truncates_as_trl_modes_say() -> None:
    """Two completions of two tokens and a pad (whose values must not count): trainer minus engine log-probs
    [1.0, 0.5] and [0.0, -2.0]. Per completion the ratios are e^1.5 = 4.48 (above the cap 3) and e^-2 = 0.135:
    ``sequence_mask`` drops the first, ``sequence_truncate`` caps it at 3; per token e^1.2 = 3.32 is above the cap."""
    from nexa_dagster.core.training.grpo import sampling_correction

    old = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, -3.0, 0.0]])
    engine = torch.tensor([[-2.0, -1.5, 9.0], [-1.0, -1.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    e = math.exp
    masked = sampling_correction(old, engine, mask, "sequence_mask", 3.0)
    assert torch.allclose(masked, torch.tensor([[0.0], [e(-2.0)]]))
    truncated = sampling_correction(old, engine, mask, "sequence_truncate", 3.0)
    assert torch.allclose(truncated, torch.tensor([[3.0], [e(-2.0)]]))
    old_token = torch.tensor([[-0.8, -1.0, 0.0], [-1.0, -3.0, 0.0]])  # first token's difference 1.2
    token_masked = sampling_correction(old_token, engine, mask, "token_mask", 3.0)
    assert torch.allclose(token_masked[:, :2], torch.tensor([[0.0, e(0.5)], [1.0, e(-2.0)]]))
    token_truncated = sampling_correction(old_token, engine, mask, "token_truncate", 3.0)
    assert torch.allclose(token_truncated[:, :2], torch.tensor([[3.0, e(0.5)], [1.0, e(-2.0)]]))
    with pytest.raises(ValueError, match="unknown vllm_importance_sampling_mode"):
        sampling_correction(old, engine, mask, "sequence", 3.0)


@pytest.mark.parametrize("longest", [40, 128, 300, 1000, 4096, 4100])
def test_compiled_widths_fall_into_a_few_buckets_of_whole_attention_blocks(longest: int) -> None:
    """Every width up to a run's longest row rounds up to one of at most 4 widths, each in whole 128-token
    FlexAttention blocks and never below the row: compiled layers trace a handful of shapes, not one per group."""
    widths = {bucket_width(w, longest) for w in range(1, longest + 1)}
    assert len(widths) <= 4, sorted(widths)
    assert all(b % 128 == 0 for b in widths)
    assert all(bucket_width(w, longest) >= w for w in range(1, longest + 1))
    assert (
        min(widths) == bucket_width(1, longest)
        and bucket_width(longest, longest) - longest < max(widths) / 2 + 128
    )
