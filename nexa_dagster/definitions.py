"""The nexa-dagster code location: every stage of the Nexa LLM lifecycle as a software-defined asset.

Resources are built from environment variables so that the same location runs the tiny demo on a laptop and a
real model on a cluster without code changes:

* ``NEXA_TEACHER_BACKEND`` / ``NEXA_JUDGE_BACKEND``: ``local`` (in-process transformers, the default),
  ``managed`` (start ``vllm serve`` / ``transformers serve`` for the step) or ``openai`` (any OpenAI-compatible
  URL in ``NEXA_TEACHER_URL`` / ``NEXA_JUDGE_URL``, key read through ``dagster.EnvVar`` from
  ``NEXA_TEACHER_API_KEY`` / ``NEXA_JUDGE_API_KEY``), over pipeline.yaml's ``teacher_llm`` / ``judge_llm``; one
  resource class per backend (``resources/llm.py``), so a wrong backend or another backend's field fails the load.
* ``NEXA_TEACHER_MODEL`` / ``NEXA_JUDGE_MODEL``: a local model path or a served model name.
* ``NEXA_DATA_ROOT``, ``NEXA_LANDING_ROOT``, ``NEXA_RESULTS_ROOT``, ``MLFLOW_TRACKING_URI``.
* ``NEXA_SCALE``: the default of the ``scale_preset`` resource, which a run's config may change (the Launchpad).
"""

from __future__ import annotations

import os

import dagster as dg

from nexa_dagster.assets import (
    base_evaluation,
    distillation,
    evaluation,
    evaluation_set,
    filtering,
    ingest,
    packaging,
    pretraining,
    serving,
    training,
)
from nexa_dagster.config_check import check_configs
from nexa_dagster.core.common.config import config_dir, load_pipeline_config
from nexa_dagster.jobs import JOBS, SCHEDULES
from nexa_dagster.resources.gpu_cluster import GPUClusterResource, gpu_cluster_from_settings
from nexa_dagster.resources.io_manager import NexaIOManager
from nexa_dagster.resources.llm import llm_resource
from nexa_dagster.resources.scale import ScaleResource
from nexa_dagster.resources.storage import StorageResource
from nexa_dagster.resources.tracking import TrackingResource
from nexa_dagster.sensors import SENSORS


def gpu_cluster_resource(settings: dict[str, object]) -> GPUClusterResource:
    """``gpu_cluster`` of pipeline.yaml as its backend's typed class; ``NEXA_CLUSTER_BACKEND`` and
    ``NEXA_ACCELERATOR`` override the file's ``backend`` and ``accelerator``. An unknown backend, an unknown key or
    a field of another backend fails the load naming the file and the key."""
    overrides = {key: os.environ[env] for key, env in (("backend", "NEXA_CLUSTER_BACKEND"),
                                                      ("accelerator", "NEXA_ACCELERATOR")) if os.environ.get(env)}
    return gpu_cluster_from_settings({**settings, **overrides}, f"{config_dir() / 'pipeline.yaml'}: gpu_cluster",
                                     backend_from="NEXA_CLUSTER_BACKEND" if "backend" in overrides else "")


def build_resources() -> dict[str, object]:
    """Resources from configs/pipeline.yaml, overridden by environment variables."""
    cfg, pipeline_yaml = load_pipeline_config(), config_dir() / "pipeline.yaml"
    data_root = os.environ.get("NEXA_DATA_ROOT", cfg["data_root"])
    storage = StorageResource(data_root=data_root,
                              landing_root=os.environ.get("NEXA_LANDING_ROOT", cfg["ingest"]["landing_root"]),
                              results_root=os.environ.get("NEXA_RESULTS_ROOT", "results"))
    return {
        "io_manager": NexaIOManager(data_root=data_root),
        "storage": storage,
        "teacher_llm": llm_resource("teacher", cfg["teacher_llm"], f"{pipeline_yaml}: teacher_llm",
                                    storage.model_path(cfg["models"]["teacher"])),
        "judge_llm": llm_resource("judge", cfg["judge_llm"], f"{pipeline_yaml}: judge_llm",
                                  storage.model_path(cfg["models"]["judge"])),
        "gpu_cluster": gpu_cluster_resource(cfg["gpu_cluster"]),
        "tracking": TrackingResource(tracking_uri=os.environ.get("MLFLOW_TRACKING_URI", ""), data_root=data_root),
        "scale_preset": ScaleResource.from_env(),  # the Launchpad's default: NEXA_SCALE
    }


ASSET_MODULES = [ingest, distillation, filtering, packaging, pretraining, evaluation_set, training, evaluation,
                 base_evaluation, serving]

def build_defs() -> dg.Definitions:
    """The code location; tests call this after pointing the environment at a temporary data root.

    Every file under ``configs/`` is checked first: a bad key fails the load (``make validate``, the UI) naming
    the file and the key, not a run hours later.
    """
    check_configs(extra=[build_resources])
    return dg.Definitions(
        assets=dg.load_assets_from_modules(ASSET_MODULES),
        asset_checks=dg.load_asset_checks_from_modules(ASSET_MODULES),
        jobs=JOBS,
        schedules=SCHEDULES,
        sensors=SENSORS,
        resources=build_resources(),
    )


defs = build_defs()
