"""The Kubernetes backend: one pod per worker through Dagster's ``PipesK8sClient`` (package ``dagster-k8s``).

The job file, the data and the run's work directory are on a volume the Dagster run pod and the worker pod both
mount (``k8s_data_pvc`` at ``k8s_data_mount``); ``PipesK8sClient`` streams the pod's Pipes messages and deletes the
pod when the Dagster run is cancelled.
"""

from __future__ import annotations

from typing import Any

import dagster as dg
from pydantic import Field

from nexa_dagster.core.cluster.kubernetes import KubernetesIndexedJobRunner, k8s_pod_spec
from nexa_dagster.resources.gpu_cluster.base import GPUClusterResource, WorkerLaunch


class KubernetesGPUCluster(GPUClusterResource):
    """Runs the worker in a pod: a training with all ``num_procs`` GPUs of a node, an evaluation with one."""

    backend = "kubernetes"
    imports_checked_here = False  # the worker runs the image's Python, not this host's

    k8s_image: str = Field(min_length=1, description="image with nexa-dagster installed")
    k8s_namespace: str = "default"
    k8s_data_pvc: str = Field(default="", description="PVC holding data/ and the run's work dir")
    k8s_data_mount: str = "/data"
    k8s_node_selector: dict[str, str] = Field(default_factory=dict)
    k8s_tolerations: list[dict[str, str]] = Field(default_factory=list)
    k8s_cpu: str = "8"
    k8s_memory: str = "64Gi"
    k8s_pod_wait_timeout_s: float = Field(
        default=0,
        ge=0,
        description="give up waiting for the worker pod after this long (0: wait as long as it "
        "runs; a hung training is ended by its stall watchdog)",
    )

    def shard_runner(
        self, context: dg.AssetExecutionContext, work_dir: str, max_parallel: int = 0
    ) -> KubernetesIndexedJobRunner:
        """Packaging shards as one indexed Job (``completionMode: Indexed``) in this cluster's namespace, with its
        image, data volume, node selector and tolerations; one CPU and 4 GiB per pod, no GPU."""
        return KubernetesIndexedJobRunner(
            work_dir,
            image=self.k8s_image,
            namespace=self.k8s_namespace,
            env=dict(self.env),
            parallelism=max_parallel,
            data_pvc=self.k8s_data_pvc,
            data_mount=self.k8s_data_mount,
            node_selector=self.k8s_node_selector,
            tolerations=self.k8s_tolerations,
        )

    def pod_spec(self, launch: WorkerLaunch) -> dict[str, Any]:
        procs = self.num_procs if launch.distributed else 1
        return k8s_pod_spec(
            image=self.k8s_image,
            command=launch.argv("python", procs),
            gpus_per_pod=procs if self.accelerator == "cuda" else 0,
            container_name="trainer" if launch.distributed else "evaluator",
            data_pvc=self.k8s_data_pvc,
            data_mount=self.k8s_data_mount,
            node_selector=self.k8s_node_selector,
            tolerations=self.k8s_tolerations,
            cpu=self.k8s_cpu,
            memory=self.k8s_memory,
        )

    def k8s_run_arguments(self, launch: WorkerLaunch) -> dict[str, Any]:
        """What ``PipesK8sClient.run`` gets besides the context. ``pod_wait_timeout`` is always passed: its
        default (86,400 s) would end every training longer than a day; 0 means no limit there."""
        spec = self.pod_spec(launch)
        return {
            "image": self.k8s_image,
            "namespace": self.k8s_namespace,
            "command": spec["containers"][0]["command"],
            "env": launch.env,
            "base_pod_spec": spec,
            "pod_wait_timeout": self.k8s_pod_wait_timeout_s,
        }

    def launch_worker(
        self, context: dg.AssetExecutionContext, launch: WorkerLaunch
    ) -> dg.PipesClientCompletedInvocation:
        try:
            from dagster_k8s import PipesK8sClient  # optional: only the kubernetes backend needs it
        except ImportError:
            raise dg.Failure(
                "backend 'kubernetes' needs the dagster-k8s package (pip install dagster-k8s)",
                allow_retries=False,
            ) from None
        return PipesK8sClient().run(context=context, **self.k8s_run_arguments(launch))
