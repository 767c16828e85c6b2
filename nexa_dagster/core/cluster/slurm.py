"""Slurm: batch scripts for a worker and for a job array of packaging shards, what Slurm says about a job, and the
one submit/poll/cancel path every Slurm job of the project goes through.

Plain functions of plain values (no Dagster), so what a cluster will run can be read and tested without one.
``scontrol show job -o <id>`` prints one line per array element (pending elements grouped on one line as
``ArrayTaskId=2-3%2``); a job is over only when no element is pending or running any more. Accounting (``sacct``)
answers the same where the cluster runs slurmdbd, after the controller has forgotten the job (``MinJobAge``).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nexa_dagster import settings
from nexa_dagster.core.cluster.commands import shard_task_argv
from nexa_dagster.core.cluster.shard_task import (
    TASK_ENV,
    Work,
    collect_receipts,
    output_tail,
    plan_id,
    write_task_file,
)
from nexa_dagster.core.packaging import shards as sh

SLURM_DONE = {"COMPLETED"}
SLURM_ACTIVE = {
    "PENDING",
    "RUNNING",
    "CONFIGURING",
    "COMPLETING",
    "SUSPENDED",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "RESIZING",
    "SIGNALING",
    "STAGE_OUT",
    "STOPPED",
    "RESV_DEL_HOLD",
}
SLURM_FAILED = {
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}
SLURM_UNKNOWN_GRACE_S = 120.0  # how long a job Slurm does not know is waited for (a controller restart)


class SlurmCommandFailed(RuntimeError):
    """``sbatch`` (or another Slurm command) refused: the message has its exit code and output."""


def sbatch_script(
    *,
    job_name: str,
    command: Sequence[str],
    log_dir: str,
    procs_per_node: int,
    nodes: int,
    gpus: bool,
    env: Mapping[str, str],
    partition: str = "",
    account: str = "",
    time_limit: str = "24:00:00",
    stop_warning_s: int = 120,
    cpus_per_task: int = 8,
    extra_directives: Sequence[str] = (),
    setup_commands: Sequence[str] = (),
) -> str:
    """A complete ``sbatch`` script running ``command`` (``module_argv``'s, with ``SLURM_RENDEZVOUS`` for several
    nodes): one task per node, ``torchrun`` inside it starts the node's ranks; its output goes to
    ``log_dir/slurm-<job id>.out``.

    ``--kill-on-bad-exit`` ends every node when one rank fails. ``--signal=TERM@<stop_warning_s>`` (no ``B:``:
    Slurm signals the job step's tasks, i.e. ``torchrun`` or the worker, not the batch shell) reaches the worker
    before the time limit; ``torchrun`` forwards SIGTERM to its ranks, which finish the step, save their resumable
    state and exit, so the relaunch resumes there. The job's environment is ``submit_and_wait``'s ``sbatch``'s,
    ``settings.environ()`` (no secret of the step process), under the variables the script exports (``env``:
    Dagster Pipes' bootstrap variables among them).
    """
    directives = [
        f"--job-name={job_name}",
        f"--nodes={nodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={cpus_per_task}",
        f"--time={time_limit}",
        f"--output={log_dir}/slurm-%j.out",
        f"--signal=TERM@{stop_warning_s}",
    ]
    if gpus:
        directives.append(f"--gpus-per-node={procs_per_node}")
    if partition:
        directives.append(f"--partition={partition}")
    if account:
        directives.append(f"--account={account}")
    directives += list(extra_directives)
    quoted = " ".join(a if a.startswith("--rdzv") else shlex.quote(a) for a in command)
    lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in directives), "set -euo pipefail", ""]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())]
    lines += list(setup_commands)
    lines += [
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export HEAD_NODE",
        f"srun --kill-on-bad-exit=1 {quoted}",
        "",
    ]
    return "\n".join(lines)


def array_output(log_dir: str, job_id: str = "%A", index: str | int = "%a") -> str:
    """An element's output file: ``slurm-<array job id>_<index>.out`` (the ``%A``/``%a`` patterns of sbatch)."""
    return f"{log_dir}/slurm-{job_id}_{index}.out"


def sbatch_array_script(
    *,
    name: str,
    python: str,
    plan_file: str,
    log_dir: str,
    count: int,
    max_parallel: int = 0,
    env: Mapping[str, str],
    partition: str = "",
    account: str = "",
    time_limit: str = "4:00:00",
    cpus_per_task: int = 1,
    extra_directives: Sequence[str] = (),
    setup_commands: Sequence[str] = (),
) -> str:
    """An ``sbatch`` script for a job array of ``count`` elements, at most ``max_parallel`` at once (0: no limit).

    One task per element, no GPU: tokenizing and packing is CPU work. The environment is exported by the script
    itself, so nothing depends on what the submitting shell had; the plan and the outputs must be on a filesystem
    (or an object store) every node reaches.
    """
    if count < 1:
        raise ValueError(f"a job array needs at least one element, got count={count}")
    if max_parallel < 0:
        raise ValueError(f"max_parallel must be >= 0 (0: no limit), got {max_parallel}")
    array = f"0-{count - 1}" + (f"%{max_parallel}" if max_parallel else "")
    directives = [
        f"--job-name={name}",
        f"--array={array}",
        "--ntasks=1",
        f"--cpus-per-task={cpus_per_task}",
        f"--time={time_limit}",
        f"--output={array_output(log_dir)}",
    ]
    if partition:
        directives.append(f"--partition={partition}")
    if account:
        directives.append(f"--account={account}")
    directives += list(extra_directives)
    lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in directives), "set -euo pipefail", ""]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())]
    lines += list(setup_commands)
    lines += [f"exec {shlex.join(shard_task_argv(python, plan_file))}", ""]
    return "\n".join(lines)


def scontrol_records(job_id: str) -> list[dict[str, str]]:
    """``scontrol show job -o``: one ``key -> value`` dict per line (one per array element, pending elements
    grouped); empty if the controller does not know the job."""
    proc = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, env=settings.environ()
    )
    if proc.returncode != 0:
        return []
    return [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in proc.stdout.splitlines()]


def job_states(job_id: str) -> dict[str, str]:
    """Element (``ArrayTaskId``; the job id for a plain job) -> state, from the controller, else from accounting;
    empty if neither knows the job."""
    states = {
        fields.get("ArrayTaskId", fields.get("JobId", job_id)): fields["JobState"]
        for fields in scontrol_records(job_id)
        if "JobState" in fields
    }
    if states:
        return states
    proc = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "JobID,State"],
        capture_output=True,
        text=True,
        env=settings.environ(),
    )
    for line in proc.stdout.splitlines() if proc.returncode == 0 else []:
        job, _, state = line.partition("|")
        if state:
            states[job.partition("_")[2] or job] = state.split()[0]  # "CANCELLED by 0" -> CANCELLED
    return states


def overall_state(states: dict[str, str]) -> str:
    """One state for the whole job: ``UNKNOWN`` if Slurm knows no element, an active state while any element is
    pending or running (``RUNNING`` first), else the first element's state that is not ``COMPLETED``, else
    ``COMPLETED``."""
    if not states:
        return "UNKNOWN"
    values = list(states.values())
    active = [s for s in values if s in SLURM_ACTIVE]
    if active:
        return "RUNNING" if "RUNNING" in active else active[0]
    return next((s for s in values if s not in SLURM_DONE), "COMPLETED")


def slurm_job_fields(job_id: str) -> dict[str, str]:
    """``scontrol show job`` as a dict (the controller keeps finished jobs for MinJobAge); empty if unknown."""
    return {key: value for fields in scontrol_records(job_id) for key, value in fields.items()}


def slurm_state(job_id: str) -> str:
    """The job's state from the controller, else from accounting (``sacct``, where the cluster runs slurmdbd); for a
    job array, one state for all its elements (``overall_state``: running while any element is)."""
    return overall_state(job_states(job_id))


def wait_for_slurm_job(
    job_id: str, poll_s: float, log: Callable[[str], None], unknown_grace_s: float = SLURM_UNKNOWN_GRACE_S
) -> str:
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
                raise RuntimeError(
                    f"Slurm job {job_id}: neither the controller (scontrol show job) nor accounting "
                    f"(sacct) has known it for {unknown_grace_s:.0f} s; its outcome cannot be read"
                )
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


def submit_and_wait(script: Path, poll_interval_s: float, log: Callable[[str], None]) -> tuple[str, str]:
    """Submit ``script`` (``sbatch --parsable``), log the job id, poll until it ends; return (job id, final state).

    If the caller stops while it waits (a cancelled run, an interrupt), the job is ``scancel``-ed before the
    exception goes on, so no Slurm job outlives the step that owns it.

    Slurm gives a job the environment of the ``sbatch`` that submitted it (``--export=ALL``, its default, said
    here so a cluster's ``SBATCH_EXPORT`` does not change it): ``sbatch`` runs with ``settings.environ()``, so the
    job holds no secret of this process (an LLM key, the database URL) and has what the worker needs (``PATH``,
    ``HOME``, the libraries' settings, ``SLURM_CONF``)."""
    proc = subprocess.run(
        ["sbatch", "--parsable", "--export=ALL", str(script)],
        capture_output=True,
        text=True,
        env=settings.environ(),
    )
    if proc.returncode != 0:
        raise SlurmCommandFailed(
            f"sbatch --parsable --export=ALL {script} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout}"
        )
    job_id = proc.stdout.split(";")[0].strip()
    log(f"submitted Slurm job {job_id} ({script})")
    try:
        state = wait_for_slurm_job(job_id, poll_interval_s, log)
    except BaseException:
        subprocess.run(["scancel", job_id], check=False, env=settings.environ())
        log(f"cancelled Slurm job {job_id}")
        raise
    return job_id, state


@dataclass
class SlurmArrayRunner:
    """Runs shards as the elements of one Slurm job array (``sbatch --array=0-(n-1)%max_parallel``).

    ``work_dir`` holds, per submission, the task file, the script and each element's output
    (``<work_dir>/<plan id>/slurm-<job>_<index>.out``); it, the shard store and the inputs must be on a
    filesystem every node shares. ``submit_and_wait(script)`` submits the script, waits until no element is
    pending or running and returns the job id, cancelling the array if the wait is interrupted (the Slurm
    backend's ``submit_and_wait``, the one path every Slurm job of the project goes through).
    """

    work_dir: str
    submit_and_wait: Callable[[Path], str]
    python: str = field(default_factory=lambda: sys.executable)
    env: Mapping[str, str] = field(default_factory=dict)
    max_parallel: int = 0
    partition: str = ""
    account: str = ""
    time_limit: str = "4:00:00"
    cpus_per_task: int = 1
    extra_directives: Sequence[str] = ()
    setup_commands: Sequence[str] = ()

    def __call__(
        self, tasks: Sequence[sh.ShardTask], work: Work, log: Callable[[str], None]
    ) -> list[sh.Receipt]:
        if "://" in self.work_dir:
            raise ValueError(
                f"packaging on Slurm writes its task files and logs to a shared filesystem path, not "
                f"{self.work_dir} (put the data root on a filesystem every node mounts)"
            )
        folder = Path(self.work_dir) / plan_id(tasks)
        folder.mkdir(parents=True, exist_ok=True)
        plan = write_task_file(tasks, work, str(folder / "tasks.json"))
        script = folder / "shards.sbatch"
        script.write_text(self.script(plan, str(folder), len(tasks)), encoding="utf-8")
        log(
            f"submitting a Slurm job array of {len(tasks)} shards"
            f"{f', at most {self.max_parallel} at once' if self.max_parallel else ''} ({script})"
        )
        job_id = self.submit_and_wait(script)
        states = job_states(job_id)

        def where(i: int) -> str:
            out = Path(array_output(str(folder), job_id, i))
            return (
                f"array element {job_id}_{i} ended {states.get(str(i), 'UNKNOWN')}, output {out} ends "
                f"with:\n{output_tail(out)}"
            )

        return collect_receipts(tasks, where, f"Slurm (job array {job_id})")

    def script(self, plan: str, log_dir: str, count: int) -> str:
        env = {**TASK_ENV, **self.env}
        return sbatch_array_script(
            name=f"nexa-shards-{Path(log_dir).name}",
            python=self.python,
            plan_file=plan,
            log_dir=log_dir,
            count=count,
            max_parallel=self.max_parallel,
            env=env,
            partition=self.partition,
            account=self.account,
            time_limit=self.time_limit,
            cpus_per_task=self.cpus_per_task,
            extra_directives=self.extra_directives,
            setup_commands=self.setup_commands,
        )
