"""Asset jobs and the nightly schedule.

Dagster runs one partitions definition per job, so the lifecycle is three jobs that hand over to each other:
``daily_data_job`` (ingest -> teacher -> judge, one day), ``training_job`` (packaging + training of the
snapshot) and ``evaluation_job`` (evaluation + serving of one checkpoint). The nightly schedule starts the first;
sensors start the other two (see ``nexa_dagster.sensors``). ``ingest_job`` re-ingests days alone (no teacher
calls), e.g. a backfill after a landing folder was corrected.
``stop_canary_job`` (``jobs/canary.py``) stops the serving service's running canary from the Launchpad.
"""

from __future__ import annotations

import datetime as dt

import dagster as dg

from nexa_dagster.assets.partitions import base_model_partitions, checkpoint_partitions, daily_partitions
from nexa_dagster.automation import schedule_default_status
from nexa_dagster.core.data.ingest import has_landed
from nexa_dagster.jobs.canary import stop_canary_job
from nexa_dagster.resources.storage import StorageResource

DATA_ASSETS = ["raw_documents", "teacher_samples", "filtered_samples", "rejected_samples"]
TRAINING_ASSETS = ["sft_dataset", "eval_set", "moe_checkpoint"]
EVALUATION_ASSETS = ["eval_report", "model_deployment"]

ingest_job = dg.define_asset_job(
    "ingest_job",
    selection=dg.AssetSelection.assets("raw_documents"),
    partitions_def=daily_partitions,
    description="Ingest one day's landing folder (re-ingest a day, or backfill many without teacher calls).",
)
# One process for the whole run: the day's steps are a chain (no parallelism to lose) and each spawned step paid a
# Python start and an import of the code location (docs/architecture.md, "Executors"); a backfill pays it per day
# and step.
# Training and evaluation keep the multiprocess default: a step that dies (OOM, a killed worker) fails alone and
# its memory goes back before the next step starts.
daily_data_job = dg.define_asset_job(
    "daily_data_job",
    selection=dg.AssetSelection.assets(*DATA_ASSETS),
    partitions_def=daily_partitions,
    description="Ingest, distill and judge one day's documents.",
    executor_def=dg.in_process_executor,
)
training_job = dg.define_asset_job(
    "training_job",
    selection=dg.AssetSelection.assets(*TRAINING_ASSETS),
    description="Package every filtered sample so far and train a new MoE checkpoint on it.",
)
corpus_job = dg.define_asset_job(
    "corpus_job",
    selection=dg.AssetSelection.assets("pretrain_corpus", "rl_prompts"),
    description="Data products for other trainers: the Megatron bin/idx pretraining corpus and the RL prompts JSONL.",
)
pretraining_job = dg.define_asset_job(
    "pretraining_job",
    # the eval set is frozen between the corpus (whose eval-side documents it holds) and the base model (which never
    # trains on what the eval set holds: core/packaging/decontaminate.py). With an RL stage the held-out RL prompts
    # are frozen there too (rl_training_job's rl_prompts and rl_eval_set, as make run does: nexa_dagster/demo.py);
    # they are not in this job because a scale with no RL stage has no rl_eval_set to freeze
    selection=dg.AssetSelection.assets("pretrain_corpus", "eval_set", "base_model"),
    description="Tokenize every ingested document into the bin/idx corpus and pretrain the base model on it "
    "(the model moe_checkpoint starts from with init_from: base).",
)
evaluation_job = dg.define_asset_job(
    "evaluation_job",
    selection=dg.AssetSelection.assets(*EVALUATION_ASSETS),
    partitions_def=checkpoint_partitions,
    description="Evaluate one checkpoint and smoke-test serving it.",
)


preference_pairs_job = dg.define_asset_job(
    "preference_pairs_job",
    selection=dg.AssetSelection.assets("preference_pairs"),
    partitions_def=daily_partitions,
    description="Answer one day's training prompts with the production model and judge them into preference pairs.",
    executor_def=dg.in_process_executor,
)
preference_training_job = dg.define_asset_job(
    "preference_training_job",
    selection=dg.AssetSelection.assets("preference_dataset", "preference_checkpoint"),
    description="Pack every day's preference pairs and train a DPO checkpoint from the production model on them "
    "(the checkpoint sensor then evaluates it like any checkpoint).",
)

rl_training_job = dg.define_asset_job(
    "rl_training_job",
    selection=dg.AssetSelection.assets("rl_prompts", "rl_eval_set", "rl_checkpoint"),
    description="Build the checkable RL prompts from every ingested document, freeze the held-out RL prompts (once "
    "per version) and train a GRPO checkpoint from the production model on them (evaluation_job then gates it "
    "on the held-out reward like any checkpoint).",
)


def nightly_schedule(hour_utc: int) -> dg.ScheduleDefinition:
    """The nightly run at ``hour_utc`` (pipeline.yaml's ``schedule.nightly_retrain_hour_utc``)."""

    @dg.schedule(
        cron_schedule=f"0 {hour_utc} * * *",
        execution_timezone="UTC",
        job=daily_data_job,
        name="nightly_retrain",
        default_status=schedule_default_status(),
        description="Every night: process the day that just ended; the retrain sensor then trains on the "
        "new snapshot and the checkpoint sensor evaluates the result.",
    )
    def nightly_data_schedule(
        context: dg.ScheduleEvaluationContext, storage: StorageResource
    ) -> dg.RunRequest | dg.SkipReason:
        # the daily partitions include today (end_offset=1, so a day's data can be processed early by hand); the
        # nightly run is for the day that has just ended, which is complete
        day = (context.scheduled_execution_time - dt.timedelta(days=1)).strftime("%Y-%m-%d")
        landing = storage.landing_dir(day)
        if not has_landed(landing):
            return dg.SkipReason(
                f"no documents landed for {day} in {landing}: nothing new to process or retrain on"
            )
        return dg.RunRequest(run_key=f"nightly-{day}", partition_key=day)

    return nightly_data_schedule


base_evaluation_job = dg.define_asset_job(
    "base_evaluation_job",
    selection=dg.AssetSelection.assets("base_model_eval"),
    partitions_def=base_model_partitions,
    description="Evaluate one base model on the frozen eval set's corpus documents (its partition: the base id).",
)

leaderboard_job = dg.define_asset_job(
    "leaderboard_job",
    selection=dg.AssetSelection.assets("leaderboard"),
    description="Rebuild the leaderboard of every evaluated checkpoint (also kept fresh by its automation "
    "condition while the daemon runs).",
)

JOBS = [
    preference_pairs_job,
    preference_training_job,
    rl_training_job,
    ingest_job,
    daily_data_job,
    training_job,
    corpus_job,
    pretraining_job,
    evaluation_job,
    base_evaluation_job,
    leaderboard_job,
    stop_canary_job,
]
