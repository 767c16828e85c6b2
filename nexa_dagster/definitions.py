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
from nexa_dagster.core.common.config import pipeline_config
from nexa_dagster.jobs import JOBS, nightly_schedule
from nexa_dagster.resources.build import build_resources, config_resources
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
