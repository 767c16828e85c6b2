"""The training process: ``python -m nexa_dagster.core.training.worker --job job.json [--log-dir DIR]``.

Launched by the GPU-cluster resource (one process, or one per rank under ``torchrun``); runnable by hand too.
Under Dagster Pipes (``DAGSTER_PIPES_CONTEXT`` is set) rank 0 streams progress into the Dagster run's event log
and reports the final metrics as an asset materialization; run by hand it prints them. With ``--log-dir`` every
rank also copies its stderr into ``DIR/worker.rank<N>.stderr.log``, which the launcher quotes when a run fails.

Exit codes: 0 done, 1 training failed, 2 unusable job file, 75 stopped on SIGTERM with its state saved (Slurm's
warning before the time limit, a preemption), 130 interrupted (the Dagster run was cancelled), 137 its launcher
or parent died. A failing rank also writes ``DIR/worker.rank<N>.failure.json`` saying whether a relaunch can
succeed (a lost node can; a non-finite loss or a configuration error fails again), which the launcher reads.

Signals: SIGINT stops now (a cancelled run); SIGTERM finishes the current step, saves the resumable state on
every rank and exits 75, so the relaunch resumes (``torchrun`` forwards both to its ranks).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn

import torch.distributed as dist

from nexa_dagster import settings
from nexa_dagster.core.common import threads
from nexa_dagster.core.common.net import free_port
from nexa_dagster.core.common.workers import (
    EXIT_STOPPED,
    STDERR_LOG,
    StderrTee,
    exit_if_interrupt_hangs,
    exit_with_launcher,
    exit_with_parent,
    is_permanent,
    write_failure,
)
from nexa_dagster.core.training.job import TrainingJob, TrainingResult
from nexa_dagster.core.training.loop import train
from nexa_dagster.core.training.stop import STOP, StopRequested


# -- process set-up ---------------------------------------------------------------------------------------------
def configure_environment(job: TrainingJob) -> None:
    """Make one plain process a valid world of one (as ``torchrun`` would), and pick DeepSpeed's accelerator.

    The job decides the accelerator: an inherited ``DS_ACCELERATOR`` from the launching shell must not send a
    CPU job to CUDA or the other way round.
    """
    settings.export(settings.DS_ACCELERATOR, job.accelerator)
    for variable in (settings.RANK, settings.LOCAL_RANK, settings.WORLD_SIZE, settings.MASTER_ADDR):
        settings.export_default(variable)
    settings.export_default(settings.MASTER_PORT, str(free_port()))


def stop_on_sigterm() -> None:
    """SIGTERM (Slurm's warning before the time limit, a preempted node, a deleted pod): finish the step, save
    the resumable state on every rank together, exit ``EXIT_STOPPED``."""

    def handler(signum: int, frame: Any) -> None:
        STOP.set()
        os.write(2, b"SIGTERM: saving the resumable state after this step, then stopping\n")

    signal.signal(signal.SIGTERM, handler)


class Reporter(contextlib.AbstractContextManager["Reporter"]):
    """Where progress goes: always stdout, and on rank 0 under Dagster Pipes also the Dagster run.

    Leaving the ``with`` block with an exception closes Pipes with that exception, so Dagster shows the
    worker's own traceback as a structured event.
    """

    def __init__(self, rank: int) -> None:
        self.pipes: Any = None
        self._lock = threading.Lock()
        if rank == 0 and settings.PIPES_CONTEXT.is_set():
            # only under a Pipes launch: a worker run by hand has none
            from dagster_pipes import open_dagster_pipes

            self.pipes = open_dagster_pipes()
        # A local worker's stdout is the Dagster process's own: printing there as well as through Pipes showed
        # every line twice in the run's console log. On a cluster stdout is the job's log file: keep it.
        self.echo = self.pipes is None or settings.WORKER_ECHO.get() != "0"

    def info(self, message: str) -> None:
        with (
            self._lock
        ):  # the loop's progress thread writes too: one message at a time into the Pipes channel
            if self.echo:
                print(message, flush=True)
            if self.pipes is not None:
                self.pipes.log.info(message)

    def on_log(self, max_steps: int) -> Callable[[int, dict[str, float]], None]:
        def log(step: int, m: dict[str, float]) -> None:
            mfu = f" mfu {m['mfu']:.1%}" if m.get("mfu") else ""
            dpo = (
                f" margin {m['reward_margin']:.4f} accuracy {m['reward_accuracy']:.2f} logps chosen "
                f"{m['logps_chosen']:.2f} rejected {m['logps_rejected']:.2f}"
                if "reward_margin" in m
                else ""
            )
            self.info(
                f"step {step}/{max_steps} loss {m['loss']:.4f}{dpo}{grpo_figures(m)} aux {m['aux_loss']:.4f} lr {m['lr']:.2e} "
                f"grad_norm {m['grad_norm']:.3f} tokens/s {m['tokens_per_s']:.0f}{mfu} "
                f"step {m['step_s'] * 1000:.0f} ms data-wait {m['data_wait']:.1%} "
                f"expert-balance {m['expert_balance']:.2f} mem {m['mem_gb']:.2f} GB"
            )

        return log

    def report_result(self, result: TrainingResult) -> None:
        """Hand the final metrics to Dagster: as the asset's materialization metadata (what the launching asset
        returns with ``invocation.get_materialize_result()``) and, whole, as a custom message."""
        if self.pipes is None:
            return
        if self.pipes.is_asset_step and len(self.pipes.asset_keys) == 1:
            self.pipes.report_asset_materialization(metadata=materialization_metadata(result))
        self.pipes.report_custom_message(result.model_dump(mode="json"))

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.pipes is not None:
            self.pipes.__exit__(exc_type, exc, tb)


RL_FIGURES = (  # rl_prompts runs: scalar figures of TrainingResult shown on the materialization
    "reward_first",
    "reward_final",
    "held_out_reward",
    "held_out_prompts",
    "frac_reward_zero_std",
    "completion_length",
    "rollout_s",
    "update_s",
    "rollout_tokens",
    "weight_sync_s",
)


def grpo_figures(m: dict[str, float]) -> str:
    """A GRPO step's figures for the step line (empty for other objectives)."""
    if "frac_reward_zero_std" not in m:
        return ""
    kl = f" kl {m['kl']:.4f}" if "kl" in m else ""
    if "is_ratio" in m:  # another engine sampled: how far its log-probs were from the trainer's
        kl += f" engine/trainer logp diff {m['sampling_logp_diff']:.2e} IS weight {m['is_ratio']:.3f}"
    return (
        f" reward {m['reward']:.3f} ± {m['reward_std']:.3f} zero-std groups {m['frac_reward_zero_std']:.2f} "
        f"clipped {m['clip_ratio']:.3f}{kl} completion {m['completion_length']:.1f} tokens rollout "
        f"{m['rollout_s'] * 1000:.0f} ms"
    )


def held_out_summary(result: TrainingResult) -> str:
    """The run's held-out figures for its last line: validation loss, DPO's reward accuracy, GRPO's reward."""
    parts = []
    if result.validation_loss is not None:
        parts.append(f"validation {result.validation_loss:.4f}")
    if result.reward_accuracy is not None:
        parts.append(
            f"held-out reward accuracy {result.reward_accuracy:.3f} over {result.validation_pairs} pairs"
        )
    if result.reward_first is not None:
        parts.append(f"rollout reward {result.reward_first:.3f} -> {result.reward_final:.3f}")
    if result.held_out_reward is not None:
        parts.append(f"held-out reward {result.held_out_reward:.3f} over {result.held_out_prompts} prompts")
    return "".join(f", {p}" for p in parts)


def materialization_metadata(result: TrainingResult) -> dict[str, Any]:
    """Pipes metadata: plain values are typed by Dagster; the path gets an explicit type so the UI links it."""
    return {
        "steps": result.steps,
        "first_loss": round(result.first_loss, 5),
        "final_loss": round(result.final_loss, 5),
        **(
            {"validation_loss": round(result.validation_loss, 5)}
            if result.validation_loss is not None
            else {}
        ),
        "tokens_seen": result.tokens_seen,
        "tokens_per_s": round(result.tokens_per_s, 1),
        "wall_s": round(result.wall_s, 1),
        "parameters_total": result.parameters_total,
        "parameters_active": result.parameters_active,
        "world_size": result.world_size,
        "resumed_from_step": result.resumed_from_step,
        "mfu": round(result.mfu, 4),
        "peak_mem_gb": round(result.peak_mem_gb, 3),
        "dataset_run_hash": result.dataset_run_hash,
        "checkpoint_dir": {"raw_value": result.checkpoint_dir, "type": "path"},
        **{  # preference runs: the held-out rewards
            key: round(value, 5) if isinstance(value, float) else value
            for key in ("reward_accuracy", "reward_margin", "validation_pairs", *RL_FIGURES)
            if (value := getattr(result, key)) is not None
        },
    }


# -- entrypoint -------------------------------------------------------------------------------------------------
def load_job(path: str) -> TrainingJob:
    try:
        return TrainingJob.model_validate_json(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise SystemExit(_fatal(f"cannot read training job {path}: {e}", code=2)) from None
    except ValueError as e:  # pydantic's ValidationError, invalid JSON
        raise SystemExit(_fatal(f"invalid training job {path}: {e}", code=2)) from None


def _fatal(message: str, code: int) -> int:
    print(message, file=sys.stderr, flush=True)
    return code


def run(job: TrainingJob, reporter: Reporter) -> TrainingResult:
    s = job.settings
    reporter.info(
        f"training {job.run_id}: preset {job.model_preset}, {s.max_steps} steps, micro-batch "
        f"{s.micro_batch_size} x accumulation {s.gradient_accumulation_steps}, world size "
        f"{settings.WORLD_SIZE.get()}, accelerator {job.accelerator}"
    )
    result = train(job, on_log=reporter.on_log(s.max_steps), on_message=reporter.info)
    reporter.info(
        f"done {job.run_id}: loss {result.first_loss:.4f} -> {result.final_loss:.4f}{held_out_summary(result)}, "
        f"{result.tokens_per_s:.0f} tokens/s, {result.wall_s:.1f} s, checkpoint {result.checkpoint_dir}"
    )
    reporter.report_result(result)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one TrainingJob (one rank).")
    parser.add_argument("--job", required=True, help="path of the TrainingJob JSON")
    parser.add_argument("--log-dir", default="", help="also copy this rank's stderr into a file here")
    args = parser.parse_args(argv)

    try:
        job = load_job(args.job)
    except SystemExit as e:
        write_failure(args.log_dir, int(settings.RANK.get()), None, "unusable job file", retryable=False)
        raise e
    configure_environment(job)
    # this node's share (its launcher may run on another machine: Slurm, Kubernetes), among its ranks
    threads.use(settings.thread_policy("training", alongside=int(settings.LOCAL_WORLD_SIZE.get())))
    exit_if_interrupt_hangs()
    exit_with_launcher()
    exit_with_parent()
    stop_on_sigterm()
    rank = int(settings.RANK.get())
    tee = StderrTee(Path(args.log_dir) / STDERR_LOG.format(rank=rank)) if args.log_dir else None
    try:
        with Reporter(rank) as reporter:
            run(job, reporter)
        return 0
    except KeyboardInterrupt:  # Dagster forwards a run cancellation as SIGINT
        return _fatal(
            f"training {job.run_id} interrupted on rank {rank}; no complete checkpoint was written", code=130
        )
    except StopRequested as e:
        message = f"training {job.run_id} {e}"
        write_failure(args.log_dir, rank, e, message, retryable=True)
        return _fatal(message, code=EXIT_STOPPED)
    except Exception as e:
        traceback.print_exc()
        message = f"training {job.run_id} failed on rank {rank}: {type(e).__name__}: {e}"
        write_failure(args.log_dir, rank, e, message, retryable=not is_permanent(e))
        return _fatal(message, code=1)
    finally:
        _shutdown_distributed()
        if tee is not None:
            tee.close()


def _shutdown_distributed() -> None:
    """Leave the process group cleanly, so torch does not warn and gloo does not hold the port."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_without_teardown(code: int) -> NoReturn:
    """Leave the process at once with ``code``, after flushing what it printed.

    By the time ``main`` returns, everything the run produced is on disk (checkpoint, summary, completion
    marker) and reported (Pipes, stderr), and the process group is left. Interpreter teardown would then only run
    the destructors of native libraries' thread pools (gloo, OpenMP, the rendezvous store's event loop), in an
    order that now and then aborts the process with "terminate called without an active exception" (SIGABRT,
    seen in CI on a GRPO relaunch that had saved its checkpoint): a finished run reported as a failed one.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_without_teardown(main())
