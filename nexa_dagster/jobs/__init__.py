"""Asset jobs and the nightly schedule.

Dagster runs one partitions definition per job, so the lifecycle is three jobs that hand over to each other:
``daily_data_job`` (ingest -> teacher -> judge, one day), ``training_job`` (packaging + training of the
snapshot) and ``evaluation_job`` (evaluation + serving of one checkpoint). The nightly schedule starts the first;
sensors start the other two (see ``nexa_dagster.sensors``).
"""

from __future__ import annotations

import dagster as dg

from nexa_dagster.assets.partitions import checkpoint_partitions, daily_partitions
from nexa_dagster.core.config import load_pipeline_config

DATA_ASSETS = ["raw_documents", "teacher_samples", "filtered_samples", "rejected_samples"]
TRAINING_ASSETS = ["sft_dataset", "moe_checkpoint"]
EVALUATION_ASSETS = ["eval_report", "model_deployment"]

daily_data_job = dg.define_asset_job(
    "daily_data_job", selection=dg.AssetSelection.assets(*DATA_ASSETS), partitions_def=daily_partitions,
    description="Ingest, distill and judge one day's documents.",
)
training_job = dg.define_asset_job(
    "training_job", selection=dg.AssetSelection.assets(*TRAINING_ASSETS),
    description="Package every filtered sample so far and train a new MoE checkpoint on it.",
)
evaluation_job = dg.define_asset_job(
    "evaluation_job", selection=dg.AssetSelection.assets(*EVALUATION_ASSETS), partitions_def=checkpoint_partitions,
    description="Evaluate one checkpoint and smoke-test serving it.",
)

nightly_data_schedule = dg.build_schedule_from_partitioned_job(
    daily_data_job,
    hour_of_day=int(load_pipeline_config()["schedule"]["nightly_retrain_hour_utc"]),
    name="nightly_retrain",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Every night: process yesterday's documents; the retrain sensor then trains on the new snapshot.",
)

JOBS = [daily_data_job, training_job, evaluation_job]
SCHEDULES = [nightly_data_schedule]
