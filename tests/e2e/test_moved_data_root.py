"""A data root that moves: the jobs run in a sandbox, the whole sandbox is moved (``mv``), and the jobs run again
there. Production is scored from the new place, a better candidate is promoted and smoke-tested from it, `status`
and the serving service name and serve the new place, and nothing is written under the old path.

The jobs run in processes of their own (``support.pipeline_runs``), as `make run` runs them. A model that is worse
by construction (random weights, output layer scaled 20x) is production before the move, so the candidate trained
after it beats it by about half its loss; the configuration copy accepts the tiny eval set's two or so examples as
evidence and lets the point estimate decide (their t-interval, on one degree of freedom, is wider than any
difference: the gate's evidence rule is not what this test is about), and skips the benchmarks (time). The gate
still needs production scored to decide anything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import httpx
import pandas as pd
import pytest
from support.checkpoint_files import corrupted_model
from support.pipeline_runs import configs_with, run_jobs
from support.sandbox import make_sandbox, sandbox_env
from support.services import missing

from nexa_dagster.core.common.config import REPO_ROOT
from nexa_dagster.core.common.net import free_port
from nexa_dagster.core.evaluation.promotion import ProductionRegistry
from nexa_dagster.core.tiny.model import build_tiny_causal_lm

DAY = "2026-11-20"


def _metadata(root: Path, key: str) -> dict:
    """The latest materialization's metadata of ``key`` in the sandbox's instance."""
    with dg.DagsterInstance.from_config(str(root / "home")) as instance:
        event = instance.get_latest_materialization_event(dg.AssetKey(key))
        assert event is not None, f"{key} has no materialization"
        return {k: v.value for k, v in event.asset_materialization.metadata.items()}


def _all_ok(results: list[dict]) -> None:
    failed = [(r["job"], r["partition"], r["errors"][:2]) for r in results if not r["success"]]
    assert not failed, failed


# the jobs before the move (data, pretraining, packaging, an evaluation) and after it (a training, an evaluation)
@pytest.mark.timeout(1800)
def test_a_moved_data_root_keeps_production_and_scores_promotes_and_serves_from_the_new_place(
    tmp_path: Path,
) -> None:
    configs = configs_with(
        tmp_path / "configs",
        {
            "promotion.yaml": {
                "min_examples": 2,
                "on_insufficient_evidence": "promote",
                "require_interval": False,
            },
            # the base model is what this test follows across the move (the preset's default, production, is
            # here a model broken on purpose)
            "scales/tiny.yaml": {"evaluation.benchmarks.tasks": [], "init_from": "base"},
        },
    )
    env = {"NEXA_CONFIG_DIR": str(configs)}
    world = make_sandbox(tmp_path / "site" / "world", [DAY])
    corrupted_model(build_tiny_causal_lm(world / "data" / "checkpoints" / "untrained"))
    before = run_jobs(
        world,
        f"daily_data_job:{DAY}",
        "pretraining_job",  # freezes the eval set; the base model the candidate starts from
        "training_job[sft_dataset]",  # the packaged data the training after the move reuses
        "add_partition:untrained",
        "evaluation_job:untrained",  # nothing to beat yet: production
        "leaderboard_job",
        **env,
    )
    _all_ok(before)
    assert "model_deployment" in before[3]["materialized"]
    pointer = world / "data" / "serving" / "production.json"
    assert json.loads(pointer.read_text())["current"]["checkpoint_path"] == "checkpoints/untrained"

    moved = tmp_path / "restored" / "elsewhere" / "world"
    moved.parent.mkdir(parents=True)
    os.rename(tmp_path / "site", moved.parent.parent / "site")  # `mv` of the directory holding the data root
    os.rename(moved.parent.parent / "site" / "world", moved)
    assert not world.exists()

    after = run_jobs(moved, "training_job", "evaluation_job:@trained", "leaderboard_job", **env)
    _all_ok(after)
    training, evaluation, _ = after
    candidate = training["checkpoint_id"]
    # the data packaged before the move is found and reused from the new place (its store's paths are relative)
    assert "sft_dataset" in before[2]["materialized"], before[2]
    reused = _metadata(moved, "sft_dataset")
    assert reused["num_shards"] > 0 and reused["shards_reused"] == reused["num_shards"], reused
    # trained from the base model, found where it lies now (the Dagster event recorded the old place)
    assert training["parent"].startswith("base:") and training["path"].startswith(str(moved)), training
    assert "model_deployment" in evaluation["materialized"], evaluation

    data, results = moved / "data", moved / "results"
    report = json.loads((data / "assets" / "eval_report" / f"{candidate}.json").read_text())["data"]
    # production was scored on the same eval set, from the new place, and the candidate beat it
    assert report["production_checkpoint_id"] == "untrained" and report["production_eval_loss"] is not None
    assert report["gate_decision"] == "promote" and report["eval_loss"] < report["production_eval_loss"]
    assert (
        report["checkpoint_path"] == f"{{data_root}}/checkpoints/{candidate}"
    )  # stored relative to the root
    deployment = json.loads((results / "deployments" / candidate / "deployment.json").read_text())
    assert deployment["status"] == "ok" and deployment["checkpoint_dir"] == str(
        data / "checkpoints" / candidate
    )
    outcome = json.loads((results / "deployments" / candidate / "outcome.json").read_text())
    assert outcome["outcome"] == "deployed", outcome
    production = ProductionRegistry(data / "serving" / "production.json").state()
    assert production.current.checkpoint_id == candidate
    assert production.current.checkpoint_path == str(data / "checkpoints" / candidate)
    assert [h.checkpoint_path for h in production.history] == [str(data / "checkpoints" / "untrained")]
    assert str(tmp_path / "site") not in (data / "serving" / "production.json").read_text()

    # the leaderboard: the new production, every row of v1 measured on the same data (its content hash)
    board = pd.read_csv(results / "evaluation" / "leaderboard.csv").set_index("checkpoint_id")
    assert bool(board.loc[candidate, "in_production"]) and not bool(board.loc["untrained", "in_production"])
    manifest = json.loads((data / "eval_sets" / "v1" / "manifest.json").read_text())
    assert set(board.loc[[candidate, "untrained"], "eval_set_sha256"]) == {manifest["content_sha256"]}

    # MLflow wrote every run inside the moved data root
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{data / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("nexa")
    runs = client.search_runs([experiment.experiment_id])
    assert runs and all(r.info.artifact_uri.startswith((data / "mlartifacts").as_uri()) for r in runs)
    assert experiment.artifact_location == (data / "mlartifacts").as_uri()

    # `nexa-dagster status` names the new place
    status = subprocess.run(
        [sys.executable, "-m", "nexa_dagster.cli", "status"],
        cwd=REPO_ROOT,
        env=sandbox_env(moved, **env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert status.returncode == 0, status.stderr[-2000:]
    assert f"production: {candidate}" in status.stdout, status.stdout
    assert f"path: {data / 'checkpoints' / candidate}" in status.stdout, status.stdout
    assert str(tmp_path / "site") not in status.stdout

    _serve_and_ask(moved, env, candidate)
    assert not (tmp_path / "site").exists(), sorted(str(p) for p in (tmp_path / "site").rglob("*"))[:20]


def _serve_and_ask(root: Path, env: dict[str, str], checkpoint_id: str) -> None:
    """`nexa-dagster serve` from the moved root serves production (its path resolved there) and answers."""
    from nexa_dagster.core.serving.client import ServingServiceClient
    from nexa_dagster.core.serving.haproxy import haproxy_binary

    if haproxy_binary() is None:
        missing("haproxy", "scripts/install_services.sh, or: apt-get install haproxy")
    port = free_port()
    log = root.parent / "serve.log"
    with open(log, "wb") as out:
        service = subprocess.Popen(
            [sys.executable, "-m", "nexa_dagster.cli", "serve", "--port", str(port)],
            cwd=REPO_ROOT,
            env=sandbox_env(root, **env),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 300
        while True:
            assert service.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            client = ServingServiceClient.find(root / "data" / "serving")
            if client is not None and (status := client.status())["checkpoint_id"] == checkpoint_id:
                break
            time.sleep(0.5)
        assert status["checkpoint_path"] == str(root / "data" / "checkpoints" / checkpoint_id)
        answer = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": "nexa-moe", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
    finally:
        service.terminate()
        try:
            service.wait(timeout=60)
        except subprocess.TimeoutExpired:
            service.kill()
            pytest.fail("the serving service did not stop on SIGTERM")
