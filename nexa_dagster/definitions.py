"""The nexa-dagster code location: every stage of the Nexa LLM lifecycle as a software-defined asset.

``build_defs()`` checks every file under ``configs/`` (a bad key fails the load naming the file and the key), builds
one resource per outside thing and per configuration file from ``configs/pipeline.yaml`` and the environment
(``nexa_dagster/settings.py`` lists every variable), and returns the assets, checks, jobs, schedule and sensors.
Tests call it after pointing the environment at a temporary data root.
"""

from __future__ import annotations

from typing import Any

import dagster as dg

from nexa_dagster import settings
from nexa_dagster.assets import (
    base_evaluation,
    checks,
    distill,
    evaluation,
    evaluation_set,
    ingest,
    packaging,
    preference,
    pretraining,
    rl,
    serving,
    training,
)
from nexa_dagster.assets.columns import with_column_schemas
from nexa_dagster.assets.freshness import with_freshness
from nexa_dagster.assets.production import production_model_asset
from nexa_dagster.assets.versions import with_code_versions
from nexa_dagster.config_check import check_configs
from nexa_dagster.core.common import threads
from nexa_dagster.core.common.config import config_dir, pipeline_config
from nexa_dagster.jobs import JOBS, nightly_schedule
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
from nexa_dagster.sensors import SENSORS

ASSET_MODULES = [
    ingest,
    distill,
    packaging,
    pretraining,
    evaluation_set,
    training,
    preference,
    rl,
    evaluation,
    base_evaluation,
    serving,
]


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


# What every step imports before it computes, imported once per run by the forkserver instead: the code location
# (this module: ~1 s of CPU per step) and the instance's storage (SQLAlchemy and Dagster's SQLite or Postgres
# storage: ~0.5 s). The forkserver skips a module that will not import (dagster_postgres where it is not installed).
STEP_PRELOAD = [__name__, "dagster._core.storage.sqlite_storage", "dagster_postgres"]


def _forked_steps(config: dict[str, Any]) -> dict[str, Any]:
    """The multiprocess executor's configuration: steps forked from a forkserver that imported ``STEP_PRELOAD``,
    retries as the run asks. The modules are named: with ``forkserver: {}`` Dagster 1.13 preloads nothing but its
    executor (its "preload the job's module" default is never reached: an absent ``preload_modules`` reads as an
    empty list), and every step imported the code location again."""
    return {"start_method": {"forkserver": {"preload_modules": STEP_PRELOAD}}, "retries": config["retries"]}


# Every step in a process of its own (a step killed by the OOM killer or a lost node fails alone, and is retried
# alone), forked from a server that imported the code location once per run: Dagster's default `spawn` start
# imports it again for every step, about 3.5 s of CPU each on a 2-core host (docs/operations.md, "Step processes").
# A run may still turn its steps' retry policies off, as Dagster's own executor lets it (run config `execution:
# {config: {retries: {disabled: {}}}}`): the kill tests do, where each retry would be killed at the same point.
STEP_EXECUTOR = dg.multiprocess_executor.configured(
    _forked_steps,
    config_schema={
        "retries": dg.Field(
            dg.Selector({"enabled": {}, "disabled": {}}),
            default_value={"enabled": {}},
            description="`disabled`: a failed step is not retried, whatever its retry policy",
        )
    },
    name="multiprocess_forkserver",
)


def build_defs(warm_workers: bool = False) -> dg.Definitions:
    """The code location. Every file under ``configs/`` is checked first: a bad key fails the load (``make
    validate``, the UI) naming the file and the key, not a run hours later. ``warm_workers``: for a process that
    runs many jobs itself (``make run``), workers forked from a warm Python (``gpu_cluster_resource``)."""
    check_configs(extra=[build_resources])
    schedule = pipeline_config().schedule
    # production_model, an external asset (an AssetSpec: load_assets_from_modules collects only definitions, and
    # without it Dagster draws a nameless stub in the default group)
    loaded = [*dg.load_assets_from_modules(ASSET_MODULES), production_model_asset]
    # assets/versions.py: from the sources and configuration each asset reaches
    assets = with_code_versions(loaded, config_resources())
    assets = with_column_schemas(assets)  # assets/columns.py: from the pandera models
    return dg.Definitions(
        executor=STEP_EXECUTOR,
        assets=with_freshness(assets, schedule),  # assets/freshness.py
        asset_checks=dg.load_asset_checks_from_modules(
            [*ASSET_MODULES, checks]
        ),  # assets/checks.py: the rest
        jobs=JOBS,
        schedules=[nightly_schedule(schedule.nightly_retrain_hour_utc)],
        sensors=SENSORS,
        resources=build_resources(warm_workers),
    )


# Every Dagster process loads this module before it computes (the code server, a run, each step forked after it;
# `make run`): its share of the cores and sleeping idle threads, set before torch loads (settings.thread_policy)
threads.use(settings.thread_policy("step"))
defs = build_defs()
