"""Shard runners that leave this machine: a Slurm job array, a Kubernetes indexed Job.

``shards.run_shards(..., runner=...)`` hands them the shards that lack a valid receipt; each runner writes the task
file (``core/cluster/shard_task.py``), submits one element per task, waits for all of them, then reads every task's
receipt. A task without a valid receipt fails the whole run with one error naming each such shard (its number, file
and lines), the element's state and where its output is, so that the step fails on what went wrong and a retry
redoes only those shards (the others' receipts are valid).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nexa_dagster.core.cluster import packaging_launch
from nexa_dagster.core.cluster.shard_task import Work, describe, plan_id, write_task_file
from nexa_dagster.core.cluster.slurm_jobs import job_states
from nexa_dagster.core.packaging import shards as sh

OUTPUT_TAIL_CHARS = 2000
TASK_ENV = {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}  # log lines at once; one shard, one thread


class ShardTasksFailed(RuntimeError):
    """Some shards did not finish on the cluster; the message names each one and where its output is."""

    def __init__(self, message: str, shard_ids: Sequence[str]) -> None:
        super().__init__(message)
        self.shard_ids = list(shard_ids)


def collect_receipts(tasks: Sequence[sh.ShardTask], where: Callable[[int], str], engine: str) -> list[sh.Receipt]:
    """Every task's valid receipt in task order, or ``ShardTasksFailed`` naming each task without one.

    ``where(i)`` says what ran task ``i`` and where its output is (an element's state and log file).
    """
    receipts: list[sh.Receipt] = []
    failed: list[tuple[str, str]] = []
    for i, task in enumerate(tasks):
        receipt, why = sh.check_receipt(task.root, task.out_id, task.key)
        if receipt is None:
            failed.append((task.shard.shard_id, f"{describe(task)}: {why}; {where(i)}"))
        else:
            receipts.append(receipt)
    if failed:
        raise ShardTasksFailed(f"{len(failed)} of {len(tasks)} shards did not finish on {engine}:\n"
                               + "\n".join(m for _, m in failed), [s for s, _ in failed])
    return receipts


def _tail(path: Path) -> str:
    if not path.exists():
        return "(no output file)"
    text = path.read_text(encoding="utf-8", errors="replace").rstrip()
    return text[-OUTPUT_TAIL_CHARS:] or "(empty)"


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

    def __call__(self, tasks: Sequence[sh.ShardTask], work: Work, log: Callable[[str], None]) -> list[sh.Receipt]:
        if "://" in self.work_dir:
            raise ValueError(f"packaging on Slurm writes its task files and logs to a shared filesystem path, not "
                             f"{self.work_dir} (put the data root on a filesystem every node mounts)")
        folder = Path(self.work_dir) / plan_id(tasks)
        folder.mkdir(parents=True, exist_ok=True)
        plan = write_task_file(tasks, work, str(folder / "tasks.json"))
        script = folder / "shards.sbatch"
        script.write_text(self.script(plan, str(folder), len(tasks)), encoding="utf-8")
        log(f"submitting a Slurm job array of {len(tasks)} shards"
            f"{f', at most {self.max_parallel} at once' if self.max_parallel else ''} ({script})")
        job_id = self.submit_and_wait(script)
        states = job_states(job_id)

        def where(i: int) -> str:
            out = Path(packaging_launch.array_output(str(folder), job_id, i))
            return (f"array element {job_id}_{i} ended {states.get(str(i), 'UNKNOWN')}, output {out} ends "
                    f"with:\n{_tail(out)}")

        return collect_receipts(tasks, where, f"Slurm (job array {job_id})")

    def script(self, plan: str, log_dir: str, count: int) -> str:
        env = {**TASK_ENV, **self.env}
        return packaging_launch.sbatch_array_script(
            name=f"nexa-shards-{Path(log_dir).name}", python=self.python, plan_file=plan, log_dir=log_dir,
            count=count, max_parallel=self.max_parallel, env=env, partition=self.partition, account=self.account,
            time_limit=self.time_limit, cpus_per_task=self.cpus_per_task, extra_directives=self.extra_directives,
            setup_commands=self.setup_commands)


@dataclass
class KubernetesIndexedJobRunner:
    """Runs shards as one Kubernetes Job in ``Indexed`` completion mode (a pod per index, ``parallelism`` at once).

    The task file goes to ``work_dir``, which must be on the data volume (``data_pvc``, mounted at the same path in
    the pods as in the Dagster step). Needs the ``kubernetes`` client and a cluster (in-cluster or kubeconfig); the
    Job is deleted if the wait is interrupted. Only its spec is tested here (there is no cluster on the CI machine).
    """

    work_dir: str
    image: str
    namespace: str = "default"
    env: Mapping[str, str] = field(default_factory=dict)
    parallelism: int = 0
    data_pvc: str = ""
    data_mount: str = "/data"
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: Sequence[Mapping[str, Any]] = ()
    cpu: str = "1"
    memory: str = "4Gi"
    service_account: str = ""
    poll_interval_s: float = 5.0

    def job_spec(self, plan: str, name: str, count: int) -> dict[str, Any]:
        env = {**TASK_ENV, **self.env}
        return packaging_launch.k8s_indexed_job(
            name=name, image=self.image, plan_file=plan, count=count, parallelism=self.parallelism,
            namespace=self.namespace, env=env, data_pvc=self.data_pvc, data_mount=self.data_mount,
            node_selector=self.node_selector, tolerations=self.tolerations, cpu=self.cpu, memory=self.memory,
            service_account=self.service_account)

    def __call__(self, tasks: Sequence[sh.ShardTask], work: Work, log: Callable[[str], None]) -> list[sh.Receipt]:
        try:
            from kubernetes import client, config
        except ImportError:
            raise RuntimeError("packaging on Kubernetes needs the kubernetes package (pip install kubernetes, "
                               "which dagster-k8s brings)") from None
        if not self.image:
            raise ValueError("packaging on Kubernetes needs an image with nexa-dagster installed")
        pid = plan_id(tasks)
        folder = Path(self.work_dir) / pid
        folder.mkdir(parents=True, exist_ok=True)
        plan = write_task_file(tasks, work, str(folder / "tasks.json"))
        name = f"nexa-shards-{pid}-{int(time.time())}"  # a retry's Job is a new one (the last stays an hour)
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        batch = client.BatchV1Api()
        batch.create_namespaced_job(self.namespace, self.job_spec(plan, name, len(tasks)))
        log(f"created Kubernetes indexed Job {self.namespace}/{name}: {len(tasks)} shards")
        try:
            while True:
                status = batch.read_namespaced_job_status(name, self.namespace).status
                finished = {c.type for c in status.conditions or [] if c.status == "True"} & {"Complete", "Failed"}
                if finished:
                    break
                time.sleep(self.poll_interval_s)
        except BaseException:
            batch.delete_namespaced_job(name, self.namespace, propagation_policy="Foreground")
            log(f"deleted Kubernetes Job {self.namespace}/{name}")
            raise
        failed_indexes = status.failed_indexes or ""

        def where(i: int) -> str:
            return (f"Job {self.namespace}/{name} index {i} (failed indexes: {failed_indexes or 'none'}); its pod's "
                    f"log: kubectl logs -n {self.namespace} -l batch.kubernetes.io/job-completion-index={i},"
                    f"job-name={name}")

        return collect_receipts(tasks, where, f"Kubernetes (Job {self.namespace}/{name})")
