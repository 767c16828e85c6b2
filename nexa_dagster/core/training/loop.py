"""The training loop: packed SFT sequences -> DeepSpeed engine -> Hugging Face MoE checkpoint.

Read it top to bottom, torchtitan-style: load the data, build the model, build the engine, loop, evaluate, save.
No trainer framework hides a step. The model is a ``transformers`` Mixtral-architecture MoE (router + SwiGLU
experts), so the saved checkpoint loads with ``from_pretrained`` and serves with vLLM or ``transformers serve``
unchanged. Nothing here imports Dagster: the worker process runs this, the Dagster process never does.

Distributed layout: one process per rank (``torchrun`` sets RANK/WORLD_SIZE); every rank builds the same model
(same seed), reads its own slice of every global batch, and rank 0 alone writes the checkpoint.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from nexa_dagster.core.tiny_model import COMPLETION_MARKER
from nexa_dagster.core.training.job import TrainingJob, TrainingResult

LogFn = Callable[[int, dict[str, float]], None]
MessageFn = Callable[[str], None]
Batch = dict[str, torch.Tensor]

PACKED_COLUMNS = ("input_ids", "loss_mask", "position_ids", "attention_mask")
IGNORE_INDEX = -100  # what Hugging Face's cross-entropy skips


# -- data -------------------------------------------------------------------------------------------------------
def load_packed(path: str) -> Batch:
    """Read a packed Parquet file into ``[rows, pack_size]`` tensors, failing with the path in every message."""
    from nexa_dagster.core import storage

    if not storage.exists(path):
        raise FileNotFoundError(f"packed dataset not found: {path}")
    frame = storage.read_parquet(path)
    missing = [c for c in PACKED_COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(f"packed dataset {path} lacks columns {missing} (has {list(frame.columns)})")
    if frame.empty:
        raise ValueError(f"packed dataset is empty: {path}")
    data: Batch = {}
    for column in PACKED_COLUMNS:
        try:
            data[column] = torch.from_numpy(np.stack(frame[column].to_numpy()).astype(np.int64))
        except ValueError as e:  # ragged rows: the packer must emit exactly pack_size tokens per row
            raise ValueError(f"packed dataset {path}: column {column} has rows of different lengths") from e
    return data


def check_packed(data: Batch, path: str, vocab_size: int) -> None:
    """Catch data the model cannot train on before the engine starts, with a message that says what to fix."""
    top = int(data["input_ids"].max())
    if top >= vocab_size:
        raise ValueError(f"packed dataset {path} has token id {top} but the tokenizer's vocabulary has {vocab_size} "
                         "entries: the data was tokenized with a different tokenizer")
    if int(labels_for(data).ne(IGNORE_INDEX).sum()) == 0:
        raise ValueError(f"packed dataset {path} has no loss-mask tokens: nothing to learn")


def labels_for(batch: Batch) -> torch.Tensor:
    """Targets for the causal-LM loss; Hugging Face shifts them by one itself.

    Only assistant tokens are learned (``loss_mask``), never padding, and never the first token of a packed
    document: its "previous token" is the end of an unrelated document in the same row.
    """
    learn = (batch["loss_mask"] == 1) & (batch["attention_mask"] == 1) & (batch["position_ids"] != 0)
    return batch["input_ids"].masked_fill(~learn, IGNORE_INDEX)


def index_stream(num_rows: int, seed: int) -> Iterator[int]:
    """Row indices forever: one seeded permutation per epoch, identical on every rank."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield from torch.randperm(num_rows, generator=generator).tolist()


def micro_batches(data: Batch, micro_batch: int, seed: int, rank: int, world_size: int) -> Iterator[Batch]:
    """Cycle over the data deterministically: each global batch is split between ranks, no row twice per batch
    unless the dataset is smaller than the global batch (then it simply repeats, which tiny runs rely on)."""
    stream = index_stream(data["input_ids"].shape[0], seed)
    while True:
        global_batch = list(itertools.islice(stream, micro_batch * world_size))
        mine = torch.tensor(global_batch[rank * micro_batch:(rank + 1) * micro_batch])
        yield {name: tensor[mine] for name, tensor in data.items()}


# -- model and optimisation -------------------------------------------------------------------------------------
def build_model(job: TrainingJob, vocab_size: int, tokenizer: Any) -> torch.nn.Module:
    """A randomly initialised MoE from the preset; same seed on every rank, so every rank starts identical."""
    from transformers import MixtralForCausalLM

    from nexa_dagster.core.tiny_model import build_model_config

    torch.manual_seed(job.settings.seed)
    config = build_model_config(job.model_preset, vocab_size=vocab_size, tokenizer=tokenizer,
                                output_router_logits=True)  # adds the router's load-balancing loss to the loss
    return MixtralForCausalLM(config)


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """Total parameters, and those active per token: every token runs only top-k of the experts."""
    config = model.config
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    active = total - experts + experts * config.num_experts_per_tok // config.num_local_experts
    return total, active


def build_optimizer(model: torch.nn.Module, learning_rate: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW with the usual LLM split: matrices decay, norms (1-D) do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95), eps=1e-8)


def warmup_cosine(warmup_steps: int, total_steps: int, floor: float = 0.1) -> Callable[[int], float]:
    """LR multiplier: linear warmup to the peak, then cosine decay to ``floor`` x peak at the last step."""
    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps - 1))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return multiplier


def fill_deepspeed_config(job: TrainingJob, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config with its "auto" fields taken from the scale preset.

    The scale preset is the single source of truth for batch size, accumulation and clipping: a JSON value that
    disagrees with it is an error, not a silent override.
    """
    s = job.settings
    cfg = copy.deepcopy(job.deepspeed_config)
    from_settings = {
        "train_micro_batch_size_per_gpu": s.micro_batch_size,
        "gradient_accumulation_steps": s.gradient_accumulation_steps,
        "gradient_clipping": s.grad_clip,
        "train_batch_size": s.micro_batch_size * s.gradient_accumulation_steps * world_size,
    }
    for key, value in from_settings.items():
        if cfg.get(key, "auto") == "auto":
            cfg[key] = value
        elif cfg[key] != value:
            raise ValueError(f"DeepSpeed config sets {key}={cfg[key]!r} but the scale preset implies {value!r}; "
                             'set it to "auto" and change the scale preset instead')
    leftover = _auto_keys(cfg)
    if leftover:
        raise ValueError(f'DeepSpeed config has "auto" values this loop cannot fill: {leftover}')
    if cfg.get("zero_optimization", {}).get("stage", 0) >= 3:
        raise ValueError("ZeRO-3 is not supported by this loop: the Hugging Face MoE blocks would need "
                         "deepspeed.utils.set_z3_leaf_modules and saving would need gathered weights; use stage 1 or 2")
    if job.accelerator == "cpu":  # DeepSpeed's CPU accelerator trains in fp32; half precision is for GPUs
        cfg["bf16"] = {**cfg.get("bf16", {}), "enabled": False}
        cfg["fp16"] = {**cfg.get("fp16", {}), "enabled": False}
    return cfg


def _auto_keys(cfg: Any, prefix: str = "") -> list[str]:
    if isinstance(cfg, dict):
        return [k for key, value in cfg.items() for k in _auto_keys(value, f"{prefix}{key}.")]
    return [prefix.rstrip(".")] if cfg == "auto" else []


# -- distributed helpers ----------------------------------------------------------------------------------------
def all_reduce_sum(*values: float) -> list[float]:
    """Sum scalars over ranks (a no-op for a single process)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)  # gloo reduces CPU tensors; NCCL would need them on the GPU
    return tensor.tolist()


def _as_float(value: Any) -> float:
    if value is None:
        return float("nan")
    return float(value.item() if isinstance(value, torch.Tensor) else value)


# -- evaluation -------------------------------------------------------------------------------------------------
@torch.no_grad()
def validation_loss(model: torch.nn.Module, data: Batch, device: torch.device, micro_batch: int,
                    rank: int, world_size: int) -> float:
    """Mean token NLL over the loss-mask tokens of the validation set (no router aux loss), all ranks."""
    model.eval()
    rows = torch.arange(rank, data["input_ids"].shape[0], world_size)
    nll, count = 0.0, 0
    for start in range(0, len(rows), micro_batch):
        batch = {k: v[rows[start:start + micro_batch]].to(device) for k, v in data.items()}
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       output_router_logits=False).logits.float()
        targets = labels_for(batch)[:, 1:]
        nll += float(torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), targets,
                                                       ignore_index=IGNORE_INDEX, reduction="sum"))
        count += int(targets.ne(IGNORE_INDEX).sum())
    model.train()
    nll, count = all_reduce_sum(nll, count)
    return nll / count if count else float("nan")


# -- the run ----------------------------------------------------------------------------------------------------
def optimizer_step(engine: Any, batches: Iterator[Batch], accumulation: int) -> tuple[float, float, int]:
    """One optimizer step over ``accumulation`` micro-batches; returns mean LM loss, mean aux loss, real tokens.

    The engine minimises LM loss + router_aux_loss_coef x load-balancing loss (Mixtral adds it when
    ``output_router_logits`` is on); the LM part alone is reported, comparable with the validation loss.
    """
    aux_coef = float(engine.module.config.router_aux_loss_coef)
    lm_loss = aux_loss = 0.0
    tokens = 0
    for _ in range(accumulation):
        batch = {k: v.to(engine.device) for k, v in next(batches).items()}
        out = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=labels_for(batch))
        engine.backward(out.loss)
        engine.step()  # DeepSpeed updates (and clips) only at the accumulation boundary
        aux = _as_float(out.aux_loss)
        lm_loss += (_as_float(out.loss) - aux_coef * aux) / accumulation
        aux_loss += aux / accumulation
        tokens += int(batch["attention_mask"].sum())
    return lm_loss, aux_loss, tokens


def train(job: TrainingJob, on_log: LogFn | None = None, on_message: MessageFn | None = None) -> TrainingResult:
    """Train ``job`` to completion in this process (one rank) and return its result; rank 0 saves the checkpoint.

    ``on_log(step, metrics)`` is called on rank 0 every ``log_every`` steps (and on the first and last step) with
    loss, aux_loss, lr, grad_norm and tokens_per_s; ``on_message`` gets human-readable progress lines.
    """
    import deepspeed
    from transformers import AutoTokenizer

    t_start = time.perf_counter()
    s = job.settings
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))

    def say(message: str) -> None:
        if on_message and rank == 0:
            on_message(message)

    output_dir = Path(job.output_dir)
    if (output_dir / COMPLETION_MARKER).exists():
        raise FileExistsError(f"checkpoint {output_dir} is already complete; a new run needs a new run_id")

    # 1. data and tokenizer
    if "://" not in job.tokenizer_path and not Path(job.tokenizer_path).is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {job.tokenizer_path}")
    tokenizer = AutoTokenizer.from_pretrained(job.tokenizer_path)
    vocab_size = len(tokenizer)
    train_data, val_data = load_packed(job.train_path), load_packed(job.validation_path)
    check_packed(train_data, job.train_path, vocab_size)
    check_packed(val_data, job.validation_path, vocab_size)

    # 2. model, optimizer, schedule, engine
    model = build_model(job, vocab_size, tokenizer)
    total_params, active_params = count_parameters(model)
    optimizer = build_optimizer(model, s.learning_rate, s.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(s.warmup_steps, s.max_steps))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=fill_deepspeed_config(job, world_size))
    say(f"engine ready: {total_params:,} parameters ({active_params:,} active), ZeRO stage "
        f"{engine.zero_optimization_stage()}, {train_data['input_ids'].shape[0]} packed rows of "
        f"{train_data['input_ids'].shape[1]} tokens, world size {world_size}, device {engine.device}")

    # 3. the loop: one optimizer step per iteration, gradient accumulation inside
    batches = micro_batches(train_data, s.micro_batch_size, s.seed, rank, world_size)
    metrics_log: list[dict[str, float]] = []
    tokens_seen, window_tokens, window_start, train_start = 0, 0, time.perf_counter(), time.perf_counter()
    first_loss = last_loss = float("nan")
    for step in range(1, s.max_steps + 1):
        lr = engine.get_lr()[0]  # the rate this step's update uses
        lm_loss, aux_loss, tokens = optimizer_step(engine, batches, s.gradient_accumulation_steps)
        window_tokens += tokens
        if not math.isfinite(lm_loss):
            raise FloatingPointError(f"non-finite loss {lm_loss} at step {step}: lower the learning rate or check "
                                     "the packed data")
        if step == 1 or step % s.log_every == 0 or step == s.max_steps:
            loss_sum, aux_sum, tokens = all_reduce_sum(lm_loss, aux_loss, window_tokens)
            elapsed = time.perf_counter() - window_start
            metrics = {"step": step, "loss": loss_sum / world_size, "aux_loss": aux_sum / world_size, "lr": lr,
                       "grad_norm": _as_float(engine.get_global_grad_norm()),
                       "tokens_per_s": tokens / max(elapsed, 1e-9)}
            metrics_log.append(metrics)
            tokens_seen += int(tokens)
            window_tokens, window_start = 0, time.perf_counter()
            last_loss = metrics["loss"]
            if step == 1:
                first_loss = last_loss
            if on_log and rank == 0:
                on_log(step, {k: v for k, v in metrics.items() if k != "step"})
    train_s = time.perf_counter() - train_start

    # 4. evaluate, then save (rank 0)
    val_loss = validation_loss(engine.module, val_data, engine.device, s.micro_batch_size, rank, world_size)
    say(f"validation loss {val_loss:.4f}")
    result = TrainingResult(
        run_id=job.run_id, checkpoint_dir=str(output_dir), steps=s.max_steps, first_loss=first_loss,
        final_loss=last_loss, validation_loss=val_loss, tokens_seen=tokens_seen,
        tokens_per_s=tokens_seen / max(train_s, 1e-9), wall_s=time.perf_counter() - t_start,
        loss_curve=[(int(m["step"]), m["loss"]) for m in metrics_log], parameters_total=total_params,
        parameters_active=active_params, world_size=world_size, dataset_run_hash=job.dataset_run_hash,
    )
    if rank == 0:
        save_checkpoint(engine.module, tokenizer, job, result, metrics_log)
        say(f"saved {output_dir}")
    return result


def save_checkpoint(model: torch.nn.Module, tokenizer: Any, job: TrainingJob, result: TrainingResult,
                    metrics_log: list[dict[str, float]]) -> Path:
    """Write the Hugging Face checkpoint under a temporary name, rename it into place, mark it complete last.

    The checkpoint sensor and every later stage only trust directories with the completion marker, so nothing
    ever evaluates or serves a checkpoint that is still being written or was cut short by a crash.
    """
    out = Path(job.output_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    model.config.output_router_logits = False  # inference must not compute the aux loss (breaks padded batches)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))  # same filesystem: rename is atomic
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "training_summary.json").write_text(result.model_dump_json(indent=2))
        (tmp / "training_job.json").write_text(job.model_dump_json(indent=2))
        (tmp / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics_log))
        if out.exists():
            if (out / COMPLETION_MARKER).exists():
                raise FileExistsError(f"checkpoint {out} was completed by another run while this one trained")
            shutil.rmtree(out)  # an incomplete leftover of a crashed attempt with the same run_id
        os.replace(tmp, out)
        (out / COMPLETION_MARKER).write_text("ok\n")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
