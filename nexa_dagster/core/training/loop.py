"""The training loop: packed SFT sequences -> DeepSpeed engine -> Hugging Face MoE checkpoint.

Read it top to bottom, torchtitan-style: build the model, build the engine, loop, evaluate, save. No trainer
framework hides a step. The model is a ``transformers`` Mixtral-architecture MoE (router + SwiGLU experts), so
the saved checkpoint loads with ``from_pretrained`` and serves with vLLM or ``transformers serve`` unchanged.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from nexa_dagster.core.training.job import TrainingJob, TrainingResult

COMPLETION_MARKER = "_COMPLETE"
LogFn = Callable[[int, dict[str, float]], None]


# -- data -------------------------------------------------------------------------------------------------------
def load_packed(path: str) -> dict[str, torch.Tensor]:
    from nexa_dagster.core import storage

    if "://" not in path and not Path(path).exists():
        raise FileNotFoundError(f"packed dataset not found: {path}")
    frame: pd.DataFrame = storage.read_parquet(path)
    if frame.empty:
        raise ValueError(f"packed dataset is empty: {path}")
    return {
        "input_ids": torch.tensor(frame["input_ids"].tolist(), dtype=torch.long),
        "loss_mask": torch.tensor(frame["loss_mask"].tolist(), dtype=torch.long),
        "position_ids": torch.tensor(frame["position_ids"].tolist(), dtype=torch.long),
    }


def batches(data: dict[str, torch.Tensor], micro_batch: int, seed: int) -> Iterator[dict[str, torch.Tensor]]:
    """Endless, seeded, epoch-wise shuffled micro-batches (deterministic for a given seed)."""
    n = data["input_ids"].shape[0]
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(n, generator=gen)
        for start in range(0, n, micro_batch):
            idx = order[start:start + micro_batch]
            if len(idx) < micro_batch and n >= micro_batch:
                continue  # keep every step's batch the same size
            yield {k: v[idx] for k, v in data.items()}


def labels_from(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Learn only assistant tokens: everything outside the loss mask is ignored (-100)."""
    return batch["input_ids"].masked_fill(batch["loss_mask"] == 0, -100)


# -- model ------------------------------------------------------------------------------------------------------
def build_model(job: TrainingJob, tokenizer: Any) -> torch.nn.Module:
    from transformers import MixtralForCausalLM

    from nexa_dagster.core.tiny_model import build_model_config

    torch.manual_seed(job.settings.seed)
    config = build_model_config(job.model_preset, vocab_size=len(tokenizer), tokenizer=tokenizer,
                                output_router_logits=True)  # train with the load-balancing loss
    return MixtralForCausalLM(config)


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """Total parameters, and those active per token (only top-k of the experts run)."""
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n or n.endswith(".experts"))
    active = total - experts + experts * cfg.num_experts_per_tok // cfg.num_local_experts
    return total, active


def lr_lambda(warmup: int, total: int) -> Callable[[int], float]:
    """Linear warmup then cosine decay to 10% of the peak."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


def fill_deepspeed_config(job: TrainingJob, world_size: int) -> dict[str, Any]:
    """Replace DeepSpeed's "auto" fields with the scale preset's values."""
    s = job.settings
    cfg = json.loads(json.dumps(job.deepspeed_config))
    auto = {"train_micro_batch_size_per_gpu": s.micro_batch_size,
            "gradient_accumulation_steps": s.gradient_accumulation_steps, "gradient_clipping": s.grad_clip}
    for key, value in auto.items():
        if cfg.get(key, "auto") == "auto":
            cfg[key] = value
    cfg["train_batch_size"] = s.micro_batch_size * s.gradient_accumulation_steps * world_size
    if job.accelerator == "cpu":  # no half precision kernels worth using on CPU
        cfg.setdefault("bf16", {})["enabled"] = False
        cfg.setdefault("fp16", {})["enabled"] = False
    return cfg


# -- evaluation -------------------------------------------------------------------------------------------------
@torch.no_grad()
def validation_loss(model: torch.nn.Module, data: dict[str, torch.Tensor], device: torch.device,
                    micro_batch: int) -> float:
    model.eval()
    nll, count = 0.0, 0
    for start in range(0, data["input_ids"].shape[0], micro_batch):
        batch = {k: v[start:start + micro_batch].to(device) for k, v in data.items()}
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits.float()
        labels = labels_from(batch)[:, 1:]
        losses = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels, ignore_index=-100,
                                                   reduction="sum")
        nll += float(losses)
        count += int((labels != -100).sum())
    model.train()
    return nll / max(1, count)


# -- the run ----------------------------------------------------------------------------------------------------
def train(job: TrainingJob, on_log: LogFn | None = None) -> TrainingResult:
    import deepspeed
    from transformers import AutoTokenizer

    t_start = time.perf_counter()
    s = job.settings
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    tokenizer = AutoTokenizer.from_pretrained(job.tokenizer_path)
    train_data = load_packed(job.train_path)
    val_data = load_packed(job.validation_path)

    model = build_model(job, tokenizer)
    total_params, active_params = count_parameters(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.learning_rate, weight_decay=s.weight_decay,
                                  betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(s.warmup_steps, s.max_steps))
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=fill_deepspeed_config(job, world_size))
    device = engine.device

    stream = batches(train_data, s.micro_batch_size, s.seed + rank)
    loss_curve: list[tuple[int, float]] = []
    tokens_seen = 0
    window_tokens, window_t = 0, time.perf_counter()
    first_loss = last_loss = float("nan")
    for step in range(1, s.max_steps + 1):
        step_loss = 0.0
        for _ in range(s.gradient_accumulation_steps):
            batch = {k: v.to(device) for k, v in next(stream).items()}
            out = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=labels_from(batch))
            engine.backward(out.loss)
            engine.step()  # DeepSpeed applies the optimizer only at the accumulation boundary
            step_loss += float(out.loss) / s.gradient_accumulation_steps
            n = int(batch["input_ids"].numel())
            tokens_seen += n * world_size
            window_tokens += n * world_size
        if not math.isfinite(step_loss):
            raise FloatingPointError(f"non-finite loss {step_loss} at step {step}: check that the packed data has "
                                     "assistant (loss-masked) tokens and lower the learning rate")
        if step == 1:
            first_loss = step_loss
        last_loss = step_loss
        if step % s.log_every == 0 or step == s.max_steps or step == 1:
            elapsed = time.perf_counter() - window_t
            metrics = {"loss": step_loss, "lr": scheduler.get_last_lr()[0],
                       "grad_norm": float(engine.get_global_grad_norm() or 0.0),
                       "tokens_per_s": window_tokens / max(elapsed, 1e-9)}
            loss_curve.append((step, step_loss))
            window_tokens, window_t = 0, time.perf_counter()
            if on_log and rank == 0:
                on_log(step, metrics)

    val_loss = validation_loss(engine.module, val_data, device, s.micro_batch_size)
    wall = time.perf_counter() - t_start
    result = TrainingResult(
        run_id=job.run_id, checkpoint_dir=job.output_dir, steps=s.max_steps, final_loss=last_loss,
        first_loss=first_loss, validation_loss=val_loss, tokens_seen=tokens_seen,
        tokens_per_s=tokens_seen / wall, wall_s=wall, loss_curve=loss_curve, parameters_total=total_params,
        parameters_active=active_params, world_size=world_size,
    )
    if rank == 0:
        save_checkpoint(engine.module, tokenizer, result, job)
    return result


def save_checkpoint(model: torch.nn.Module, tokenizer: Any, result: TrainingResult, job: TrainingJob) -> Path:
    """Write the Hugging Face checkpoint under a temporary name, rename it into place, mark it complete last.

    The checkpoint sensor only picks up directories with the completion marker, so nothing ever evaluates a
    checkpoint that is still being written.
    """
    out = Path(job.output_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    model.config.output_router_logits = False  # inference engines must not compute the aux loss
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "training_summary.json").write_text(result.model_dump_json(indent=2))
        (tmp / "training_job.json").write_text(job.model_dump_json(indent=2))
        with open(tmp / "metrics.jsonl", "w") as f:
            for step, loss in result.loss_curve:
                f.write(json.dumps({"step": step, "loss": loss}) + "\n")
        if out.exists():
            shutil.rmtree(out)  # an incomplete leftover of a crashed attempt (complete ones get new ids)
        os.replace(tmp, out)
        (out / COMPLETION_MARKER).write_text("ok\n")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
