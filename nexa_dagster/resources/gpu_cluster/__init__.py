"""The GPU-cluster resource: where training and evaluation run, launched and watched through Dagster Pipes.

One typed class per backend, each with only its own fields, under the abstract ``GPUClusterResource`` that
assets ask for (the shape of Dagster's ``project_ml`` example):

* ``LocalGPUCluster``: this machine's GPUs (or CPU ranks), a child process in a Dagster Pipes session;
* ``SlurmGPUCluster``: an ``sbatch`` script per worker, polled, ``scancel``-ed when the Dagster run is cancelled;
* ``KubernetesGPUCluster``: a pod per worker through Dagster's ``PipesK8sClient``.

``gpu_cluster_from_settings`` builds one from the ``gpu_cluster`` section of ``configs/pipeline.yaml``: its
``backend`` key picks the class, and an unknown backend or a field of another backend is a ``ConfigError`` when the
code location loads, naming the file and the key.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import ValidationError

from nexa_dagster.core.common.config import ConfigError, explain
from nexa_dagster.resources.gpu_cluster.base import (
    GPUClusterResource,
    WorkerFailed,
    WorkerLaunch,
    read_result,
    stderr_tail,
    worker_failure,
)
from nexa_dagster.resources.gpu_cluster.kubernetes import KubernetesGPUCluster
from nexa_dagster.resources.gpu_cluster.local import LocalGPUCluster
from nexa_dagster.resources.gpu_cluster.slurm import SlurmGPUCluster

BACKENDS: dict[str, type[GPUClusterResource]] = {
    cls.backend: cls for cls in (LocalGPUCluster, SlurmGPUCluster, KubernetesGPUCluster)
}

__all__ = [
    "BACKENDS",
    "GPUClusterResource",
    "KubernetesGPUCluster",
    "LocalGPUCluster",
    "SlurmGPUCluster",
    "WorkerFailed",
    "WorkerLaunch",
    "gpu_cluster_from_settings",
    "read_result",
    "stderr_tail",
    "worker_failure",
]


def gpu_cluster_from_settings(
    settings: Mapping[str, object], where: str = "gpu_cluster", backend_from: str = ""
) -> GPUClusterResource:
    """The backend class ``settings["backend"]`` names (default ``local``), built from the other keys.

    ``where`` prefixes every error (``<configs>/pipeline.yaml: gpu_cluster``); ``backend_from`` says where the
    backend came from when it is not the file (``NEXA_CLUSTER_BACKEND``). A misspelt ``acelerator: cuda`` or a
    ``slurm_partition`` under ``backend: local`` must fail here, not run on the CPU without a word."""
    fields = dict(settings)
    backend = str(fields.pop("backend", "local"))
    chosen = f"backend {backend!r}" + (f" (from {backend_from})" if backend_from else "")
    cls = BACKENDS.get(backend)
    if cls is None:
        raise ConfigError(
            f"{where}.backend: unknown backend {backend!r}"
            + (f" (from {backend_from})" if backend_from else "")
            + f"; one of: {', '.join(BACKENDS)}"
        )
    own = set(cls.model_fields)
    for key in fields:
        if key in own:
            continue
        owners = [name for name, other in BACKENDS.items() if key in other.model_fields]
        if owners:
            raise ConfigError(
                f"{where}.{key}: a field of the {' / '.join(owners)} backend, but the cluster is "
                f"{chosen}; remove it or set gpu_cluster.backend: {owners[0]}"
            )
        raise ConfigError(
            f"{where}.{key}: unknown key (a typo?); known keys for {chosen}: "
            f"{', '.join(sorted(['backend', *own]))}"
        )
    missing = [name for name, info in cls.model_fields.items() if info.is_required() and name not in fields]
    if missing:  # Dagster's resource init would report None as a wrong type
        raise ConfigError(f"{where}.{missing[0]}: missing (required by {chosen})")
    try:
        return cls(**fields)
    except ValidationError as e:
        raise ConfigError("\n".join(f"{where}.{problem}" for problem in explain(e, cls))) from None
