"""The local backend: this machine's GPUs (or CPU ranks), the worker a child process of the Dagster step."""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg

from nexa_dagster import settings
from nexa_dagster.resources.gpu_cluster.base import GPUClusterResource, WorkerLaunch


class LocalGPUCluster(GPUClusterResource):
    """Runs the worker here through ``PipesSubprocessClient`` (``torchrun`` for more than one rank).

    Cancelling the Dagster run sends SIGINT to the worker (or to ``torchrun``); the worker also exits by itself
    when the launching step process disappears (a killed run worker), so no orphan keeps a GPU busy."""

    backend = "local"

    def worker_command(self, job_file: Path, log_dir: Path) -> list[str]:
        """The training worker's command line: ``python -m ...worker``, under ``torchrun`` for more than one rank."""
        return WorkerLaunch("training", "", job_file, log_dir).argv(self.python(), self.num_procs)

    def launch_worker(
        self, context: dg.AssetExecutionContext, launch: WorkerLaunch
    ) -> dg.PipesClientCompletedInvocation:
        command = launch.argv(self.python(), self.num_procs)
        context.log.info(f"launching {' '.join(command)}")
        # the worker watches LAUNCHER_PID (this process) and logs through Pipes only (the step's stdout would
        # show every line twice)
        return dg.PipesSubprocessClient().run(
            context=context,
            command=command,
            cwd=str(launch.work_dir),
            env={**launch.env, settings.LAUNCHER_PID.name: str(os.getpid()), settings.WORKER_ECHO.name: "0"},
        )
