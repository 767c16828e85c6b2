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
import faulthandler
import json
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from nexa_dagster.core.common.net import free_port
from nexa_dagster.core.training.job import TrainingJob, TrainingResult
from nexa_dagster.core.training.stop import STOP, StopRequested

STDERR_LOG = "worker.rank{rank}.stderr.log"
FAILURE_FILE = "worker.rank{rank}.failure.json"
EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped on request with the state saved; run it again to resume
# what fails the same way on a relaunch: the numbers, the data or the configuration, not the machine
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (FloatingPointError, ValueError, TypeError, KeyError,
                                                     LookupError, FileNotFoundError, FileExistsError,
                                                     NotADirectoryError, IsADirectoryError)
LAUNCHER_PID_ENV = "NEXA_LAUNCHER_PID"  # set by the GPU-cluster resource: the Dagster step process
ECHO_ENV = "NEXA_WORKER_ECHO"  # "0": progress goes to Dagster Pipes only, not also to stdout (local backend)
INTERRUPT_GRACE_S = 10.0  # below PipesSubprocessClient's 20 s wait, so Dagster never leaves us running


# -- process set-up ---------------------------------------------------------------------------------------------
def configure_environment(job: TrainingJob) -> None:
    """Make one plain process a valid world of one (as ``torchrun`` would), and pick DeepSpeed's accelerator.

    The job decides the accelerator: an inherited ``DS_ACCELERATOR`` from the launching shell must not send a
    CPU job to CUDA or the other way round.
    """
    os.environ["DS_ACCELERATOR"] = job.accelerator
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def exit_if_interrupt_hangs(grace_s: float = INTERRUPT_GRACE_S) -> None:
    """After SIGINT, give the main thread ``grace_s`` to unwind (KeyboardInterrupt), then exit hard.

    Python only raises KeyboardInterrupt when the main thread runs Python code again; a rank blocked in a
    collective waiting for a dead peer never does. The C-level signal handler still writes to the wakeup fd,
    which wakes this watchdog thread even then.
    """
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end)

    def watch() -> None:
        while os.read(read_end, 1)[0] != signal.SIGINT:
            pass
        time.sleep(grace_s)
        os.write(2, f"worker did not stop within {grace_s:.0f} s of SIGINT; exiting hard\n".encode())
        os._exit(130)

    threading.Thread(target=watch, name="interrupt-watchdog", daemon=True).start()


def exit_with_launcher(poll_s: float = 2.0) -> None:
    """Exit when the process that launched us is gone (a run worker killed with SIGKILL cannot forward a
    cancellation); ``torchrun`` sits in between for several ranks, so watch the launcher's pid, not our parent."""
    launcher = int(os.environ.get(LAUNCHER_PID_ENV, "0"))
    if launcher <= 0:
        return

    def watch() -> None:
        while is_alive(launcher):
            time.sleep(poll_s)
        os.write(2, f"launcher process {launcher} is gone; stopping the worker\n".encode())
        os._exit(137)

    threading.Thread(target=watch, name="launcher-watchdog", daemon=True).start()


def exit_with_parent(poll_s: float = 1.0) -> None:
    """Exit when our parent dies (we are re-parented): under ``torchrun`` the ranks run in sessions of their own,
    so a SIGKILL to the launcher's process group does not reach them, and a rank left behind holds its GPU.

    Polling ``getppid`` rather than ``prctl(PR_SET_PDEATHSIG)``: the latter fires when the parent *thread* that
    forked us ends, which is not the same as the launcher ending.
    """
    parent = os.getppid()
    if parent <= 1:  # PID 1's children (a container's entrypoint) have nothing to watch
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.write(2, f"parent process {parent} is gone; stopping the worker\n".encode())
        os._exit(137)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def stop_on_sigterm() -> None:
    """SIGTERM (Slurm's warning before the time limit, a preempted node, a deleted pod): finish the step, save
    the resumable state on every rank together, exit ``EXIT_STOPPED``."""
    def handler(signum: int, frame: Any) -> None:
        STOP.set()
        os.write(2, b"SIGTERM: saving the resumable state after this step, then stopping\n")

    signal.signal(signal.SIGTERM, handler)


def write_failure(log_dir: str, rank: int, error: BaseException | None, message: str, retryable: bool) -> None:
    """Tell the launcher (through the shared log directory) whether running this job again can succeed."""
    if not log_dir:
        return
    with contextlib.suppress(OSError):
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        (Path(log_dir) / FAILURE_FILE.format(rank=rank)).write_text(json.dumps(
            {"rank": rank, "error": type(error).__name__ if error else "", "message": message,
             "retryable": retryable}), encoding="utf-8")


def is_permanent(error: BaseException) -> bool:
    """A failure that a relaunch repeats; torch's out-of-memory error is one too (same model, same batch)."""
    return isinstance(error, PERMANENT_ERRORS) or type(error).__name__ == "OutOfMemoryError"


def is_alive(pid: int) -> bool:
    """True while ``pid`` runs; a killed process stays a zombie until its parent reaps it, which counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no procfs (macOS): trust kill()
        return True


class StderrTee:
    """Copy everything written to file descriptor 2 into a log file while still passing it through.

    It works at the descriptor level, so it also catches what C++ extensions, DeepSpeed's op builds and
    ``faulthandler`` write, not only Python's ``sys.stderr``; the launcher quotes the file's tail on failure.
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.log: IO[bytes] = open(path, "ab", buffering=0)  # noqa: SIM115 (closed in close())
        self._original = os.dup(2)
        read_end, write_end = os.pipe()
        sys.stderr.flush()
        os.dup2(write_end, 2)
        os.close(write_end)
        self._read_end = read_end
        self._stopping = threading.Event()
        self._pump = threading.Thread(target=self._copy, name="stderr-tee", daemon=True)
        self._pump.start()
        faulthandler.enable(file=self.log)  # a segfault in a native op still leaves a Python stack in the log

    def _copy(self) -> None:
        # No end-of-file to wait for: libraries keep duplicates of fd 2, so the pipe never closes. Poll instead,
        # and after close() drain what is left, then stop.
        while True:
            ready, _, _ = select.select([self._read_end], [], [], 0.2)
            if not ready:
                if self._stopping.is_set():
                    return
                continue
            chunk = os.read(self._read_end, 65536)
            if not chunk:
                return
            self.log.write(chunk)
            with contextlib.suppress(OSError):  # the launcher's end is gone; keep the file complete anyway
                os.write(self._original, chunk)

    def close(self) -> None:
        """Restore the real stderr, copy what is still in the pipe, stop the pump."""
        sys.stderr.flush()
        faulthandler.disable()
        os.dup2(self._original, 2)
        self._stopping.set()
        self._pump.join(timeout=5)
        self.log.close()


# -- reporting --------------------------------------------------------------------------------------------------
class Reporter(contextlib.AbstractContextManager["Reporter"]):
    """Where progress goes: always stdout, and on rank 0 under Dagster Pipes also the Dagster run.

    Leaving the ``with`` block with an exception closes Pipes with that exception, so Dagster shows the
    worker's own traceback as a structured event.
    """

    def __init__(self, rank: int) -> None:
        self.pipes: Any = None
        self._lock = threading.Lock()
        if rank == 0 and os.environ.get("DAGSTER_PIPES_CONTEXT"):
            from dagster_pipes import open_dagster_pipes

            self.pipes = open_dagster_pipes()
        # A local worker's stdout is the Dagster process's own: printing there as well as through Pipes showed
        # every line twice in the run's console log. On a cluster stdout is the job's log file: keep it.
        self.echo = self.pipes is None or os.environ.get(ECHO_ENV, "1") != "0"

    def info(self, message: str) -> None:
        with self._lock:  # the loop's progress thread writes too: one message at a time into the Pipes channel
            if self.echo:
                print(message, flush=True)
            if self.pipes is not None:
                self.pipes.log.info(message)

    def on_log(self, max_steps: int) -> Callable[[int, dict[str, float]], None]:
        def log(step: int, m: dict[str, float]) -> None:
            mfu = f" mfu {m['mfu']:.1%}" if m.get("mfu") else ""
            self.info(f"step {step}/{max_steps} loss {m['loss']:.4f} aux {m['aux_loss']:.4f} lr {m['lr']:.2e} "
                      f"grad_norm {m['grad_norm']:.3f} tokens/s {m['tokens_per_s']:.0f}{mfu} "
                      f"step {m['step_s'] * 1000:.0f} ms data-wait {m['data_wait']:.1%} "
                      f"expert-balance {m['expert_balance']:.2f} mem {m['mem_gb']:.2f} GB")
        return log

    def report_result(self, result: TrainingResult) -> None:
        """Hand the final metrics to Dagster: as the asset's materialization metadata (what the launching asset
        returns with ``invocation.get_materialize_result()``) and, whole, as a custom message."""
        if self.pipes is None:
            return
        if self.pipes.is_asset_step and len(self.pipes.asset_keys) == 1:
            self.pipes.report_asset_materialization(metadata=materialization_metadata(result))
        self.pipes.report_custom_message(result.model_dump(mode="json"))

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.pipes is not None:
            self.pipes.__exit__(exc_type, exc, tb)


def materialization_metadata(result: TrainingResult) -> dict[str, Any]:
    """Pipes metadata: plain values are typed by Dagster; the path gets an explicit type so the UI links it."""
    return {
        "steps": result.steps,
        "first_loss": round(result.first_loss, 5),
        "final_loss": round(result.final_loss, 5),
        "validation_loss": round(result.validation_loss, 5),
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
    from nexa_dagster.core.training.loop import train

    s = job.settings
    reporter.info(f"training {job.run_id}: preset {job.model_preset}, {s.max_steps} steps, micro-batch "
                  f"{s.micro_batch_size} x accumulation {s.gradient_accumulation_steps}, world size "
                  f"{os.environ['WORLD_SIZE']}, accelerator {job.accelerator}")
    result = train(job, on_log=reporter.on_log(s.max_steps), on_message=reporter.info)
    reporter.info(f"done {job.run_id}: loss {result.first_loss:.4f} -> {result.final_loss:.4f}, validation "
                  f"{result.validation_loss:.4f}, {result.tokens_per_s:.0f} tokens/s, {result.wall_s:.1f} s, "
                  f"checkpoint {result.checkpoint_dir}")
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
        write_failure(args.log_dir, int(os.environ.get("RANK", "0")), None, "unusable job file", retryable=False)
        raise e
    configure_environment(job)
    exit_if_interrupt_hangs()
    exit_with_launcher()
    exit_with_parent()
    stop_on_sigterm()
    rank = int(os.environ["RANK"])
    tee = StderrTee(Path(args.log_dir) / STDERR_LOG.format(rank=rank)) if args.log_dir else None
    try:
        with Reporter(rank) as reporter:
            run(job, reporter)
        return 0
    except KeyboardInterrupt:  # Dagster forwards a run cancellation as SIGINT
        return _fatal(f"training {job.run_id} interrupted on rank {rank}; no complete checkpoint was written",
                      code=130)
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
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
