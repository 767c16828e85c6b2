"""The local backend: this machine's GPUs (or CPU ranks), the worker a child process of the Dagster step."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import dagster as dg
from pydantic import Field

from nexa_dagster import settings
from nexa_dagster.core.cluster import warm_python
from nexa_dagster.core.common.spans import WORKER_PROCESS, span_line
from nexa_dagster.resources.gpu_cluster.base import GPUClusterResource, WorkerFailed, WorkerLaunch

# how long a cancelled worker (or torchrun) has to exit after SIGINT: PipesSubprocessClient's own wait, above the
# worker's INTERRUPT_GRACE_S (core/common/workers.py), so the worker's hard exit comes first
TERMINATION_WAIT_S = 20.0

# what the warm Python imports: DeepSpeed through the training loop's own import of it (without the MLflow import
# DeepSpeed makes on the way; before the libraries, one of which is a DeepSpeed module), the workers this backend
# launches, then the libraries
WARM_PRELOAD = (
    "nexa_dagster.core.training.loop:import_deepspeed",
    "nexa_dagster.core.training.worker",
    "nexa_dagster.core.evaluation.worker",
    *warm_python.LIBRARIES,
)


class LocalGPUCluster(GPUClusterResource):
    """Runs the worker here in a Dagster Pipes session (``torchrun`` for more than one rank).

    The worker gets ``settings.environ()`` (never a secret of the step process), the launch's variables and Pipes'
    bootstrap ones: ``PipesSubprocessClient`` would hand it the step's whole ``os.environ``, which holds the LLM
    keys and the database URL. Cancelling the Dagster run sends SIGINT to the worker (or to ``torchrun``), as that
    client does; the worker also exits by itself when the launching step process disappears (a killed run
    worker), so no orphan keeps a GPU busy."""

    backend = "local"

    warm_start: bool = Field(
        default=False,
        description="fork each single-rank worker from a warm Python that imported torch, transformers and "
        "DeepSpeed once (core/cluster/warm_python.py): for a process that launches many workers (make run "
        "turns it on); off, every worker is a fresh interpreter",
    )

    def prestart_warm(self) -> None:
        """Start the warm Python importing now, beside other work, so the first worker need not wait for it."""
        if self.warm_start:
            env = self.worker_env("training", self.launch_env())
            warm_python.shared(self.python(), env, WARM_PRELOAD)

    def worker_env(self, kind: str, launch_env: dict[str, str], ranks: int = 1) -> dict[str, str]:
        """A worker's whole environment (before Dagster Pipes' variables): its kind's thread share, the ranks'
        split among them, over ``settings.environ()``; the launch's variables; this process as the launcher it
        watches (LAUNCHER_PID), and its lines through Pipes only (the step's stdout would show each twice)."""
        return {
            **settings.child_environ(kind, alongside=ranks),
            **launch_env,
            settings.LAUNCHER_PID.name: str(os.getpid()),
            settings.WORKER_ECHO.name: "0",
        }

    def _start(
        self, context: dg.AssetExecutionContext, command: list[str], cwd: Path, env: dict[str, str]
    ) -> subprocess.Popen[bytes] | warm_python.WarmChild:
        """The worker, forked from the warm Python where it is on and the worker's environment allows (what a
        library reads while importing must be what the warm Python imported under), else a fresh process."""
        if self.warm_start and warm_python.module_of(command, self.python()) is not None:  # not torchrun
            warm = warm_python.shared(self.python(), env, WARM_PRELOAD)
            child = warm_python.fork_worker(warm, command, cwd, env, context.log)
            if child is not None:
                return child
        return subprocess.Popen(command, cwd=str(cwd), env=env)

    def worker_command(self, job_file: Path, log_dir: Path) -> list[str]:
        """The training worker's command line: ``python -m ...worker``, under ``torchrun`` for more than one rank."""
        return WorkerLaunch("training", "", job_file, log_dir).argv(self.python(), self.num_procs)

    def launch_worker(
        self, context: dg.AssetExecutionContext, launch: WorkerLaunch
    ) -> dg.PipesClientCompletedInvocation:
        command = launch.argv(self.python(), self.num_procs)
        context.log.info(f"launching {' '.join(command)}")
        with dg.open_pipes_session(
            context=context,
            context_injector=dg.PipesTempFileContextInjector(),
            message_reader=dg.PipesTempFileMessageReader(),
        ) as session:
            ranks = self.num_procs if launch.distributed else 1
            env = {**self.worker_env(launch.kind, launch.env, ranks), **session.get_bootstrap_env_vars()}
            started = time.perf_counter()
            process = self._start(context, command, launch.work_dir, env)
            try:
                code = process.wait()
            except dg.DagsterExecutionInterruptedError:
                context.log.info("execution interrupted, sending SIGINT to subprocess (the worker)")
                process.send_signal(signal.SIGINT)
                process.wait(timeout=TERMINATION_WAIT_S)
                raise
            if code != 0:
                raise WorkerFailed(f"the worker exited with code {code}")
        # once the session is closed, every span the worker sent is in the log before this one, which holds them
        context.log.info(
            span_line("fixed", WORKER_PROCESS.format(kind=launch.kind), time.perf_counter() - started)
        )
        return dg.PipesClientCompletedInvocation(session)
