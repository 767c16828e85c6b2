"""What every worker process the project launches shares with its launcher: exit codes, failure reports, stderr
copies, and watchdogs that end a worker whose launcher or parent is gone.

The training worker (``core/training/worker.py``) and the evaluation worker (``core/evaluation/worker.py``) are
started by the GPU-cluster resource (a local process, a Slurm job, a pod). A failing worker writes
``<log dir>/worker.rank<N>.failure.json`` saying whether a relaunch can succeed, and every rank copies its stderr
to ``worker.rank<N>.stderr.log``; the launcher reads both (``resources/gpu_cluster/base.py``) to decide whether
the step is retried and to quote the error.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path
from typing import IO

from nexa_dagster import settings

STDERR_LOG = "worker.rank{rank}.stderr.log"
FAILURE_FILE = "worker.rank{rank}.failure.json"
EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped on request with the state saved; run it again to resume
# what fails the same way on a relaunch: the numbers, the data or the configuration, not the machine
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (
    FloatingPointError,
    ValueError,
    TypeError,
    KeyError,
    LookupError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    IsADirectoryError,
    ImportError,  # ModuleNotFoundError included: an installation that lacks a module lacks it on every relaunch
)
INTERRUPT_GRACE_S = 10.0  # below the local backend's 20 s wait, so Dagster never leaves us running


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
    launcher = int(settings.LAUNCHER_PID.get())
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


def write_failure(
    log_dir: str, rank: int, error: BaseException | None, message: str, retryable: bool
) -> None:
    """Tell the launcher (through the shared log directory) whether running this job again can succeed."""
    if not log_dir:
        return
    with contextlib.suppress(OSError):
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        (Path(log_dir) / FAILURE_FILE.format(rank=rank)).write_text(
            json.dumps(
                {
                    "rank": rank,
                    "error": type(error).__name__ if error else "",
                    "message": message,
                    "retryable": retryable,
                }
            ),
            encoding="utf-8",
        )


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
