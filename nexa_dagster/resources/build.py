"""Every resource of the code location, built from ``configs/pipeline.yaml`` and the environment: one per outside
thing (``build_resources``) and one per configuration file or section (``config_resources``).

Apart from ``definitions.py`` so that a command that needs the resources and not the code location (``nexa-dagster
status``, ``rollback``, ``serve``, ``tiny-models``) does not import every asset module and build the definitions:
``nexa-dagster status`` 3.4-3.6 -> 2.6-2.9 CPU-s on the idle 2-core Xeon, and not the 8.4 it took after any edit of
the package (the definitions derive the assets' code versions again when their inputs changed).
"""

from __future__ import annotations

from typing import Any

from nexa_dagster import settings
from nexa_dagster.core.common.config import config_dir, pipeline_config
from nexa_dagster.resources.configs import (
    EvalSetsResource,
    IngestResource,
    PackagingResource,
    PromotionResource,
    PromptsResource,
    SampleGateResource,
    from_section,
)
from nexa_dagster.resources.gpu_cluster import GPUClusterResource, gpu_cluster_from_settings
from nexa_dagster.resources.gpu_cluster.local import LocalGPUCluster
from nexa_dagster.resources.io_manager import NexaIOManager
from nexa_dagster.resources.llm import llm_resource
from nexa_dagster.resources.scale import ScaleResource
from nexa_dagster.resources.storage import StorageResource
from nexa_dagster.resources.tracking import TrackingResource


def gpu_cluster_resource(
    section: dict[str, Any], where: str, warm_workers: bool = False
) -> GPUClusterResource:
    """``gpu_cluster`` of pipeline.yaml as its backend's typed class; ``NEXA_CLUSTER_BACKEND`` and
    ``NEXA_ACCELERATOR`` override the file's ``backend`` and ``accelerator``. An unknown backend, an unknown key or
    a field of another backend fails the load naming the file and the key. ``warm_workers``: the local backend
    forks its workers from a warm Python (``LocalGPUCluster.warm_start``) unless the file says otherwise."""
    overrides = {
        key: v.get()
        for key, v in (("backend", settings.CLUSTER_BACKEND), ("accelerator", settings.ACCELERATOR))
        if v.is_set()
    }
    fields = {**section, **overrides}
    if warm_workers and fields.get("backend", LocalGPUCluster.backend) == LocalGPUCluster.backend:
        fields.setdefault("warm_start", True)  # the file's own value wins
    return gpu_cluster_from_settings(
        fields, where, backend_from=settings.CLUSTER_BACKEND.name if "backend" in overrides else ""
    )


def config_resources() -> dict[str, Any]:
    """The resources that are configuration files (shown, and changeable per run, in the Launchpad)."""
    cfg, where = pipeline_config(), config_dir() / "pipeline.yaml"
    ingest_section = {
        k: v for k, v in cfg.ingest.items() if k != "landing_root"
    }  # the landing root is storage's
    return {
        "scale_preset": ScaleResource.from_env(),  # the Launchpad's default: NEXA_SCALE
        "ingest_config": from_section(IngestResource, ingest_section, f"{where}: ingest"),
        "eval_sets": from_section(EvalSetsResource, cfg.eval_set, f"{where}: eval_set"),
        "promotion_policy": PromotionResource(),
        "packaging_config": PackagingResource(),
        "sample_gate_config": SampleGateResource(),
        "prompts": PromptsResource(),
    }


def build_resources(warm_workers: bool = False) -> dict[str, Any]:
    """Every resource, from configs/pipeline.yaml under the environment's overrides (``warm_workers``:
    ``gpu_cluster_resource``)."""
    cfg, where = pipeline_config(), config_dir() / "pipeline.yaml"
    landing_root = cfg.ingest.get("landing_root", "sample_data/landing")
    storage = StorageResource(
        data_root=settings.DATA_ROOT.get() or cfg.data_root,
        landing_root=settings.LANDING_ROOT.get() or landing_root,
        results_root=settings.RESULTS_ROOT.get(),
        student_tokenizer=cfg.models.student_tokenizer,
    )
    return {
        "io_manager": NexaIOManager(data_root=storage.data_root, results_root=storage.results_root),
        "storage": storage,
        "teacher_llm": llm_resource(
            "teacher", cfg.teacher_llm, f"{where}: teacher_llm", storage.model_path(cfg.models.teacher)
        ),
        "judge_llm": llm_resource(
            "judge", cfg.judge_llm, f"{where}: judge_llm", storage.model_path(cfg.models.judge)
        ),
        # no model of its own: the production checkpoint when preference_pairs runs (LLMResource.for_model)
        "policy_llm": llm_resource("policy", cfg.policy_llm, f"{where}: policy_llm", ""),
        "gpu_cluster": gpu_cluster_resource(cfg.gpu_cluster, f"{where}: gpu_cluster", warm_workers),
        "tracking": TrackingResource(
            tracking_uri=settings.MLFLOW_TRACKING_URI.get(), data_root=storage.data_root
        ),
        **config_resources(),
    }


def local_model_dirs(resources: dict[str, Any]) -> list[str]:
    """Every local model directory the configuration names: the student tokenizer, and the teacher's and judge's
    model where their backend loads one (``nexa-dagster tiny-models`` installs the tiny ones there)."""
    storage = resources["storage"]
    dirs = [storage.model_path(storage.student_tokenizer)]
    return dirs + [m for role in ("teacher_llm", "judge_llm") if (m := getattr(resources[role], "model", ""))]
