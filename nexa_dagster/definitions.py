"""The nexa-dagster code location: every stage of the Nexa LLM lifecycle as a software-defined asset.

``build_defs()`` checks every file under ``configs/`` (a bad key fails the load naming the file and the key), builds
one resource per outside thing and per configuration file from ``configs/pipeline.yaml`` and the environment
(``nexa_dagster/settings.py`` lists every variable), and returns the assets, checks, jobs, schedule and sensors.
Tests call it after pointing the environment at a temporary data root.
"""

from __future__ import annotations

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
from nexa_dagster.step_executor import step_executor

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
        executor=step_executor,  # step_executor.py: each step forked from a server that imported what it needs
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
