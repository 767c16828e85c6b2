"""The training loop: an objective's batches -> DeepSpeed engine -> Hugging Face MoE checkpoint.

Read it top to bottom, torchtitan-style: load the data, build the model, build the engine, resume if a previous
attempt left state, loop, evaluate, save. One loop for every objective (``objective.py``): the language-model loss
of pretraining and SFT (``lm_objective.py``) and the DPO family of preference training (``preference.py``) plug
into the same resume, prefetch, watchdog, stop and checkpoint path. No trainer framework hides a step. The model is the project's
Mixtral-architecture MoE (``core/training/model/moe.py``: grouped-GEMM experts, attention kept within packed documents),
exported as a plain ``transformers`` Mixtral checkpoint that vLLM and ``transformers serve`` load unchanged.
Nothing here imports Dagster: the worker process runs this, the Dagster process never does.

Distributed layout: one process per rank (``torchrun`` or Slurm sets RANK/WORLD_SIZE); every rank builds the same
model (same seed), reads its own slice of every global batch, and rank 0 alone writes the final checkpoint.
Resumable state (model, optimizer, scheduler, RNG, data position) is DeepSpeed's own checkpoint, written by every
rank every ``checkpoint_every`` steps into ``<checkpoint>.state/``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from nexa_dagster import settings
from nexa_dagster.core.common.artifacts import COMPLETION_MARKER
from nexa_dagster.core.common.faults import NAN_AT_STEP, STALL_AT_STEP, STEP_PAUSE, fault_point
from nexa_dagster.core.common.progress import Progress
from nexa_dagster.core.common.spans import span, span_line
from nexa_dagster.core.training import monitor
from nexa_dagster.core.training.collectives import all_reduce_sum
from nexa_dagster.core.training.data import Batch, Prefetcher
from nexa_dagster.core.training.hf_checkpoint import write_portable_configs
from nexa_dagster.core.training.init import load_mixtral_checkpoint
from nexa_dagster.core.training.job import TrainingJob, TrainingResult
from nexa_dagster.core.training.model.config import build_model_config
from nexa_dagster.core.training.model.moe import MoEBlock, NexaMoEForCausalLM, to_hf
from nexa_dagster.core.training.nonfinite import NonFiniteGuard
from nexa_dagster.core.training.objective import MessageFn, Objective, micro_objective
from nexa_dagster.core.training.objectives import build_objective
from nexa_dagster.core.training.stop import STOP, StopRequested

LogFn = Callable[[int, dict[str, float]], None]


# -- model and optimisation -------------------------------------------------------------------------------------
def build_model(job: TrainingJob, vocab_size: int, tokenizer: Any) -> NexaMoEForCausalLM:
    """The MoE to train: the weights of ``job.init_from`` (a Mixtral HF directory), or a randomly initialised
    one from the preset; same seed and same weights on every rank, so every rank starts identical."""
    torch.manual_seed(job.settings.seed)
    if job.init_from:
        # a dense checkpoint is upcycled with the preset's experts (core/training/upcycle.py)
        model = load_mixtral_checkpoint(job.init_from, job.settings.attention, job.model_preset)
        if model.config.vocab_size < vocab_size:
            raise ValueError(
                f"init_from {job.init_from}: vocab_size {model.config.vocab_size} is smaller than the "
                f"tokenizer's {vocab_size} tokens"
            )
    else:
        config = build_model_config(job.model_preset, vocab_size=vocab_size, tokenizer=tokenizer)
        model = NexaMoEForCausalLM(config, attention=job.settings.attention)
    model.activation_checkpointing = job.settings.activation_checkpointing
    return model


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """Total parameters, and those active per token: every token runs only top-k of the experts."""
    config = model.config
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    active = total - experts + experts * config.num_experts_per_tok // config.num_local_experts
    return total, active


def build_optimizer(
    model: torch.nn.Module, name: str, learning_rate: float, weight_decay: float, fused: bool = False
) -> torch.optim.Optimizer:
    """AdamW (or Adam) with the usual LLM split: matrices decay, norms (1-D) do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
    return cls(groups, lr=learning_rate, betas=(0.9, 0.95), eps=1e-8, fused=fused or None)


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
            raise ValueError(
                f"DeepSpeed config sets {key}={cfg[key]!r} but the scale preset implies {value!r}; "
                'set it to "auto" and change the scale preset instead'
            )
    leftover = _auto_keys(cfg)
    if leftover:
        raise ValueError(f'DeepSpeed config has "auto" values this loop cannot fill: {leftover}')
    if job.accelerator == "cpu":  # DeepSpeed's CPU accelerator trains in fp32; half precision is for GPUs
        cfg["bf16"] = {**cfg.get("bf16", {}), "enabled": False}
        cfg["fp16"] = {**cfg.get("fp16", {}), "enabled": False}
    return cfg


def _auto_keys(cfg: Any, prefix: str = "") -> list[str]:
    if isinstance(cfg, dict):
        return [k for key, value in cfg.items() for k in _auto_keys(value, f"{prefix}{key}.")]
    return [prefix.rstrip(".")] if cfg == "auto" else []


def import_deepspeed() -> ModuleType:
    """``import deepspeed``, without the MLflow import it makes on the way (1.6 of its 3.4 s on the 2-core machine,
    ``python -X importtime``): DeepSpeed's autotuner imports ``mlflow`` at module level for its ``tune()``, which a
    training never calls. The name is hidden for this import only, so code that imports ``mlflow`` later in the
    process still can; where ``mlflow`` is already imported, nothing changes.

    DeepSpeed (many seconds to import) only on the way to an engine: the Dagster process imports this module for
    fill_deepspeed_config, which needs none of it."""
    hide = "deepspeed" not in sys.modules and "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` raises ImportError
    try:
        import deepspeed  # here, not at the top: the Dagster process imports this module and never trains
    finally:
        if hide:
            del sys.modules["mlflow"]
    return deepspeed


def skip_inference_comm_op(accelerator: str) -> None:
    """Switch DeepSpeed's CPU shared-memory communication op off before ``deepspeed.initialize`` would compile it.

    DeepSpeed compiles that C++ op the first time any CPU engine starts on a machine (45 CPU seconds; minutes on a
    loaded 2-core machine, without a word, and a process killed meanwhile left torch's bare lock file for every
    later run to wait on), yet calls it only from ``inference_all_reduce``, the collective of its tensor-parallel
    inference kernels. A training's all-reduce, all-gather and reduce-scatter go through ``torch.distributed``
    (gloo), at every world size, so a training never needs it.
    """
    if accelerator != "cpu":
        return
    import_deepspeed()  # the package first, without MLflow; then its parts, here only (as import_deepspeed says)
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False  # deepspeed.comm's build_shm_op() returns None


def build_engine(model: NexaMoEForCausalLM, job: TrainingJob, world_size: int) -> Any:
    """Model + optimizer + warmup/cosine schedule wrapped by the DeepSpeed engine (ZeRO stage from the JSON)."""
    deepspeed = import_deepspeed()
    skip_inference_comm_op(job.accelerator)

    s = job.settings
    ds_config = fill_deepspeed_config(job, world_size)
    if ds_config.get("zero_optimization", {}).get("stage", 0) >= 3:
        # ZeRO-3 partitions parameters; an MoE block's experts must be gathered as one unit, not hooked per
        # parameter, or ranks routing to different experts would wait on each other forever.
        deepspeed.utils.set_z3_leaf_modules(model, [MoEBlock])
    if job.compiles_layers:
        model.compile_layers()
    optimizer = build_optimizer(
        model, s.optimizer, s.learning_rate, s.weight_decay, fused=job.accelerator == "cuda"
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(s.warmup_steps, s.max_steps))
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
    )
    return engine


# -- distributed helpers ----------------------------------------------------------------------------------------
def _as_float(value: Any) -> float:
    if value is None:
        return float("nan")
    return float(value.item() if isinstance(value, torch.Tensor) else value)


# -- one step and the validation pass ---------------------------------------------------------------------------
class Control:
    """Host-side values every rank must agree on before a step: the global loss-token count and the stop flag.

    One small all-reduce per step over gloo on host memory, never over NCCL: reading a GPU tensor back would wait
    for the GPU every step. On CPU (gloo already) it is the default group.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.group = None
        if world_size > 1 and dist.is_initialized() and dist.get_backend() != "gloo":
            self.group = dist.new_group(backend="gloo")

    def agree(self, loss_tokens: int, stop: bool) -> tuple[int, bool]:
        if self.world_size == 1 or not dist.is_initialized():
            return loss_tokens, stop
        values = torch.tensor([float(loss_tokens), float(stop)], dtype=torch.float64)
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self.group)
        return int(values[0]), bool(values[1] > 0)


@dataclass
class StepTotals:
    """A step's sums over its micro-batches, this rank's share (device tensors: reading them waits for the GPU)."""

    loss: (
        Any  # the objective's loss (world_size x this rank's share of the global mean), without the aux loss
    )
    aux_loss: Any
    total: Any  # what the backward passes minimised: loss + router_aux_loss_coef * aux_loss
    metrics: dict[str, Any]  # the objective's step metrics (shares of global means, like the loss)
    tokens: int  # tokens trained on (the objective's host count)
    expert_load: Any


def optimizer_step(
    engine: Any,
    batches: Iterator[Batch],
    accumulation: int,
    control: Control,
    guard: NonFiniteGuard,
    step: int,
    objective: Objective,
    poison: bool = False,
) -> StepTotals:
    """One optimizer step over ``accumulation`` micro-batches, the objective's mean over its units (torchtitan style).

    Each micro-batch's summed loss (over its loss tokens, its pairs: ``objective.units``) is divided by the units of
    the whole global batch (all micro-batches, all ranks), so a packed row with few assistant tokens weighs what
    its tokens weigh, and every pair of a DPO batch the same. DeepSpeed averages gradients over ranks, hence the
    factor ``world_size``; its own division by the accumulation steps is turned off (``scale_wrt_gas=False``). The
    router's aux loss stays a mean per micro-batch. A non-finite loss never reaches the weights and is reported
    without a host read of our own per step (``NonFiniteGuard``): at once when DeepSpeed skips the update, else at
    the next log step.

    Raises ``StopRequested`` (before the step) when any rank was asked to stop. ``poison`` (tests) turns the loss
    into NaN.
    """
    micro = objective.rollout(engine, [next(batches) for _ in range(accumulation)], step)  # GRPO: sample now
    global_units, stop = control.agree(sum(objective.units(b) for b in micro), STOP.is_set())
    if stop:
        raise StopRequested(step - 1)
    weight = control.world_size / max(global_units, 1)
    aux_coef = engine.module.config.router_aux_loss_coef
    loss = aux_loss = total_sum = expert_load = 0
    metrics: dict[str, Any] = dict.fromkeys(objective.metric_keys, 0)
    tokens = 0
    for i, batch in enumerate(micro):
        terms = objective.terms(engine, batch)
        main, total = micro_objective(terms, weight, aux_coef, accumulation)
        if poison:
            main, total = main * float("nan"), total * float("nan")
        loss = loss + main.detach()
        aux_loss = aux_loss + terms.aux_loss.detach() / accumulation
        total_sum = total_sum + total.detach()
        for key, value in terms.metric_sums.items():
            metrics[key] = metrics[key] + value * weight
        if i == accumulation - 1:  # on device: a non-finite step loss makes every gradient non-finite
            guard.record(step, loss + aux_loss)
            total = total * guard.gate(loss + aux_loss)
        engine.backward(total, scale_wrt_gas=False)
        expert_load = expert_load + terms.expert_load / accumulation
        tokens += objective.tokens(batch)
        if i == accumulation - 1:
            guard.before_update(step)  # a host read only for an engine that cannot skip an update
        engine.step()  # DeepSpeed updates (and clips) only at the accumulation boundary, skips non-finite grads
        if i == accumulation - 1:
            guard.after_update(engine, step)
    return StepTotals(loss, aux_loss, total_sum, metrics, tokens, expert_load)


# -- the metrics line -------------------------------------------------------------------------------------------
class MetricsWindow:
    """The optimizer steps since the last metrics line, turned into the next one.

    Tokens, wall time and data wait accumulate per rank; ``close`` sums losses and tokens over ranks (the one
    collective of a metrics line, so every rank must call it at the same steps) and starts the next window.
    """

    def __init__(
        self,
        batches: Prefetcher,
        world_size: int,
        per_token_flops: float,
        peak: float | None,
        device: torch.device,
        last_step: int,
    ) -> None:
        self.batches, self.world_size, self.device = batches, world_size, device
        self.per_token_flops, self.peak = per_token_flops, peak
        self._reset(last_step)

    def _reset(self, step: int) -> None:
        self.tokens, self.start, self.wait_at_start, self.last_step = (
            0,
            time.perf_counter(),
            self.batches.wait_s,
            step,
        )

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def pending_tokens(self) -> int:
        """All ranks' tokens of the steps since the last metrics line (a collective, like ``close``): what a state
        saved between two lines must count on top of the lines' total, or a resume from it loses them."""
        return int(all_reduce_sum(self.tokens)[0])

    def close(
        self,
        step: int,
        lm_loss: Any,
        aux_loss: Any,
        lr: float,
        grad_norm: Any,
        expert_load: Any,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, float]:
        """``extra``: more per-rank shares of the step's means (the preference metrics), summed over ranks in the
        same collective and divided by the world size like the loss."""
        extra = extra or {}
        loss_sum, aux_sum, tokens, *extra_sums = all_reduce_sum(
            _as_float(lm_loss), _as_float(aux_loss), self.tokens, *(_as_float(v) for v in extra.values())
        )
        if not math.isfinite(loss_sum):  # the guard raises first; kept for a loss that only the sum overflows
            raise FloatingPointError(
                f"non-finite loss {loss_sum} at step {step}: lower the learning rate or check the packed data"
            )
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        tokens_per_s = tokens / elapsed
        metrics = {
            "step": step,
            "loss": loss_sum / self.world_size,
            "aux_loss": aux_sum / self.world_size,
            "lr": lr,
            "grad_norm": _as_float(grad_norm),
            "tokens": tokens,
            "tokens_per_s": tokens_per_s,
            "step_s": elapsed / max(step - self.last_step, 1),
            "mfu": monitor.mfu(tokens_per_s / self.world_size, self.per_token_flops, self.peak) or 0.0,
            "data_wait": (self.batches.wait_s - self.wait_at_start) / elapsed,
            "expert_balance": monitor.expert_balance(expert_load),
            "mem_gb": monitor.peak_memory_gb(self.device),
        }
        metrics.update({k: v / self.world_size for k, v in zip(extra, extra_sums, strict=True)})
        self._reset(step)
        return metrics


# -- resumable state --------------------------------------------------------------------------------------------
def state_dir(job: TrainingJob) -> Path:
    return Path(job.output_dir).with_name(Path(job.output_dir).name + ".state")


def save_state(
    engine: Any,
    job: TrainingJob,
    step: int,
    metrics_log: list[dict[str, float]],
    tokens_seen: int,
    objective_state: dict[str, Any] | None = None,
) -> None:
    """DeepSpeed checkpoint of model, optimizer, scheduler (every rank writes its shard) + loop state.

    DeepSpeed writes the ``latest`` pointer after the files, so a kill during the save leaves the previous state
    as the one a relaunch resumes from.
    """
    client_state = {
        "step": step,
        "tokens_seen": tokens_seen,
        "metrics_log": metrics_log,
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "objective": objective_state or {},  # the objective's own position (GRPO's prompts consumed)
    }
    engine.save_checkpoint(str(state_dir(job)), tag=f"step{step:08d}", client_state=client_state)


def load_state(engine: Any, job: TrainingJob) -> dict[str, Any] | None:
    """Resume from the last complete state, if any; returns the loop state saved with it."""
    directory = state_dir(job)
    if not (directory / "latest").exists():
        return None
    path, client_state = engine.load_checkpoint(
        str(directory), load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if path is None:
        # a ValueError: a relaunch would read the same files and fail again, so it is not retried
        raise ValueError(f"could not load the training state in {directory}; delete it to start over")
    torch.set_rng_state(client_state["torch_rng"])
    if client_state.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(client_state["cuda_rng"])
    return client_state


def resume_run(
    engine: Any, job: TrainingJob, objective: Objective, say: MessageFn
) -> tuple[int, list[dict[str, float]], int]:
    """(step, metrics log, tokens seen) of the state an earlier attempt of this run saved, checked and restored
    into the engine and the objective; (0, [], 0) when there is none."""
    resumed = load_state(engine, job)
    if resumed is None:
        return 0, [], 0
    start_step = resumed["step"]
    check_steps_left(job, start_step)
    objective.restore(resumed.get("objective"), start_step)
    say(f"resumed from step {start_step} ({state_dir(job)})")
    return start_step, resumed["metrics_log"], resumed["tokens_seen"]


def check_steps_left(job: TrainingJob, start_step: int) -> None:
    """A resume with no step left to train is an error, not a run that "completes" having trained nothing (the
    state was saved by a run with more steps: max_steps was lowered, or the state belongs to another run)."""
    if start_step >= job.settings.max_steps:
        raise ValueError(
            f"the saved state in {state_dir(job)} is at step {start_step} but max_steps is "
            f"{job.settings.max_steps}: resuming would train zero steps; delete the state to start over or raise "
            "max_steps"
        )


# -- the run ----------------------------------------------------------------------------------------------------


def open_run(job: TrainingJob, on_message: MessageFn | None) -> tuple[int, int, MessageFn, Path]:
    """This rank, the world size, a ``say`` that only rank 0 speaks through, and the output directory, refused
    when it already holds a complete checkpoint (a new run needs a new run_id). What SFT, pretraining and DPO
    start with."""
    rank, world_size = int(settings.RANK.get()), int(settings.WORLD_SIZE.get())

    def say(message: str) -> None:
        if on_message and rank == 0:
            on_message(message)

    output_dir = Path(job.output_dir)
    if (output_dir / COMPLETION_MARKER).exists():
        raise FileExistsError(f"checkpoint {output_dir} is already complete; a new run needs a new run_id")
    return rank, world_size, say, output_dir


def load_tokenizer(job: TrainingJob) -> Any:
    """The job's tokenizer, with a clear error when its local directory is missing."""
    from transformers import AutoTokenizer  # seconds to import: not for fill_deepspeed_config's importers

    if "://" not in job.tokenizer_path and not Path(job.tokenizer_path).is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {job.tokenizer_path}")
    return AutoTokenizer.from_pretrained(job.tokenizer_path)


def train(
    job: TrainingJob, on_log: LogFn | None = None, on_message: MessageFn | None = None
) -> TrainingResult:
    """Train ``job`` to completion in this process (one rank) with its objective; rank 0 saves the checkpoint.

    ``on_log(step, metrics)`` is called on rank 0 every ``log_every`` steps (and on the first and last step) with
    loss (the objective's, without the aux loss), aux_loss, lr, grad_norm, tokens_per_s, step_s, mfu, data_wait,
    expert_balance, mem_gb and the objective's own step metrics (DPO: rewards, margin, accuracy, log-probabilities);
    ``on_message`` gets human-readable progress lines.
    """
    t_start = time.perf_counter()
    rank, world_size, say, _ = open_run(job, on_message)

    # 1. tokenizer and the objective's data: every input checked before a model is built
    with span(say, "fixed", "training_data"):
        tokenizer = load_tokenizer(job)
        objective = build_objective(job, tokenizer, rank, world_size, say)

    # 2. model and engine, then the objective's own preparation (DPO's reference values) before any update
    with span(say, "fixed", "model_and_deepspeed"):
        run = start_engine(job, tokenizer, objective, world_size, say)
    with span(say, "work", "objective_prepare"):
        objective.prepare(run.engine, run.device, say)

    # 3. resume from the last saved state of an earlier attempt of this run, if there is one
    start_step, metrics_log, tokens_seen = resume_run(run.engine, job, objective, say)

    # 4. the loop: one optimizer step per iteration, gradient accumulation inside
    steps = StepLoop(job, run, objective, rank, world_size, say, on_log, metrics_log, tokens_seen)
    train_s = steps.run(start_step)
    say(span_line("work", "training_steps", train_s))

    # 5. the objective's held-out figures, then save (rank 0)
    with span(say, "work", "held_out_figures"):
        figures = objective.evaluate(run.engine.module, run.device, say)
    totals = RunTotals(
        start_step,
        steps.tokens_seen,
        tokens_seen,
        train_s,
        t_start,
        run.parameters_total,
        run.parameters_active,
    )
    with span(say, "fixed", "checkpoint_write"):
        return finish_run(job, run.engine, tokenizer, metrics_log, totals, say, **figures)


@dataclass(frozen=True)
class EngineRun:
    """The DeepSpeed engine a run trains, where it runs, and what its metrics lines divide by (MFU)."""

    engine: Any
    device: torch.device
    parameters_total: int
    parameters_active: int
    per_token_flops: float
    peak_flops: float | None


def start_engine(
    job: TrainingJob, tokenizer: Any, objective: Objective, world_size: int, say: MessageFn
) -> EngineRun:
    """The model (from ``init_from`` or fresh) wrapped by the DeepSpeed engine, with the figures MFU needs."""
    model = build_model(job, len(tokenizer), tokenizer)
    if job.init_from:
        say(f"weights from {job.parent} ({job.init_from})")
    total_params, active_params = count_parameters(model)
    engine = build_engine(model, job, world_size)
    device = engine.device if isinstance(engine.device, torch.device) else torch.device(engine.device)
    per_token_flops = monitor.flops_per_token(
        active_params, model.config.num_hidden_layers, model.config.hidden_size, objective.seq_len
    )
    say(
        f"engine ready: {total_params:,} parameters ({active_params:,} active), ZeRO stage "
        f"{engine.zero_optimization_stage()}, {objective.describe()}, world size {world_size}, device {device}"
    )
    return EngineRun(engine, device, total_params, active_params, per_token_flops, monitor.peak_flops(device))


class StepLoop:
    """The optimizer steps of one run, from where it resumed to ``max_steps``: batches prefetched, a watchdog on
    stalls, the non-finite guard, a metrics line every ``log_every`` steps, resumable state every
    ``checkpoint_every`` steps and on a stop request (SIGTERM), when every rank saves at the same step.

    ``metrics_log`` (the resumed one) grows in place; ``tokens_seen`` counts on from the resumed figure.
    """

    def __init__(
        self,
        job: TrainingJob,
        run: EngineRun,
        objective: Objective,
        rank: int,
        world_size: int,
        say: MessageFn,
        on_log: LogFn | None,
        metrics_log: list[dict[str, float]],
        tokens_seen: int,
    ) -> None:
        self.job, self.engine_run, self.objective = job, run, objective
        self.rank, self.world_size, self.say, self.on_log = rank, world_size, say, on_log
        self.metrics_log, self.tokens_seen = metrics_log, tokens_seen
        self.step = 0  # the step in progress: what the stall watchdog names
        self.guard: NonFiniteGuard  # both built by run(), with the run's batches and process group
        self.window: MetricsWindow

    def run(self, start_step: int) -> float:
        """Train steps ``start_step + 1 .. max_steps``; the seconds they took."""
        s, engine = self.job.settings, self.engine_run.engine
        accumulation = s.gradient_accumulation_steps
        batches = Prefetcher(
            self.objective.batches(
                s.micro_batch_size, s.seed, self.rank, self.world_size, start=start_step * accumulation
            ),
            self.engine_run.device,
            depth=s.prefetch,
            host_keys=self.objective.host_keys,
        )
        self.step = start_step
        watchdog = monitor.StallWatchdog(
            s.stall_timeout_s, lambda: f"rank {self.rank}, last completed step {self.step}"
        )
        control = Control(self.world_size)
        self.guard = NonFiniteGuard(engine, self.engine_run.device, control.group)
        self.window = MetricsWindow(
            batches,
            self.world_size,
            self.engine_run.per_token_flops,
            self.engine_run.peak_flops,
            self.engine_run.device,
            last_step=start_step,
        )
        train_start = time.perf_counter()
        # "step n/N" in the run log every progress_every_s seconds, whatever log_every is: clock-driven and rank 0
        # only (no collective), so a slow step or a large log_every never leaves the run log silent
        with contextlib.ExitStack() as running:  # leaving it, however: stop the watchdog and the loader
            running.callback(watchdog.stop)
            running.callback(batches.close)
            progress = running.enter_context(Progress(self.say, "training steps", every_s=s.progress_every_s))
            progress(start_step, s.max_steps)
            last: tuple[StepTotals, float] | None = None
            for self.step in range(start_step + 1, s.max_steps + 1):
                lr = engine.get_lr()[0]  # the rate this step's update uses
                try:
                    totals = optimizer_step(
                        engine,
                        batches,
                        accumulation,
                        control,
                        self.guard,
                        self.step,
                        self.objective,
                        poison=fault_point(NAN_AT_STEP, step=self.step),
                    )
                except StopRequested as stop:
                    # every rank is here, at the same step: save together, then leave
                    self.save_on_stop(stop.step, start_step, last)
                    raise
                last = (totals, lr)
                self.window.add(totals.tokens)
                watchdog.beat()
                progress(self.step, s.max_steps)
                fault_point(STALL_AT_STEP, step=self.step, stall_s=10 * s.stall_timeout_s)  # test-only
                fault_point(STEP_PAUSE)  # test-only
                self.after_step(self.step, *last)
        return time.perf_counter() - train_start

    def after_step(self, step: int, totals: StepTotals, lr: float) -> None:
        """The metrics line and the resumable state a completed step is due."""
        s = self.job.settings
        if step == 1 or step % s.log_every == 0 or step == s.max_steps:
            self.log_line(step, totals, lr)
        if s.checkpoint_every and step % s.checkpoint_every == 0 and step < s.max_steps:
            self.save(step)
            self.say(f"saved resumable state at step {step}")

    def save_on_stop(self, step: int, start_step: int, last: tuple[StepTotals, float] | None) -> None:
        """On a stop request at ``step``: its metrics line if one is pending, then the state (nothing when no
        step was trained since the resume: the state on disk already is that step's)."""
        if step <= start_step:
            return
        if step > self.window.last_step and last is not None:
            self.log_line(step, *last)
        self.save(step)
        self.say(f"saved resumable state at step {step}; stopping as asked (SIGTERM)")

    def save(self, step: int) -> None:
        """The resumable state of ``step`` (every rank at the same step). Its token count is every step's up to
        ``step``: the metrics lines' total plus the steps since the last line (``checkpoint_every`` need not be a
        multiple of ``log_every``)."""
        save_state(
            self.engine_run.engine,
            self.job,
            step,
            self.metrics_log,
            self.tokens_seen + self.window.pending_tokens(),
            self.objective.resume_state(step),
        )

    def log_line(self, step: int, totals: StepTotals, lr: float) -> None:
        """One metrics line (a collective: every rank calls it at the same steps), reported by rank 0."""
        self.guard.check(step)  # the one host read of the on-device non-finite flag, at log steps only
        metrics = self.window.close(
            step,
            totals.loss,
            totals.aux_loss,
            lr,
            self.engine_run.engine.get_global_grad_norm(),
            totals.expert_load,
            extra=totals.metrics,
        )
        self.metrics_log.append(metrics)
        self.tokens_seen += int(metrics["tokens"])
        if self.on_log and self.rank == 0:
            self.on_log(step, {k: v for k, v in metrics.items() if k != "step"})


@dataclass(frozen=True)
class RunTotals:
    """What a finished run counted, for its result: where it resumed, tokens, times and parameter counts."""

    start_step: int
    tokens_seen: int
    tokens_before: int  # tokens seen before this process resumed (not this process's throughput)
    train_s: float
    t_start: float  # time.perf_counter() when the run started
    parameters_total: int
    parameters_active: int


def finish_run(
    job: TrainingJob,
    engine: Any,
    tokenizer: Any,
    metrics_log: list[dict[str, float]],
    totals: RunTotals,
    say: MessageFn,
    **figures: Any,
) -> TrainingResult:
    """The run's result (``figures``: what the data kind adds, e.g. the validation loss, DPO's reward accuracy),
    the checkpoint exported by rank 0, every rank leaving together, and the resume state removed: how SFT,
    pretraining and DPO end."""
    rank, world_size = int(settings.RANK.get()), int(settings.WORLD_SIZE.get())
    trained_now = [m for m in metrics_log if m["step"] > totals.start_step]
    result = TrainingResult(
        run_id=job.run_id,
        checkpoint_dir=str(Path(job.output_dir)),
        steps=job.settings.max_steps,
        first_loss=metrics_log[0]["loss"],
        final_loss=metrics_log[-1]["loss"],
        tokens_seen=totals.tokens_seen,
        tokens_per_s=(totals.tokens_seen - totals.tokens_before) / max(totals.train_s, 1e-9),
        wall_s=time.perf_counter() - totals.t_start,
        loss_curve=[(int(m["step"]), m["loss"]) for m in metrics_log],
        parameters_total=totals.parameters_total,
        parameters_active=totals.parameters_active,
        world_size=world_size,
        dataset_run_hash=job.dataset_run_hash,
        resumed_from_step=totals.start_step,
        mfu=max((m["mfu"] for m in trained_now), default=0.0),
        peak_mem_gb=max((m["mem_gb"] for m in trained_now), default=0.0),
        parent=job.parent,
        data_kind=job.data_kind,
        **figures,
    )
    export_checkpoint(engine, tokenizer, job, result, metrics_log, rank)
    if dist.is_available() and dist.is_initialized() and world_size > 1:
        # every rank leaves together: a rank tearing down its communicator while rank 0 still writes the
        # checkpoint was seen to abort at exit ("terminate called without an active exception")
        dist.barrier()
    if rank == 0:
        say(f"saved {Path(job.output_dir)}")
        shutil.rmtree(state_dir(job), ignore_errors=True)  # the run is complete: its resume state is garbage
    return result


def export_checkpoint(
    engine: Any,
    tokenizer: Any,
    job: TrainingJob,
    result: TrainingResult,
    metrics_log: list[dict[str, float]],
    rank: int,
) -> None:
    """Rank 0 writes the Hugging Face checkpoint; under ZeRO-3 every rank first helps gather the weights."""
    if engine.zero_optimization_stage() >= 3:
        deepspeed = import_deepspeed()  # loaded by now: an engine exists

        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
            if rank == 0:
                save_checkpoint(engine.module, tokenizer, job, result, metrics_log)
    elif rank == 0:
        save_checkpoint(engine.module, tokenizer, job, result, metrics_log)


def save_checkpoint(
    model: NexaMoEForCausalLM,
    tokenizer: Any,
    job: TrainingJob,
    result: TrainingResult,
    metrics_log: list[dict[str, float]],
) -> Path:
    """Write the Hugging Face checkpoint under a temporary name, rename it into place, mark it complete last.

    The checkpoint sensor and every later stage only trust directories with the completion marker, so nothing
    ever evaluates or serves a checkpoint that is still being written or was cut short by a crash.
    """
    out = Path(job.output_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    hf_model = to_hf(model)
    hf_model.config.output_router_logits = False  # inference must not compute the aux loss
    base_generation = Path(job.tokenizer_path) / "generation_config.json"
    if base_generation.exists():  # the generation settings of the model whose tokenizer it is trained for
        from transformers import GenerationConfig  # as in load_tokenizer

        hf_model.generation_config = GenerationConfig.from_pretrained(job.tokenizer_path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))  # same filesystem: rename is atomic
    try:
        hf_model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_portable_configs(tmp)  # the same logits under transformers 4.x and vLLM builds pinned to it
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
