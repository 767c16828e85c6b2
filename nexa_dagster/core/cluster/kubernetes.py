"""Kubernetes: the pod spec of a worker (handed to Dagster's ``PipesK8sClient``) and an indexed Job of packaging
shards. Plain functions of plain values (no Dagster); only the specs are tested here (no cluster on the CI machine).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nexa_dagster.core.cluster.commands import shard_task_argv
from nexa_dagster.core.cluster.shard_task import TASK_ENV, Work, collect_receipts, plan_id, write_task_file
from nexa_dagster.core.packaging import shards as sh


def k8s_pod_spec(
    *,
    image: str,
    command: Sequence[str],
    gpus_per_pod: int,
    container_name: str = "trainer",
    data_pvc: str = "",
    data_mount: str = "/data",
    node_selector: Mapping[str, str] | None = None,
    tolerations: Sequence[Mapping[str, Any]] = (),
    cpu: str = "8",
    memory: str = "64Gi",
    service_account: str = "",
) -> dict[str, Any]:
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
    return _placed(spec, node_selector, tolerations, service_account)


def _placed(
    pod: dict[str, Any],
    node_selector: Mapping[str, str] | None,
    tolerations: Sequence[Mapping[str, Any]],
    service_account: str,
) -> dict[str, Any]:
    """``pod`` with where it may run and as whom: the node selector, tolerations and service account given (none
    given: the cluster's defaults)."""
    if node_selector:
        pod["nodeSelector"] = dict(node_selector)
    if tolerations:
        pod["tolerations"] = [dict(t) for t in tolerations]
    if service_account:
        pod["serviceAccountName"] = service_account
    return pod


def k8s_indexed_job(
    *,
    name: str,
    image: str,
    plan_file: str,
    count: int,
    parallelism: int,
    namespace: str = "default",
    env: Mapping[str, str] | None = None,
    data_pvc: str = "",
    data_mount: str = "/data",
    node_selector: Mapping[str, str] | None = None,
    tolerations: Sequence[Mapping[str, Any]] = (),
    cpu: str = "1",
    memory: str = "4Gi",
    service_account: str = "",
    backoff_limit_per_index: int = 1,
) -> dict[str, Any]:
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
    _placed(pod, node_selector, tolerations, service_account)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "nexa-shards"},
        },
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
        return k8s_indexed_job(
            name=name,
            image=self.image,
            plan_file=plan,
            count=count,
            parallelism=self.parallelism,
            namespace=self.namespace,
            env=env,
            data_pvc=self.data_pvc,
            data_mount=self.data_mount,
            node_selector=self.node_selector,
            tolerations=self.tolerations,
            cpu=self.cpu,
            memory=self.memory,
            service_account=self.service_account,
        )

    def __call__(
        self, tasks: Sequence[sh.ShardTask], work: Work, log: Callable[[str], None]
    ) -> list[sh.Receipt]:
        try:  # optional (dagster-k8s brings it): only packaging on Kubernetes needs it
            from kubernetes import client, config
        except ImportError:
            raise RuntimeError(
                "packaging on Kubernetes needs the kubernetes package (pip install kubernetes, "
                "which dagster-k8s brings)"
            ) from None
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
                finished = {c.type for c in status.conditions or [] if c.status == "True"} & {
                    "Complete",
                    "Failed",
                }
                if finished:
                    break
                time.sleep(self.poll_interval_s)
        except BaseException:
            batch.delete_namespaced_job(name, self.namespace, propagation_policy="Foreground")
            log(f"deleted Kubernetes Job {self.namespace}/{name}")
            raise
        failed_indexes = status.failed_indexes or ""

        def where(i: int) -> str:
            return (
                f"Job {self.namespace}/{name} index {i} (failed indexes: {failed_indexes or 'none'}); its pod's "
                f"log: kubectl logs -n {self.namespace} -l batch.kubernetes.io/job-completion-index={i},"
                f"job-name={name}"
            )

        return collect_receipts(tasks, where, f"Kubernetes (Job {self.namespace}/{name})")
