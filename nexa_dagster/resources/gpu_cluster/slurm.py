"""The Slurm backend: an ``sbatch`` script per worker, polled until it ends, ``scancel``-ed if the step stops.

Pipes context and messages go through files in the run's work directory, which must be on a filesystem the
nodes share (as the data root is). ``submit_and_wait`` is the one submit/poll/cancel path: training, evaluation
and anything else that runs as a Slurm job (packaging shards) go through it.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import dagster as dg
from pydantic import Field

from nexa_dagster.core.cluster import launch_specs
from nexa_dagster.core.cluster.shard_runners import SlurmArrayRunner
from nexa_dagster.core.cluster.slurm_jobs import job_states, overall_state, scontrol_records
from nexa_dagster.resources.gpu_cluster.base import GPUClusterResource, WorkerFailed, WorkerLaunch

SLURM_DONE = {"COMPLETED"}
SLURM_FAILED = {"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
                "DEADLINE"}
SLURM_UNKNOWN_GRACE_S = 120.0  # how long a job Slurm does not know is waited for (a controller restart)
OUTPUT_TAIL_CHARS = 4000


class SlurmGPUCluster(GPUClusterResource):
    """Runs the worker as a Slurm job: one task per node, ``torchrun`` inside it for a training's ranks."""

    backend = "slurm"

    nodes: int = Field(default=1, ge=1, description="nodes per training job (num_procs ranks on each)")
    slurm_partition: str = ""
    slurm_account: str = ""
    slurm_time_limit: str = "24:00:00"
    slurm_stop_warning_s: int = Field(
        default=120, ge=1, description="SIGTERM reaches the worker this long before the time limit; a training "
                                       "saves its resumable state and stops, so a relaunch resumes (one step plus "
                                       "a save must fit; Slurm may signal up to 60 s earlier)")
    slurm_cpus_per_task: int = Field(default=8, ge=1)
    slurm_extra_directives: list[str] = Field(default_factory=list, description='e.g. ["--qos=high"]')
    slurm_setup_commands: list[str] = Field(default_factory=list,
                                            description="shell lines run before the worker (module load, venv)")
    poll_interval_s: float = Field(default=5.0, gt=0, description="how often the job's state is read")
    slurm_packaging_partition: str = Field(
        default="", description="partition for packaging shards (CPU work, one CPU per element); empty: "
                                "slurm_partition")

    def world_size(self) -> int:
        return self.num_procs * self.nodes

    def sbatch_script(self, launch: WorkerLaunch) -> str:
        """The batch script of ``launch``: a training on ``nodes`` × ``num_procs`` ranks, an evaluation on one
        process (one GPU with ``accelerator: cuda``)."""
        procs, nodes = (self.num_procs, self.nodes) if launch.distributed else (1, 1)
        return launch_specs.sbatch_script(
            job_name=f"nexa-{launch.run_id}" if launch.distributed else f"nexa-{launch.name}-{launch.run_id}",
            command=launch.argv(self.python(), procs, nodes, launch_specs.SLURM_RENDEZVOUS),
            log_dir=str(launch.work_dir), procs_per_node=procs, nodes=nodes, gpus=self.accelerator == "cuda",
            env=launch.env, partition=self.slurm_partition, account=self.slurm_account,
            time_limit=self.slurm_time_limit, stop_warning_s=self.slurm_stop_warning_s,
            cpus_per_task=self.slurm_cpus_per_task, extra_directives=self.slurm_extra_directives,
            setup_commands=self.slurm_setup_commands)

    def shard_runner(self, context: dg.AssetExecutionContext, work_dir: str,
                     max_parallel: int = 0) -> SlurmArrayRunner:
        """Packaging shards as one job array, submitted, polled and cancelled like a training job; this cluster's
        partition (or ``slurm_packaging_partition``), account, time limit and setup commands, one CPU per element.
        The training's ``slurm_extra_directives`` are not used: they may ask for GPUs a shard does not need."""
        require_sbatch()
        return SlurmArrayRunner(
            work_dir, lambda script: submit_and_wait(context, script, self.poll_interval_s)[0],
            python=self.python(), env=dict(self.env), max_parallel=max_parallel,
            partition=self.slurm_packaging_partition or self.slurm_partition, account=self.slurm_account,
            time_limit=self.slurm_time_limit, setup_commands=self.slurm_setup_commands)

    def launch_worker(self, context: dg.AssetExecutionContext,
                      launch: WorkerLaunch) -> dg.PipesClientCompletedInvocation:
        """Submit with ``sbatch``, poll until the job ends, ``scancel`` it if this step is interrupted."""
        require_sbatch()
        with dg.open_pipes_session(
            context=context,
            context_injector=dg.PipesFileContextInjector(str(launch.work_dir / "pipes_context.json")),
            message_reader=dg.PipesFileMessageReader(str(launch.work_dir / "pipes_messages.jsonl")),
        ) as session:
            script = launch.work_dir / f"{launch.name}.sbatch"
            script.write_text(self.sbatch_script(launch.with_env(session.get_bootstrap_env_vars())), encoding="utf-8")
            job_id, state = submit_and_wait(context, script, self.poll_interval_s)
            if state not in SLURM_DONE:
                raise WorkerFailed(f"Slurm job {job_id} ended {state}; output ends with:\n"
                                   f"{output_tail(launch.work_dir / f'slurm-{job_id}.out')}")
        return dg.PipesClientCompletedInvocation(session)


def require_sbatch() -> None:
    if shutil.which("sbatch") is None:
        raise dg.Failure("backend 'slurm': sbatch is not on PATH of the Dagster step process", allow_retries=False)


def submit_and_wait(context: dg.AssetExecutionContext | dg.OpExecutionContext, script: Path,
                    poll_interval_s: float) -> tuple[str, str]:
    """Submit ``script`` (``sbatch --parsable``), log the job id, poll until it ends; return (job id, final state).

    If this step stops while it waits (a cancelled run, an interrupt), the job is ``scancel``-ed before the
    exception goes on, so no Slurm job outlives the step that owns it."""
    job_id = _run(["sbatch", "--parsable", str(script)]).split(";")[0].strip()
    context.log.info(f"submitted Slurm job {job_id} ({script})")
    try:
        state = wait_for_slurm_job(job_id, poll_interval_s, context.log.info)
    except BaseException:
        subprocess.run(["scancel", job_id], check=False)
        context.log.warning(f"cancelled Slurm job {job_id}")
        raise
    return job_id, state


def output_tail(path: Path, chars: int = OUTPUT_TAIL_CHARS) -> str:
    """The end of a job's output file (``--output``), where its error is."""
    return path.read_text(errors="replace")[-chars:] if path.exists() else f"(no output file {path})"


def _run(command: list[str]) -> str:
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise dg.Failure(f"{' '.join(command)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout}")
    return proc.stdout


def slurm_job_fields(job_id: str) -> dict[str, str]:
    """``scontrol show job`` as a dict (the controller keeps finished jobs for MinJobAge); empty if unknown."""
    return {key: value for fields in scontrol_records(job_id) for key, value in fields.items()}


def slurm_state(job_id: str) -> str:
    """The job's state from the controller, else from accounting (``sacct``, where the cluster runs slurmdbd); for a
    job array, one state for all its elements (``core/slurm_jobs.overall_state``: running while any element is)."""
    return overall_state(job_states(job_id))


def wait_for_slurm_job(job_id: str, poll_s: float, log: Any, unknown_grace_s: float = SLURM_UNKNOWN_GRACE_S) -> str:
    """Poll until the job ends; log each change of state, with Slurm's reason while it waits (a job asking for
    more than the partition has waits forever with reason PartitionConfig: the log says so).

    A job neither the controller nor accounting knows (``UNKNOWN``: a wrong id, a job purged after ``MinJobAge``
    on a cluster without ``slurmdbd``, a controller that lost its state) is waited for ``unknown_grace_s`` (a
    controller restarting comes back), then a ``RuntimeError`` says so instead of polling forever."""
    last = ""
    unknown_since: float | None = None
    while True:
        state = slurm_state(job_id)
        if state == "UNKNOWN":
            unknown_since = time.monotonic() if unknown_since is None else unknown_since
            if time.monotonic() - unknown_since > unknown_grace_s:
                raise RuntimeError(f"Slurm job {job_id}: neither the controller (scontrol show job) nor accounting "
                                   f"(sacct) has known it for {unknown_grace_s:.0f} s; its outcome cannot be read")
        else:
            unknown_since = None
        reason = slurm_job_fields(job_id).get("Reason", "None") if state == "PENDING" else "None"
        shown = state if reason == "None" else f"{state} ({reason})"
        if shown != last:
            log(f"Slurm job {job_id}: {shown}")
            last = shown
        if state in SLURM_DONE | SLURM_FAILED:
            return state
        time.sleep(poll_s)
