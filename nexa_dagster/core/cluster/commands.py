"""The command lines a cluster runs: the training worker, the evaluation worker, a packaging shard task.

A worker is the same everywhere: ``python -m nexa_dagster.core.training.worker --job JOB --log-dir DIR`` (under
``torch.distributed.run`` when there is more than one rank), ``python -m nexa_dagster.core.evaluation.worker --job
JOB`` (one process) and ``python -m nexa_dagster.core.cluster.shard_task --plan TASKS`` (one shard, its index from
the cluster's environment); every backend runs them through the same builders.
"""

from __future__ import annotations

from collections.abc import Sequence

WORKER_MODULE = "nexa_dagster.core.training.worker"
EVALUATION_MODULE = "nexa_dagster.core.evaluation.worker"
SHARD_TASK_MODULE = "nexa_dagster.core.cluster.shard_task"
RENDEZVOUS_PORT = 29500
SLURM_RENDEZVOUS = (
    f"$HEAD_NODE:{RENDEZVOUS_PORT}"  # the first node of the allocation (set by the batch script)
)


def worker_argv(
    python: str, job_file: str, log_dir: str, procs_per_node: int, nodes: int = 1, rendezvous: str = ""
) -> list[str]:
    """The training worker's command; several ranks (per node or nodes) go through ``torch.distributed.run``.

    ``rendezvous`` is ``host:port`` of the first node for multi-node runs (``--standalone`` otherwise).
    """
    args = ["--job", job_file, "--log-dir", log_dir]
    return module_argv(python, WORKER_MODULE, args, procs_per_node, nodes, rendezvous, launcher_logs=log_dir)


def evaluation_argv(python: str, job_file: str) -> list[str]:
    """The evaluation worker's command: one process (it loads one model at a time on one device)."""
    return module_argv(python, EVALUATION_MODULE, ["--job", job_file], 1)


def module_argv(
    python: str,
    module: str,
    args: Sequence[str],
    procs_per_node: int,
    nodes: int = 1,
    rendezvous: str = "",
    launcher_logs: str = "",
) -> list[str]:
    """``python -m module args``, under ``torch.distributed.run`` for more than one rank.

    ``launcher_logs``: the folder ``torch.distributed.run`` keeps its per-attempt files in (its ``--log-dir``; a
    ``torchrun`` subfolder of it): the worker's own log folder, where a person looks, rather than a ``torchelastic_*``
    folder left in the machine's temporary directory by every launch."""
    worker = ["-m", module, *args]
    if procs_per_node == 1 and nodes == 1:
        return [python, *worker]
    launcher = [python, "-m", "torch.distributed.run", f"--nproc_per_node={procs_per_node}"]
    if launcher_logs:
        launcher.append(f"--log-dir={launcher_logs}/torchrun")
    if nodes == 1:
        launcher.append("--standalone")
    else:
        launcher += [
            f"--nnodes={nodes}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={rendezvous}",
            "--rdzv_id=$SLURM_JOB_ID",
        ]
    return [*launcher, *worker]


def shard_task_argv(python: str, plan_file: str) -> list[str]:
    """The element's command; its index comes from the environment the cluster sets."""
    return [python, "-m", SHARD_TASK_MODULE, "--plan", plan_file]
