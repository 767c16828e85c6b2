"""What the GPU-cluster resource submits: the worker's command line, a Slurm batch script, a Kubernetes pod spec.

Plain functions of plain values, so what a cluster will run can be read (and tested) without a cluster. A worker
is the same everywhere: ``python -m nexa_dagster.core.training.worker --job JOB --log-dir DIR`` (under
``torch.distributed.run`` when there is more than one rank) or ``python -m nexa_dagster.core.evaluation.worker
--job JOB`` (one process); every backend runs either through the same script and pod builders below.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import Any

WORKER_MODULE = "nexa_dagster.core.training.worker"
EVALUATION_MODULE = "nexa_dagster.core.evaluation.worker"
RENDEZVOUS_PORT = 29500
SLURM_RENDEZVOUS = f"$HEAD_NODE:{RENDEZVOUS_PORT}"  # the first node of the allocation (set by the batch script)


def worker_argv(python: str, job_file: str, log_dir: str, procs_per_node: int, nodes: int = 1,
                rendezvous: str = "") -> list[str]:
    """The training worker's command; several ranks (per node or nodes) go through ``torch.distributed.run``.

    ``rendezvous`` is ``host:port`` of the first node for multi-node runs (``--standalone`` otherwise).
    """
    return module_argv(python, WORKER_MODULE, ["--job", job_file, "--log-dir", log_dir], procs_per_node, nodes,
                       rendezvous)


def evaluation_argv(python: str, job_file: str) -> list[str]:
    """The evaluation worker's command: one process (it loads one model at a time on one device)."""
    return module_argv(python, EVALUATION_MODULE, ["--job", job_file], 1)


def module_argv(python: str, module: str, args: Sequence[str], procs_per_node: int, nodes: int = 1,
                rendezvous: str = "") -> list[str]:
    """``python -m module args``, under ``torch.distributed.run`` for more than one rank."""
    worker = ["-m", module, *args]
    if procs_per_node == 1 and nodes == 1:
        return [python, *worker]
    launcher = [python, "-m", "torch.distributed.run", f"--nproc_per_node={procs_per_node}"]
    if nodes == 1:
        launcher.append("--standalone")
    else:
        launcher += [f"--nnodes={nodes}", "--rdzv_backend=c10d", f"--rdzv_endpoint={rendezvous}",
                     "--rdzv_id=$SLURM_JOB_ID"]
    return [*launcher, *worker]


def sbatch_script(*, job_name: str, command: Sequence[str], log_dir: str, procs_per_node: int, nodes: int,
                  gpus: bool, env: Mapping[str, str], partition: str = "", account: str = "",
                  time_limit: str = "24:00:00", stop_warning_s: int = 120, cpus_per_task: int = 8,
                  extra_directives: Sequence[str] = (), setup_commands: Sequence[str] = ()) -> str:
    """A complete ``sbatch`` script running ``command`` (``module_argv``'s, with ``SLURM_RENDEZVOUS`` for several
    nodes): one task per node, ``torchrun`` inside it starts the node's ranks; its output goes to
    ``log_dir/slurm-<job id>.out``.

    ``--kill-on-bad-exit`` ends every node when one rank fails. ``--signal=TERM@<stop_warning_s>`` (no ``B:``:
    Slurm signals the job step's tasks, i.e. ``torchrun`` or the worker, not the batch shell) reaches the worker
    before the time limit; ``torchrun`` forwards SIGTERM to its ranks, which finish the step, save their resumable
    state and exit, so the relaunch resumes there. The environment (Dagster Pipes' bootstrap variables among them) is
    exported by the script itself, so nothing depends on what the submitting shell had.
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
    lines += ['HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)', "export HEAD_NODE",
              f"srun --kill-on-bad-exit=1 {quoted}", ""]
    return "\n".join(lines)


def k8s_pod_spec(*, image: str, command: Sequence[str], gpus_per_pod: int, container_name: str = "trainer",
                 data_pvc: str = "", data_mount: str = "/data", node_selector: Mapping[str, str] | None = None,
                 tolerations: Sequence[Mapping[str, Any]] = (), cpu: str = "8", memory: str = "64Gi",
                 service_account: str = "") -> dict[str, Any]:
    """The pod spec handed to Dagster's ``PipesK8sClient`` (as ``base_pod_spec``): one pod running ``command``
    with ``gpus_per_pod`` GPUs (0: none; a training asks for all of a node's, an evaluation for one).

    The job file and the data must be on the mounted volume (``data_pvc`` at ``data_mount``); ``/dev/shm`` is a
    memory volume because NCCL and the data loader need more shared memory than a container's default 64 MB.
    """
    limits: dict[str, str] = {"cpu": cpu, "memory": memory}
    if gpus_per_pod:
        limits["nvidia.com/gpu"] = str(gpus_per_pod)
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if data_pvc:
        volumes.append({"name": "data", "persistentVolumeClaim": {"claimName": data_pvc}})
        mounts.append({"name": "data", "mountPath": data_mount})
    container = {
        "name": container_name,
        "image": image,
        "command": list(command),
        "resources": {"limits": limits, "requests": dict(limits)},
        "volumeMounts": mounts,
    }
    spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container], "volumes": volumes}
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    if tolerations:
        spec["tolerations"] = [dict(t) for t in tolerations]
    if service_account:
        spec["serviceAccountName"] = service_account
    return spec
