"""Training and evaluation workers run by the tests as ``make run`` runs them: forked from a warm Python.

Why: a worker is ``python -m nexa_dagster.core.{training,evaluation}.worker`` and imports torch, transformers and
DeepSpeed before its first line of work, ~5 of the ~7 CPU-s a tiny test training costs on the 2-core machine. The
suite's worker tests run dozens of them; each pytest process keeps one warm Python (``core/cluster/warm_python.py``,
what ``make run`` and the training benches keep) and forks every worker it can from it. A worker whose environment
differs from the warm Python's in a variable read while importing is started cold, as ``fork_worker`` decides for
the product (and says why on stderr). The cold path itself stays under test where a backend starts workers cold:
``torchrun``'s ranks, Slurm, Kubernetes, and every Dagster run through ``LocalGPUCluster`` (``warm_start`` off).
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from nexa_dagster.core.cluster.warm_python import WarmChild, WorkerStarter

# pytest's per-test variable: not read by any library, but a different value would make every launch "differ" from
# the warm Python's environment and start cold
_PER_TEST = "PYTEST_CURRENT_TEST"


class _StderrLog:
    def info(self, msg: str) -> None:
        print(msg, file=sys.stderr)

    def warning(self, msg: str) -> None:
        print(msg, file=sys.stderr)


_starter: WorkerStarter | None = None
_launched: list[LaunchedWorker] = []  # the workers the current warm Python started
_output_dir: tempfile.TemporaryDirectory[str] | None = None


def _outputs() -> str:
    """A folder of this pytest process's for the workers' output files, removed at its exit."""
    global _output_dir
    if _output_dir is None:
        _output_dir = tempfile.TemporaryDirectory(prefix="nexa-worker-outputs-")
        atexit.register(_output_dir.cleanup)
    return _output_dir.name


def _environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, **(extra or {})}
    env.pop(_PER_TEST, None)
    return env


def starter() -> WorkerStarter:
    """This pytest process's warm Python for its environment now (started on first use, importing in the
    background; closed at exit). The session's fixtures set variables as they start (the Slurm cluster's
    ``SLURM_CONF``, say): once the environment a library would import under has changed, every fork would start
    cold, so the warm Python is started again under the new one (~6 CPU-s in the background, against ~6 a cold
    worker)."""
    global _starter
    env = _environment()
    # the product's rule: what the warm Python's own imports set (DeepSpeed's CUDA-check variable) does not count
    if _starter is not None and _starter.pool is not None and _starter.pool.differs(env):
        # a worker still running from it would die with it (its exit code comes through the warm Python): closed
        # now only when none is, else at this process's exit (atexit below)
        if all(w.poll() is not None for w in _launched):
            _starter.close()
        _launched.clear()
        _starter = None
    if _starter is None:
        _starter = WorkerStarter(sys.executable, env, _StderrLog()).start()
        atexit.register(_starter.close)
    return _starter


class LaunchedWorker:
    """A worker started by ``start_worker_process``, as much of ``subprocess.Popen`` as the tests use: ``pid``,
    ``poll``, ``wait``, ``communicate`` (its stdout and stderr together, as ``stderr=STDOUT`` gives), ``send_signal``,
    ``kill``, ``returncode`` (negative: the signal that killed it)."""

    def __init__(self, proc: WarmChild | subprocess.Popen[bytes], output: Path) -> None:
        self._proc, self.output = proc, output
        self.pid = proc.pid
        self.forked = isinstance(
            proc, WarmChild
        )  # False: started cold (the reason is on this process's stderr)

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    def poll(self) -> int | None:
        return self._proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self._proc.wait(timeout)

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self.wait(timeout)
        return self.output.read_text(errors="replace"), None

    def send_signal(self, sig: int) -> None:
        self._proc.send_signal(sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_worker_process(
    command: Sequence[str],
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    own_session: bool = False,
) -> LaunchedWorker:
    """``command`` (``[sys.executable, "-m", module, ...]``) started, forked from the warm Python where it can be,
    its output in a file of its own. ``env``: added to this process's. ``own_session``: the worker leads a session
    and process group of its own (a test kills its group with ``os.killpg(worker.pid, ...)``)."""
    output = Path(tempfile.mkdtemp(prefix="nexa-worker-", dir=_outputs())) / "output.log"
    proc = starter().launch(
        command, cwd or os.getcwd(), output, env=_environment(env), own_session=own_session
    )
    worker = LaunchedWorker(proc, output)
    _launched.append(worker)
    return worker


def run_worker_command(
    command: Sequence[str],
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
    cwd: str | Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """``command`` run to its end, as ``subprocess.run(..., capture_output=True, text=True)`` would, forked from
    the warm Python where it can be: its stdout and stderr together in ``stdout`` (in the order written),
    ``stderr`` empty."""
    worker = start_worker_process(command, env, cwd)
    try:
        out, _ = worker.communicate(timeout)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait(30)
        raise
    return subprocess.CompletedProcess(list(command), worker.returncode, out, "")
