"""What a cluster runs for packaging shards: a Slurm job array script and a Kubernetes indexed Job.

Plain functions of plain values (like ``core/cluster/launch_specs.py`` for training), so what a cluster will run can
be read and tested without one. Each element runs one task of the task file written by ``core/cluster/shard_task.py``::

    python -m nexa_dagster.core.cluster.shard_task --plan <tasks.json>

and finds its index in ``SLURM_ARRAY_TASK_ID`` (Slurm) or ``JOB_COMPLETION_INDEX`` (Kubernetes ``Indexed`` mode).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import Any

SHARD_TASK_MODULE = "nexa_dagster.core.cluster.shard_task"


def shard_task_argv(python: str, plan_file: str) -> list[str]:
    """The element's command; its index comes from the environment the cluster sets."""
    return [python, "-m", SHARD_TASK_MODULE, "--plan", plan_file]


def array_output(log_dir: str, job_id: str = "%A", index: str | int = "%a") -> str:
    """An element's output file: ``slurm-<array job id>_<index>.out`` (the ``%A``/``%a`` patterns of sbatch)."""
    return f"{log_dir}/slurm-{job_id}_{index}.out"


def sbatch_array_script(*, name: str, python: str, plan_file: str, log_dir: str, count: int, max_parallel: int = 0,
                        env: Mapping[str, str], partition: str = "", account: str = "", time_limit: str = "4:00:00",
                        cpus_per_task: int = 1, extra_directives: Sequence[str] = (),
                        setup_commands: Sequence[str] = ()) -> str:
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
    directives = [f"--job-name={name}", f"--array={array}", "--ntasks=1", f"--cpus-per-task={cpus_per_task}",
                  f"--time={time_limit}", f"--output={array_output(log_dir)}"]
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


def k8s_indexed_job(*, name: str, image: str, plan_file: str, count: int, parallelism: int, namespace: str = "default",
                    env: Mapping[str, str] | None = None, data_pvc: str = "", data_mount: str = "/data",
                    node_selector: Mapping[str, str] | None = None, tolerations: Sequence[Mapping[str, Any]] = (),
                    cpu: str = "1", memory: str = "4Gi", service_account: str = "",
                    backoff_limit_per_index: int = 1) -> dict[str, Any]:
    """A ``batch/v1`` Job in ``Indexed`` completion mode: ``count`` pods, index ``0..count-1`` each, at most
    ``parallelism`` at once (0: all).

    The plan and the shard store must be on the mounted volume (``data_pvc`` at ``data_mount``, the path the
    Dagster step wrote them under). A failed pod is retried ``backoff_limit_per_index`` times for its own index
    (``backoffLimitPerIndex``, Kubernetes >= 1.29) without failing the others, so one bad shard is named by its
    index and the rest still finish; ``ttlSecondsAfterFinished`` leaves the Job an hour to be read.
    """
    if count < 1:
        raise ValueError(f"an indexed Job needs at least one completion, got count={count}")
    limits = {"cpu": cpu, "memory": memory}
    container: dict[str, Any] = {
        "name": "shard",
        "image": image,
        "command": shard_task_argv("python", plan_file),
        "env": [{"name": k, "value": v} for k, v in sorted((env or {}).items())],
        "resources": {"limits": dict(limits), "requests": dict(limits)},
    }
    pod: dict[str, Any] = {"restartPolicy": "Never", "containers": [container]}
    if data_pvc:
        pod["volumes"] = [{"name": "data", "persistentVolumeClaim": {"claimName": data_pvc}}]
        container["volumeMounts"] = [{"name": "data", "mountPath": data_mount}]
    if node_selector:
        pod["nodeSelector"] = dict(node_selector)
    if tolerations:
        pod["tolerations"] = [dict(t) for t in tolerations]
    if service_account:
        pod["serviceAccountName"] = service_account
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/name": "nexa-shards"}},
        "spec": {
            "completionMode": "Indexed",
            "completions": count,
            "parallelism": min(parallelism, count) if parallelism > 0 else count,
            "backoffLimitPerIndex": backoff_limit_per_index,
            "maxFailedIndexes": count,  # every index runs to its end: a bad shard does not stop the others
            "ttlSecondsAfterFinished": 3600,
            "template": {"metadata": {"labels": {"app.kubernetes.io/name": "nexa-shards"}}, "spec": pod},
        },
    }
