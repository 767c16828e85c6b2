"""The Slurm backend: an ``sbatch`` script per worker, polled until it ends, ``scancel``-ed if the step stops.

Pipes context and messages go through files in the run's work directory, which must be on a filesystem the
nodes share (as the data root is). ``submit_and_wait`` (``core/cluster/slurm.py``) is the one submit/poll/cancel
path: training, evaluation and packaging shards (a job array) go through it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import dagster as dg
from pydantic import Field

from nexa_dagster.core.cluster import slurm
from nexa_dagster.core.cluster.commands import SLURM_RENDEZVOUS
from nexa_dagster.core.cluster.shard_task import output_tail
from nexa_dagster.resources.gpu_cluster.base import GPUClusterResource, WorkerFailed, WorkerLaunch


class SlurmGPUCluster(GPUClusterResource):
    """Runs the worker as a Slurm job: one task per node, ``torchrun`` inside it for a training's ranks."""

    backend = "slurm"

    nodes: int = Field(default=1, ge=1, description="nodes per training job (num_procs ranks on each)")
    slurm_partition: str = ""
    slurm_account: str = ""
    slurm_time_limit: str = "24:00:00"
    slurm_stop_warning_s: int = Field(
        default=120,
        ge=1,
        description="SIGTERM reaches the worker this long before the time limit; a training "
        "saves its resumable state and stops, so a relaunch resumes (one step plus "
        "a save must fit; Slurm may signal up to 60 s earlier)",
    )
    slurm_cpus_per_task: int = Field(default=8, ge=1)
    slurm_extra_directives: list[str] = Field(default_factory=list, description='e.g. ["--qos=high"]')
    slurm_setup_commands: list[str] = Field(
        default_factory=list, description="shell lines run before the worker (module load, venv)"
    )
    poll_interval_s: float = Field(default=5.0, gt=0, description="how often the job's state is read")
    slurm_packaging_partition: str = Field(
        default="",
        description="partition for packaging shards (CPU work, one CPU per element); empty: slurm_partition",
    )

    def world_size(self) -> int:
        return self.num_procs * self.nodes

    def sbatch_script(self, launch: WorkerLaunch) -> str:
        """The batch script of ``launch``: a training on ``nodes`` × ``num_procs`` ranks, an evaluation on one
        process (one GPU with ``accelerator: cuda``)."""
        procs, nodes = (self.num_procs, self.nodes) if launch.distributed else (1, 1)
        return slurm.sbatch_script(
            job_name=f"nexa-{launch.run_id}" if launch.distributed else f"nexa-{launch.name}-{launch.run_id}",
            command=launch.argv(self.python(), procs, nodes, SLURM_RENDEZVOUS),
            log_dir=str(launch.work_dir),
            procs_per_node=procs,
            nodes=nodes,
            gpus=self.accelerator == "cuda",
            env=launch.env,
            partition=self.slurm_partition,
            account=self.slurm_account,
            time_limit=self.slurm_time_limit,
            stop_warning_s=self.slurm_stop_warning_s,
            cpus_per_task=self.slurm_cpus_per_task,
            extra_directives=self.slurm_extra_directives,
            setup_commands=self.slurm_setup_commands,
        )

    def shard_runner(
        self, context: dg.AssetExecutionContext, work_dir: str, max_parallel: int = 0
    ) -> slurm.SlurmArrayRunner:
        """Packaging shards as one job array, submitted, polled and cancelled like a training job; this cluster's
        partition (or ``slurm_packaging_partition``), account, time limit and setup commands, one CPU per element.
        The training's ``slurm_extra_directives`` are not used: they may ask for GPUs a shard does not need."""
        require_sbatch()
        return slurm.SlurmArrayRunner(
            work_dir,
            lambda script: submit_and_wait(context, script, self.poll_interval_s)[0],
            python=self.python(),
            env=dict(self.env),
            max_parallel=max_parallel,
            partition=self.slurm_packaging_partition or self.slurm_partition,
            account=self.slurm_account,
            time_limit=self.slurm_time_limit,
            setup_commands=self.slurm_setup_commands,
        )

    def launch_worker(
        self, context: dg.AssetExecutionContext, launch: WorkerLaunch
    ) -> dg.PipesClientCompletedInvocation:
        """Submit with ``sbatch``, poll until the job ends, ``scancel`` it if this step is interrupted."""
        require_sbatch()
        with dg.open_pipes_session(
            context=context,
            context_injector=dg.PipesFileContextInjector(str(launch.work_dir / "pipes_context.json")),
            message_reader=dg.PipesFileMessageReader(str(launch.work_dir / "pipes_messages.jsonl")),
        ) as session:
            script = launch.work_dir / f"{launch.name}.sbatch"
            script.write_text(
                self.sbatch_script(launch.with_env(session.get_bootstrap_env_vars())), encoding="utf-8"
            )
            job_id, state = submit_and_wait(context, script, self.poll_interval_s)
            if state not in slurm.SLURM_DONE:
                raise WorkerFailed(
                    f"Slurm job {job_id} ended {state}; output ends with:\n"
                    f"{output_tail(launch.work_dir / f'slurm-{job_id}.out')}"
                )
        return dg.PipesClientCompletedInvocation(session)


def require_sbatch() -> None:
    if shutil.which("sbatch") is None:
        raise dg.Failure(
            "backend 'slurm': sbatch is not on PATH of the Dagster step process", allow_retries=False
        )


def submit_and_wait(
    context: dg.AssetExecutionContext | dg.OpExecutionContext, script: Path, poll_interval_s: float
) -> tuple[str, str]:
    """``slurm.submit_and_wait`` logging to the run; an ``sbatch`` that refuses the script fails the step."""
    try:
        return slurm.submit_and_wait(script, poll_interval_s, context.log.info)
    except slurm.SlurmCommandFailed as e:
        raise dg.Failure(str(e)) from e
