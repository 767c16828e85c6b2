"""A fresh instance's first training: no base model has been pretrained yet, so ``init_from: base`` (the presets'
default) trains from scratch. A few steps from random weights teach the tiny student nothing (its answer is empty),
so serving it used to fail its smoke test and leave a failed run. The candidate is evaluated, then held back at
deployment with the reason and what to do; the runs succeed and nothing is deployed.

Real runs on a fresh Dagster instance in a sandbox (``support.pipeline_runs``); the benchmarks are skipped (time).
"""

from __future__ import annotations

import json
from pathlib import Path

from support.pipeline_runs import configs_with, run_jobs
from support.sandbox import make_sandbox

DAY = "2026-11-20"


def test_a_fresh_instances_scratch_candidate_is_held_back_with_the_reason_not_a_failed_run(
    tmp_path: Path,
) -> None:
    configs = configs_with(tmp_path / "configs", {"scales/tiny.yaml": {"evaluation.benchmarks.tasks": []}})
    world = make_sandbox(tmp_path / "world", [DAY])
    results = run_jobs(
        world,
        f"daily_data_job:{DAY}",
        "training_job",
        "evaluation_job:@trained",
        NEXA_CONFIG_DIR=str(configs),
    )
    failed = [(r["job"], r["errors"][:2]) for r in results if not r["success"]]
    assert not failed, failed
    _, training, evaluation = results
    candidate = training["checkpoint_id"]
    assert training["parent"] == "scratch"  # no base model existed
    record = json.loads((Path(training["path"]) / "checkpoint.json").read_text())
    assert (
        record["init_requested"] == "production" and record["parent"] == "scratch"
    )  # the tiny preset's default

    assert "eval_report" in evaluation["materialized"]  # evaluated: its figures are on record
    assert "model_deployment" not in evaluation["materialized"]  # and not deployed
    assert not (world / "data" / "serving" / "production.json").exists()
    outcome = json.loads((world / "results" / "deployments" / candidate / "outcome.json").read_text())
    assert outcome["outcome"] == "held back" and outcome["production_after"] is None, outcome
    assert outcome["reason"].startswith("trained from scratch: no base model yet"), outcome
    assert "pretraining_job" in outcome["reason"], outcome
