"""The whole tiny pipeline on a real Dagster instance: every stage materializes, then schedule, sensors, backfill.

One module-scoped run of the lifecycle (two days of data, one training, one evaluation + serving) is shared by
the orchestration tests, which then exercise the schedule, the retrain sensor and the checkpoint sensor against
the instance that recorded it. A CLI backfill runs in its own instance.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest
from support.checkpoint_files import corrupted_model
from support.pipeline_runs import configs_with
from support.sandbox import SAMPLE_LANDING

from nexa_dagster.core.cluster import warm_python
from nexa_dagster.core.common.config import REPO_ROOT, load_scale
from nexa_dagster.core.evaluation.promotion import ProductionRegistry
from nexa_dagster.core.serving.answer_check import text_problem
from nexa_dagster.core.tiny.install import install_tiny_models
from nexa_dagster.core.tiny.model import build_tiny_causal_lm

# one worker runs every test of the module-scoped lifecycle (under xdist each worker would build its own: minutes)
pytestmark = pytest.mark.xdist_group("lifecycle")

DAYS = ["2026-11-20", "2026-11-21", "2026-11-22"]
ALL_KEYS = [
    "raw_documents",
    "teacher_samples",
    "filtered_samples",
    "rejected_samples",
    "sft_dataset",
    "moe_checkpoint",
    "eval_report",
    "model_deployment",
    "leaderboard",
]


def _env(root: Path) -> dict[str, str]:
    install_tiny_models([root / "data" / "models" / "tiny-teacher"])
    landing = root / "landing"
    if not landing.exists():
        for day in DAYS:
            shutil.copytree(SAMPLE_LANDING / day, landing / day)
    return {
        "NEXA_DATA_ROOT": str(root / "data"),
        "NEXA_RESULTS_ROOT": str(root / "results"),
        "NEXA_LANDING_ROOT": str(landing),
        "DAGSTER_HOME": str(root / "home"),
    }


@pytest.fixture(scope="module")
def lifecycle(tmp_path_factory: pytest.TempPathFactory):
    """Run the three jobs in order on a fresh instance; yield (defs, instance, env, checkpoint)."""
    root = tmp_path_factory.mktemp("lifecycle")
    env = _env(root)
    # the tests' small landing (12 documents a day) freezes an eval set of about a dozen examples: below the
    # gate's default evidence minimum (30), which would hold every candidate back. The gate's rule is what these
    # tests check, so this copy of configs/ lowers the minimum to what the small eval set holds; and the guards on
    # the examples that got worse, which need n >= 36 to rule out a tenth of them regressing and n >= 86 to see a
    # 5% share of regressed examples, are off here (tests/unit/core/evaluation/test_guards.py and
    # tests/integration/test_gate_guards.py are theirs).
    small = {
        "min_examples": 3,
        "guards.max_regressed_share": None,
        "guards.min_detectable_regressed_share": None,
        "guards.skew_rule": False,
    }
    env["NEXA_CONFIG_DIR"] = str(configs_with(root / "configs", {"promotion.yaml": small}))
    mp = pytest.MonkeyPatch()
    for k, v in env.items():
        mp.setenv(k, v)
    Path(env["DAGSTER_HOME"]).mkdir()
    shutil.copy(REPO_ROOT / "dagster.yaml", Path(env["DAGSTER_HOME"]) / "dagster.yaml")
    from nexa_dagster.definitions import build_defs

    # one process runs every job, as `make run`: the workers and smoke engines fork from a warm Python (a cold
    # worker's start is the integration tests' and the CLI-run tests'); closed at the end, so no later test of this
    # pytest worker forks from it
    defs = build_defs(warm_workers=True)
    instance = dg.DagsterInstance.get()
    runs = {}
    for day in DAYS:
        runs[day] = defs.resolve_job_def("daily_data_job").execute_in_process(
            instance=instance, partition_key=day
        )
    # corpus -> base: the SFT below starts from a pretrained base (init_from: base), as `make run` does; from
    # scratch the tiny student learns nothing in 24 steps and its empty answer fails the deployment's smoke test
    pretraining = defs.resolve_job_def("pretraining_job").execute_in_process(instance=instance)
    assert pretraining.success
    # the retrain sensor, ticking as the daemon would after the three data runs, asks for one training
    from nexa_dagster.sensors.retrain import retrain_after_ingest

    tick = retrain_after_ingest(dg.build_sensor_context(instance=instance))
    assert len(tick.run_requests) == 1, tick
    training = defs.resolve_job_def("training_job").execute_in_process(
        instance=instance, tags=tick.run_requests[0].tags
    )
    checkpoint = training.output_for_node("moe_checkpoint")
    # the base model, on the corpus documents the eval set froze in that training run (base_model_eval)
    base_id = pretraining.output_for_node("base_model").checkpoint_id
    assert (
        defs.resolve_job_def("base_evaluation_job")
        .execute_in_process(instance=instance, partition_key=base_id)
        .success
    )
    # a model of the same architecture that is worse by construction goes into production first (nothing to beat
    # yet): random weights with the output layer scaled 20x, which about doubles the loss on every example, so the
    # gate's paired interval is decisive even on the tiny eval set (a few examples) ...
    corrupted_model(build_tiny_causal_lm(Path(env["NEXA_DATA_ROOT"]) / "checkpoints" / "untrained"))
    instance.add_dynamic_partitions("checkpoints", ["untrained"])
    evaluate = defs.resolve_job_def("evaluation_job")
    assert evaluate.execute_in_process(instance=instance, partition_key="untrained").success
    # ... and the trained checkpoint must beat it to replace it
    assert evaluate.execute_in_process(instance=instance, partition_key=checkpoint.checkpoint_id).success
    defs.resolve_job_def("leaderboard_job").execute_in_process(instance=instance)
    yield defs, instance, env, checkpoint, runs
    if (warm := warm_python.running(defs.resources["gpu_cluster"].python())) is not None:
        warm.close()
    mp.undo()
    instance.dispose()


def _corpus_beside_base(instance: dg.DagsterInstance) -> dict:
    """The metadata of the pretrain_corpus the latest base model trained on: the one materialized in the same run.
    A corpus built later (test_corpus_job's, after the eval set froze) is another corpus: the contamination check
    removes the documents that share text with eval examples, so its run hash differs."""
    base = instance.get_latest_materialization_event(dg.AssetKey("base_model"))
    assert base is not None, "base_model has no materialization"
    records = instance.fetch_materializations(dg.AssetKey("pretrain_corpus"), limit=100).records
    same_run = [r for r in records if r.run_id == base.run_id]
    assert same_run, "no pretrain_corpus materialized in the base model's run"
    return {k: v.value for k, v in same_run[0].event_log_entry.asset_materialization.metadata.items()}


def _metadata(instance: dg.DagsterInstance, key: str, partition: str | None = None) -> dict:
    event = instance.get_latest_materialization_event(dg.AssetKey(key)) if partition is None else None
    if partition is not None:
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey(key), asset_partitions=[partition]), limit=1
        ).records
        event = records[0].event_log_entry if records else None
    assert event is not None, f"{key} has no materialization"
    return {k: v.value for k, v in event.asset_materialization.metadata.items()}


def test_every_stage_is_materialized_with_metadata(lifecycle) -> None:
    _, instance, _, checkpoint, _ = lifecycle
    for key in ALL_KEYS:
        assert instance.get_latest_materialization_event(dg.AssetKey(key)) is not None, key
    for day in DAYS:
        assert _metadata(instance, "raw_documents", day)["dagster/row_count"] > 0
        teacher = _metadata(instance, "teacher_samples", day)
        assert teacher["completion_tokens"] > 0 and teacher["failed_requests"] == 0
        assert 0 < _metadata(instance, "filtered_samples", day)["pass_rate"] <= 1
    sft = _metadata(instance, "sft_dataset")
    assert sft["train_sequences"] > 0 and sft["validation_sequences"] > 0 and sft["packing_efficiency"] > 0.5
    assert 0 <= sft["shards_reused"] <= sft["num_shards"]
    training = _metadata(instance, "moe_checkpoint")
    assert training["steps"] > 0 and training["final_train_loss"] > 0
    report = _metadata(instance, "eval_report", checkpoint.checkpoint_id)
    assert report["perplexity"] >= 1 and report["judge_method"] == "logprobs"
    assert 1 <= report["judge_score"] <= 5
    deployment = _metadata(instance, "model_deployment", checkpoint.checkpoint_id)
    assert text_problem(deployment["smoke_response"]) is None and deployment["smoke_latency_s"] > 0


def test_the_tiny_scales_benchmarks_reach_the_report_mlflow_and_the_leaderboard(lifecycle) -> None:
    """The shipped lm-evaluation-harness tasks (evaluation.benchmarks of the tiny scale) ran on the checkpoint in
    the evaluation worker: score and standard error in the asset metadata, report.json, the evaluation's MLflow run
    and a leaderboard column."""
    defs, instance, env, checkpoint, _ = lifecycle
    report = _metadata(instance, "eval_report", checkpoint.checkpoint_id)
    acc, stderr = (
        report["benchmark/nexa_stdlib_module/acc"],
        report["benchmark/nexa_stdlib_module/acc_stderr"],
    )
    assert 0 <= acc <= 1 and stderr == pytest.approx(
        (acc * (1 - acc) / 39) ** 0.5, abs=5e-5
    )  # 40 examples; 4 decimals
    assert "benchmark/nexa_docstring_completion/exact_match.first_three_words_stderr" in report
    saved = json.loads(Path(report["report_json"]).read_text())
    assert saved["benchmarks"]["tasks"]["nexa_stdlib_module"]["acc"]["value"] == acc
    assert "| nexa_stdlib_module | acc |" in report["report"]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=defs.resources["tracking"].uri())
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        f"tags.checkpoint_id = '{checkpoint.checkpoint_id}' and tags.stage = 'evaluation'",
    )
    assert runs and runs[0].data.metrics["benchmark/nexa_stdlib_module/acc"] == pytest.approx(acc)
    assert runs[0].data.metrics["benchmark/nexa_stdlib_module/acc_stderr"] == pytest.approx(stderr, abs=5e-5)
    import pandas as pd

    board = pd.read_csv(Path(env["NEXA_RESULTS_ROOT"]) / "evaluation" / "leaderboard.csv").set_index(
        "checkpoint_id"
    )
    assert board.loc[checkpoint.checkpoint_id, "nexa_stdlib_module/acc"] == pytest.approx(acc)


def test_long_stages_report_how_far_they_are_in_the_run_logs(lifecycle) -> None:
    """Each long stage ends its progress with a final "<what>: done/total" line in its run's log (the same
    lines come every 10 s while it runs; tests/test_progress.py and test_training.py check the clock)."""
    _, instance, _, checkpoint, _ = lifecycle
    messages = [entry.user_message for run in instance.get_runs() for entry in instance.all_logs(run.run_id)]
    patterns = [
        r"^teacher answers: (\d+)/\1 ",
        r"^gated: (\d+)/\1 ",
        r"^shards done: (\d+)/\1 ",
        r"^training steps: (\d+)/\1 ",
        rf"^{checkpoint.checkpoint_id} candidate: eval-set examples scored: (\d+)/\1 ",
        rf"^{checkpoint.checkpoint_id}: held-out answers judged: (\d+)/\1 ",
    ]
    for pattern in patterns:
        assert any(re.search(pattern, m) for m in messages), f"no run log line matches {pattern}"


def test_artifacts_on_disk_are_real(lifecycle) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    defs, _, env, checkpoint, _ = lifecycle
    ckpt = Path(checkpoint.path)
    assert (ckpt / "_COMPLETE").exists() and (ckpt / "checkpoint.json").exists()
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    assert model.config.model_type == "mixtral" and model.config.num_local_experts > 1
    assert AutoTokenizer.from_pretrained(ckpt).chat_template
    reports = Path(env["NEXA_RESULTS_ROOT"]) / "evaluation" / "reports" / checkpoint.checkpoint_id
    assert (reports / "report.json").exists() and "# Evaluation" in (reports / "report.md").read_text()
    assert (
        Path(env["NEXA_RESULTS_ROOT"]) / "deployments" / checkpoint.checkpoint_id / "deployment.json"
    ).exists()
    # MLflow: the registered version is the model (an MLmodel under the training run), not the checkpoint's path;
    # the training run holds its loss curve, the evaluation run its report
    tracking = defs.resources["tracking"]
    client = tracking._client()
    (version,) = [
        v
        for v in client.search_model_versions("name='nexa-moe'")
        if v.tags.get("checkpoint_id") == checkpoint.checkpoint_id
    ]
    assert version.source == f"runs:/{checkpoint.mlflow_run_id}/model"
    assert {"loss_curve.png", "model"} <= {a.path for a in client.list_artifacts(checkpoint.mlflow_run_id)}
    assert "MLmodel" in {Path(a.path).name for a in client.list_artifacts(checkpoint.mlflow_run_id, "model")}
    (evaluation,) = client.search_runs(
        [client.get_experiment_by_name(tracking.experiment).experiment_id],
        f"tags.checkpoint_id = '{checkpoint.checkpoint_id}' and tags.stage = 'evaluation'",
    )
    assert {"report.json", "report.md"} <= {a.path for a in client.list_artifacts(evaluation.info.run_id)}
    rejected = Path(env["NEXA_DATA_ROOT"]) / "assets" / "rejected_samples"
    import pandas as pd

    frames = [pd.read_parquet(p) for p in rejected.glob("*.parquet")]
    if frames and len(pd.concat(frames)):
        assert pd.concat(frames)["reason"].str.len().gt(0).all()


def test_each_new_day_costs_one_days_work(lifecycle) -> None:
    """Day N+1 after N days of history: the data stages process that day's rows only, not the history."""
    _, instance, _, _, runs = lifecycle
    for day, result in runs.items():
        by_key: dict[str, list[tuple[str, int]]] = {}
        for event in result.get_asset_materialization_events():
            mat = event.event_specific_data.materialization
            by_key.setdefault(mat.asset_key.to_user_string(), []).append(
                (mat.partition, int(mat.metadata["dagster/row_count"].value))
            )
        docs = by_key["raw_documents"][0][1]
        assert by_key["raw_documents"] == [(day, docs)] and by_key["teacher_samples"] == [(day, docs)], day
        filtered, rejected = by_key["filtered_samples"][0][1], by_key["rejected_samples"][0][1]
        assert filtered + rejected == docs and by_key["filtered_samples"][0][0] == day
    # while the training snapshot covers every day so far
    assert sorted(_metadata(instance, "sft_dataset")["days"]) == DAYS


def test_nightly_schedule_targets_yesterday_at_two_utc(lifecycle) -> None:
    defs = lifecycle[0]
    schedule = defs.resolve_schedule_def("nightly_retrain")
    assert schedule.cron_schedule == "0 2 * * *"
    storage = defs.resources["storage"]

    def tick(when: dt.datetime) -> dg.ScheduleExecutionData:
        ctx = dg.build_schedule_context(
            scheduled_execution_time=when,
            repository_def=defs.get_repository_def(),
            resources={"storage": storage},
        )
        return schedule.evaluate_tick(ctx)

    # the night after a day with landed documents: one run for that day
    requests = tick(dt.datetime(2026, 11, 22, 2, 0, tzinfo=dt.UTC)).run_requests
    assert [(r.partition_key, r.run_key) for r in requests] == [("2026-11-21", "nightly-2026-11-21")]
    # the night after a day with nothing landed: a skip with the reason, no run
    empty = tick(dt.datetime(2026, 11, 24, 2, 0, tzinfo=dt.UTC))
    assert not empty.run_requests and "no documents landed for 2026-11-23" in empty.skip_message


def test_retrain_sensor_trains_once_per_new_snapshot(lifecycle) -> None:
    """Three successful daily runs gave one training (the fixture ran the one request of the sensor's tick); with
    the data unchanged since it started, no tick asks again; a data run in flight holds a new training back until
    it is done, so a backfill's days are trained on together."""
    from nexa_dagster.sensors.retrain import latest_filtered_storage_id, retrain_after_ingest

    defs, instance, _, _, _ = lifecycle
    first = instance.get_run_records(dg.RunsFilter(job_name="training_job"))[-1]
    assert first.dagster_run.tags["nexa/filtered_samples_up_to"] == str(
        latest_filtered_storage_id(instance, before_timestamp=first.create_timestamp.timestamp())
    )

    # a later tick, from a fresh cursor (a daemon restart) as from the last one: nothing changed, nothing to train
    again = retrain_after_ingest(dg.build_sensor_context(instance=instance))
    assert again.run_requests == [] and "no new filtered samples" in again.skip_reason.skip_message
    assert (
        retrain_after_ingest(dg.build_sensor_context(instance=instance, cursor=again.cursor)).run_requests
        == []
    )

    # new filtered samples while another day of a backfill is not done yet: wait for it, then train once
    instance.report_runless_asset_event(
        dg.AssetMaterialization("filtered_samples", partition="2026-11-23", metadata={"dagster/row_count": 3})
    )
    pending = instance.create_run_for_job(
        defs.resolve_job_def("daily_data_job"),
        status=dg.DagsterRunStatus.NOT_STARTED,
        tags={"dagster/partition": DAYS[1]},
    )
    try:
        waiting = retrain_after_ingest(dg.build_sensor_context(instance=instance, cursor=again.cursor))
        assert (
            waiting.run_requests == []
            and "waiting for 1 daily_data_job run" in waiting.skip_reason.skip_message
        )
    finally:
        instance.delete_run(pending.run_id)
    ticks, cursor = [], waiting.cursor
    for _ in range(3):
        ticks.append(retrain_after_ingest(dg.build_sensor_context(instance=instance, cursor=cursor)))
        cursor = ticks[-1].cursor
    assert [len(t.run_requests) for t in ticks] == [1, 0, 0]


def test_checkpoint_sensor_evaluates_each_checkpoint_exactly_once(lifecycle) -> None:
    from nexa_dagster.sensors.checkpoints import new_checkpoint_sensor

    defs, instance, env, checkpoint, _ = lifecycle
    storage, tracking = defs.resources["storage"], defs.resources["tracking"]
    store = Path(env["NEXA_DATA_ROOT"]) / "checkpoints"
    resources = {
        "storage": storage,
        "tracking": tracking,
        "promotion_policy": defs.resources["promotion_policy"],
    }

    # the trained checkpoint was evaluated by the pipeline already: no request for it
    first = new_checkpoint_sensor(dg.build_sensor_context(instance=instance, resources=resources))
    assert first.run_requests == []

    # a checkpoint copied in by hand, and one still being copied (no completion marker)
    shutil.copytree(checkpoint.path, store / "hand-copied", ignore=shutil.ignore_patterns("checkpoint.json"))
    shutil.copytree(checkpoint.path, store / "half-copied", ignore=shutil.ignore_patterns("_COMPLETE"))
    second = new_checkpoint_sensor(
        dg.build_sensor_context(instance=instance, cursor=first.cursor, resources=resources)
    )
    assert [(r.partition_key, r.run_key) for r in second.run_requests] == [
        ("hand-copied", "evaluate-hand-copied")
    ]
    assert second.dynamic_partitions_requests[0].partition_keys == ["hand-copied"]
    instance.add_dynamic_partitions("checkpoints", ["hand-copied"])  # what the daemon does with the request

    # a daemon restart re-reads the cursor: nothing is requested twice
    third = new_checkpoint_sensor(
        dg.build_sensor_context(instance=instance, cursor=second.cursor, resources=resources)
    )
    assert third.run_requests == []

    # once the copy completes, it is picked up (once)
    (store / "half-copied" / "_COMPLETE").write_text("ok\n")
    fourth = new_checkpoint_sensor(
        dg.build_sensor_context(instance=instance, cursor=third.cursor, resources=resources)
    )
    assert [r.partition_key for r in fourth.run_requests] == ["half-copied"]

    # a checkpoint trained outside Dagster and registered in the MLflow model registry is found there
    outside = Path(env["NEXA_DATA_ROOT"]).parent / "elsewhere" / "external-run"
    shutil.copytree(checkpoint.path, outside)
    tracking.register_checkpoint("nexa-moe", "external-run", str(outside), None)
    fifth = new_checkpoint_sensor(
        dg.build_sensor_context(instance=instance, cursor=fourth.cursor, resources=resources)
    )
    assert [r.run_key for r in fifth.run_requests] == ["evaluate-external-run"]


def test_a_copied_checkpoint_is_evaluated_from_where_it_lies(lifecycle) -> None:
    """A checkpoint folder copied from another data root, whose checkpoint.json names a model path and a validation
    split that do not exist here, is evaluated from the copy, on this data root's eval set; the report (which
    serving and promotion read) names the copy."""
    from support.checkpoint_files import copy_checkpoint_from_elsewhere

    from nexa_dagster.resources.io_manager import read_stored_artifact

    defs, instance, env, checkpoint, _ = lifecycle
    copy = copy_checkpoint_from_elsewhere(
        Path(checkpoint.path), Path(env["NEXA_DATA_ROOT"]) / "checkpoints" / "moved"
    )
    instance.add_dynamic_partitions("checkpoints", ["moved"])
    result = defs.resolve_job_def("evaluation_job").execute_in_process(
        instance=instance, partition_key="moved", raise_on_error=False
    )
    # evaluated (the identical copy does not beat production, so the gate holds it back: not deployed)
    assert "moved" in instance.get_materialized_partitions(dg.AssetKey("eval_report")), [
        e.message for e in result.all_events if e.is_failure
    ]
    report = read_stored_artifact(env["NEXA_DATA_ROOT"], "eval_report", "moved")
    assert (
        report.checkpoint_path == str(copy) and report.eval_set_version == 1
    )  # this data root's frozen eval set
    assert report.eval_loss == pytest.approx(
        read_stored_artifact(env["NEXA_DATA_ROOT"], "eval_report", checkpoint.checkpoint_id).eval_loss
    )  # the same model, the same data
    assert json.loads(Path(report.report_json).read_text())["lineage"]["checkpoint_path"] == str(copy)
    # the copy reports under its own id, so the original's report stays the original's and the leaderboard (which
    # refuses an id twice) builds with both (test_base_models_are_measured_... rebuilds it after this test)
    assert report.checkpoint_id == "moved"
    original = read_stored_artifact(env["NEXA_DATA_ROOT"], "eval_report", checkpoint.checkpoint_id)
    assert json.loads(Path(original.report_json).read_text())["lineage"]["checkpoint_path"] == checkpoint.path


def docs_block(page: str, heading: str) -> str:
    """The first ```bash block under a heading of a documentation page (``docs/<page>``), as a user would copy it."""
    text = (REPO_ROOT / "docs" / page).read_text(encoding="utf-8")
    section = text[text.index(heading) :]
    return section[
        section.index("```bash\n") + len("```bash\n") : section.index("\n```", section.index("```bash"))
    ]


def fresh_clone(dest: Path) -> Path:
    """The repository's tracked files (as they are in the working tree) in ``dest``, with this venv as ``.venv``:
    a clone with no ``.dagster_home``, ``data`` or ``results``."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if (REPO_ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / name, dest / name)
    (dest / ".venv").symlink_to(Path(sys.executable).parent.parent)
    return dest


@pytest.mark.xdist_group("cli_backfill")  # needs no lifecycle: free to run on the other worker
def test_cli_backfill_of_a_date_range_in_one_run(tmp_path: Path) -> None:
    """The backfill commands of docs/operations.md, as written, in a fresh clone (no Dagster home yet): the tiny
    models installed, a single run for the date range, then a multi-run backfill queued for the daemon. The last
    command (training) is left out here: `dagster job execute -j training_job` is run by
    test_gpu_pool_runs_one_training_at_a_time.

    The days landed are the tests' copies of the three sample days (12 documents each, the same formats;
    ``NEXA_LANDING_ROOT``), not the clone's `make run` days (~520, 100 and 100 documents): what is checked is the
    commands, one run for the range and the queued runs, not the teacher's throughput, and through the teacher and
    the judge the 720 documents cost minutes (the test's 501 s in a loaded suite, most of it this run)."""
    clone = fresh_clone(tmp_path / "clone")
    block = docs_block("operations.md", "## Backfills from the command line")
    script = "\n".join(line for line in block.splitlines() if "-j training_job" not in line)
    assert "dagster asset materialize" in script and "dagster job backfill" in script
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NEXA_", "DAGSTER_"))}
    env["PYTHONPATH"] = str(clone)  # the clone's package, not the one the venv was installed from
    env["NEXA_LANDING_ROOT"] = str(clone / SAMPLE_LANDING.relative_to(REPO_ROOT))  # the clone's small days
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        env=env,
        cwd=clone,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    instance = dg.DagsterInstance.from_config(str(clone / ".dagster_home"))
    try:
        single = instance.get_runs(dg.RunsFilter(tags={"dagster/asset_partition_range_start": DAYS[0]}))
        assert (
            len(single) == 1 and single[0].status == dg.DagsterRunStatus.SUCCESS
        )  # one run, the whole range
        for key in ("raw_documents", "teacher_samples", "filtered_samples", "rejected_samples"):
            assert instance.get_materialized_partitions(dg.AssetKey(key)) == set(DAYS), key
        for day in DAYS:
            assert (clone / "data" / "assets" / "teacher_samples" / f"{day}.parquet").exists()
        queued = instance.get_runs(dg.RunsFilter(job_name="daily_data_job"))  # the backfill: one run per day
        assert sorted(r.tags["dagster/partition"] for r in queued) == DAYS
        assert {r.status for r in queued} == {dg.DagsterRunStatus.QUEUED}
    finally:
        instance.dispose()


def test_promotion_gate_leaderboard_and_rollback(lifecycle) -> None:
    defs, instance, env, checkpoint, _ = lifecycle
    storage, tracking = defs.resources["storage"], defs.resources["tracking"]
    registry = ProductionRegistry(storage.production_pointer())

    # the trained checkpoint beat the untrained one and replaced it, pointer and MLflow alias alike
    state = registry.state()
    assert state.current.checkpoint_id == checkpoint.checkpoint_id
    assert [h.checkpoint_id for h in state.history] == ["untrained"]
    assert tracking.alias_version("nexa-moe", "production")[1] == checkpoint.checkpoint_id
    report = _metadata(instance, "eval_report", checkpoint.checkpoint_id)
    assert 0 <= report["win_rate_vs_production"] <= 1 and report["production_checkpoint"] == "untrained"
    assert report["gate_decision"] == "promote" and report["eval_set_version"] == 1
    assert report["eval_loss"] < report["production_eval_loss"]  # the trained model, on the same examples

    # the leaderboard has one row per evaluated checkpoint, best first, production marked, then the base model
    board = _metadata(instance, "leaderboard")
    assert board["dagster/row_count"] == 3 and board["production"] == checkpoint.checkpoint_id
    csv = (Path(env["NEXA_RESULTS_ROOT"]) / "evaluation" / "leaderboard.csv").read_text().splitlines()
    assert csv[1].startswith(f"{checkpoint.checkpoint_id},sft,") and csv[2].startswith("untrained,sft,")
    assert csv[3].startswith("base-") and ",base," in csv[3]

    # a worse checkpoint is evaluated but held back: a successful run with a recorded decision (a warning, not
    # red), and it is not deployed
    store = Path(env["NEXA_DATA_ROOT"]) / "checkpoints"
    shutil.copytree(store / "untrained", store / "untrained-again")
    instance.add_dynamic_partitions("checkpoints", ["untrained-again"])
    result = defs.resolve_job_def("evaluation_job").execute_in_process(
        instance=instance, partition_key="untrained-again", raise_on_error=False
    )
    assert result.success and instance.get_run_by_id(result.run_id).status == dg.DagsterRunStatus.SUCCESS
    gate = [c for c in result.get_asset_check_evaluations() if c.check_name == "beats_production"][0]
    meta = {k: v.value for k, v in gate.metadata.items()}
    assert not gate.passed and "is not below" in meta["reason"] and meta["decision"] == "hold back"
    assert gate.severity == dg.AssetCheckSeverity.WARN
    # both models were scored on the same eval-set version in this run: values, difference and its interval
    assert meta["eval_set_version"] == 1 and meta["production_checkpoint"] == checkpoint.checkpoint_id
    assert meta["candidate_eval_loss"] > meta["production_eval_loss"]
    low, high = meta["eval_loss_difference_interval"]
    assert 0 < low <= meta["eval_loss_difference"] <= high
    assert "untrained-again" in instance.get_materialized_partitions(dg.AssetKey("eval_report"))
    assert "untrained-again" not in instance.get_materialized_partitions(dg.AssetKey("model_deployment"))
    assert registry.current().checkpoint_id == checkpoint.checkpoint_id

    # rollback is one command, and moves the MLflow alias back too
    proc = subprocess.run(
        [sys.executable, "-m", "nexa_dagster.cli", "rollback"],
        env={**os.environ, **env},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert registry.current().checkpoint_id == "untrained"
    assert tracking.alias_version("nexa-moe", "production")[1] == "untrained"

    # production_model's history: each promotion (in its deployment run) and the rollback, oldest first
    events = instance.fetch_materializations(
        dg.AssetKey("production_model"), limit=20, ascending=True
    ).records
    history = [
        (
            e.asset_materialization.metadata["change"].value,
            e.asset_materialization.tags["dagster/data_version"],
        )
        for e in events
    ]
    assert history[-3:] == [
        ("promotion", "untrained"),
        ("promotion", checkpoint.checkpoint_id),
        ("rollback", "untrained"),
    ], history


def test_gpu_pool_runs_one_training_at_a_time(lifecycle, tmp_path: Path) -> None:
    """A training run started while another holds the `gpu` pool's one slot waits for it: their training steps
    never overlap. The second is launched with run config (the training knobs of the Launchpad, here from the
    CLI's --config): it trains the steps and learning rate it was given, the first the preset's.

    The second starts once the first holds the slot, not at the same instant: on the embedded SQLite instance
    Dagster's slot claim is check-then-act without row locks, so two claims in the same few milliseconds can both
    win (seen here: two runs started together both trained); Postgres claims with FOR UPDATE SKIP LOCKED
    (docs/operations.md, "The GPU pool")."""
    defs, instance, env, _, _ = lifecycle
    before = {r.dagster_run.run_id for r in instance.get_run_records(dg.RunsFilter(job_name="training_job"))}
    cmd = [
        sys.executable,
        "-m",
        "dagster",
        "job",
        "execute",
        "-m",
        "nexa_dagster.definitions",
        "-j",
        "training_job",
    ]
    knobs = tmp_path / "knobs.yaml"
    knobs.write_text(
        json.dumps({"ops": {"moe_checkpoint": {"config": {"max_steps": 6, "learning_rate": 0.002}}}})
    )

    def launch(extra: list[str]) -> subprocess.Popen:
        return subprocess.Popen(
            cmd + extra,
            env={**os.environ, **env},
            cwd=REPO_ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    procs = [launch([])]
    deadline = time.monotonic() + 600
    while not instance.event_log_storage.get_concurrency_info("gpu").claimed_slots:  # the first trains
        assert procs[0].poll() is None and time.monotonic() < deadline, procs[0].communicate()[1][-2000:]
        time.sleep(0.5)
    procs.append(launch(["-c", str(knobs)]))
    errors = [p.communicate(timeout=900)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errors[0][-2000:] + errors[1][-2000:]
    runs = [
        r
        for r in instance.get_run_records(dg.RunsFilter(job_name="training_job"))
        if r.dagster_run.run_id not in before
    ]
    assert len(runs) == 2
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=defs.resources["tracking"].uri())
    trained = {}
    for run in runs:
        event = next(
            e
            for e in instance.all_logs(run.dagster_run.run_id)
            if e.dagster_event
            and e.dagster_event.event_type == dg.DagsterEventType.ASSET_MATERIALIZATION
            and e.dagster_event.asset_key == dg.AssetKey("moe_checkpoint")
        )
        metadata = {k: v.value for k, v in event.asset_materialization.metadata.items()}
        params = client.get_run(str(metadata["mlflow_run_id"])).data.params
        knobbed = bool(run.dagster_run.run_config.get("ops"))
        trained[knobbed] = (metadata["steps"], float(params["learning_rate"]), metadata["scale"])
    preset = load_scale("tiny").training  # the first run trains the preset's steps and rate
    assert trained == {False: (preset.max_steps, preset.learning_rate, "tiny"), True: (6, 0.002, "tiny")}, (
        trained
    )
    spans = []
    for run in runs:
        events = instance.all_logs(run.dagster_run.run_id)
        starts = [
            e.timestamp
            for e in events
            if e.step_key == "moe_checkpoint"
            and e.dagster_event
            and e.dagster_event.event_type == dg.DagsterEventType.STEP_START
        ]
        ends = [
            e.timestamp
            for e in events
            if e.step_key == "moe_checkpoint"
            and e.dagster_event
            and e.dagster_event.event_type == dg.DagsterEventType.STEP_SUCCESS
        ]
        spans.append((starts[0], ends[0]))
    (a0, a1), (b0, b1) = sorted(spans)
    assert a1 <= b0, f"training steps overlapped: {spans}"


def test_serve_command_serves_the_production_model_until_interrupted(lifecycle) -> None:
    import json
    import signal
    import socket
    import urllib.request

    _, _, env, _, _ = lifecycle
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "nexa_dagster.cli", "serve", "--port", str(port)],
        env={**os.environ, **env},
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    import threading

    # a changed start-up message must fail the test, not hang it: the command is stopped after 300 s
    watchdog = threading.Timer(300, proc.kill)
    watchdog.start()
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C stops it." in line:
                break
        watchdog.cancel()
        started = [
            line for line in lines if f"serving 'nexa-moe' at http://127.0.0.1:{port}/v1 (production" in line
        ]
        assert started and "none yet" not in started[0], "".join(lines)[
            -2000:
        ]  # it serves the production model
        body = json.dumps(
            {"model": "nexa-moe", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        ).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=body,
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as resp:
            answer = json.loads(resp.read())
        assert answer["usage"]["completion_tokens"] > 0
    finally:
        watchdog.cancel()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0  # the server went with the command


def test_a_checkpoint_seen_before_its_record_keeps_its_dataset_lineage(lifecycle) -> None:
    """The sensor may fire between the worker's completion marker and the asset's checkpoint.json."""
    from nexa_dagster.assets.evaluation import load_checkpoint_record

    _, _, env, checkpoint, _ = lifecycle
    copy = Path(env["NEXA_DATA_ROOT"]).parent / "no-record" / "ckpt"
    shutil.copytree(checkpoint.path, copy, ignore=shutil.ignore_patterns("checkpoint.json"))
    record = load_checkpoint_record(copy, "ckpt")
    assert record.dataset_run_hash == checkpoint.dataset_run_hash
    assert record.dataset_validation_path == checkpoint.dataset_validation_path
    assert record.num_steps == checkpoint.num_steps


def test_corpus_job_writes_a_megatron_corpus_and_rl_prompts(lifecycle) -> None:
    """The data products for other trainers, from the same lineage: every ingested document as bin/idx shards
    readable with the indexed-dataset reader, and one RL prompt per accepted sample."""
    import json as json_

    from nexa_dagster.core.packaging.formats.indexed_dataset import IndexedDataset

    defs, instance, _, _, _ = lifecycle
    result = defs.resolve_job_def("corpus_job").execute_in_process(instance=instance)
    assert result.success
    corpus = result.output_for_node("pretrain_corpus")
    documents = sum(len(dg_runs.output_for_node("raw_documents")) for dg_runs in lifecycle[4].values())
    # every ingested document but those holding eval-set or benchmark text (the contamination check removes them)
    # and a document landed again on a later day (kept once, from the earlier day)
    removed = _metadata(instance, "pretrain_corpus")["contaminated_rows_removed"]
    kept = documents - removed - corpus.cross_day_duplicates_dropped
    assert 0 < corpus.num_documents == kept and corpus.num_tokens > corpus.num_documents
    assert sum(IndexedDataset(prefix).num_documents for prefix in corpus.prefixes) == corpus.num_documents
    assert json_.loads(Path(corpus.megatron_blend_path).read_text())
    prompts = result.output_for_node("rl_prompts")
    metadata = _metadata(instance, "rl_prompts")
    assert metadata["records"] > 0 and Path(str(metadata["path"])).exists(), (prompts, metadata)


def test_pretraining_job_trains_a_base_model_that_training_then_starts_from(lifecycle) -> None:
    """corpus -> base -> SFT lineage: base_model pretrains on the bin/idx corpus through the GPU-cluster resource
    (held-out corpus perplexity in its metadata); the lifecycle's training started from it by default (init_from:
    base) and records it as its parent (asset metadata, checkpoint.json, leaderboard); a checkpoint path of the
    wrong architecture fails before anything launches."""
    import pandas as pd
    from transformers import GPT2Config, GPT2LMHeadModel

    defs, instance, env, first, _ = lifecycle
    meta = _metadata(instance, "base_model")
    corpus = _corpus_beside_base(instance)
    base_dir = Path(str(meta["checkpoint_path"]))
    assert (base_dir / "model.safetensors").exists() and (base_dir / "tokenizer.json").exists()
    assert meta["corpus_run_hash"] == corpus["run_hash"] and meta["heldout_documents"] > 0
    assert 1 < meta["heldout_perplexity"] < float("inf") and meta["steps"] > 0

    assert first.parent == f"base:{base_dir.name}"
    # its own materialization (a later test may have trained again, from production: nightly continual fine-tuning)
    events = instance.fetch_materializations(dg.AssetKey("moe_checkpoint"), limit=100).records
    (own,) = [
        e.event_log_entry.asset_materialization.metadata
        for e in events
        if e.event_log_entry.asset_materialization.metadata["checkpoint_id"].value == first.checkpoint_id
    ]
    assert own["parent"].value == first.parent
    assert json.loads((Path(first.path) / "checkpoint.json").read_text())["parent"] == first.parent
    board = pd.read_csv(Path(env["NEXA_RESULTS_ROOT"]) / "evaluation" / "leaderboard.csv")
    assert board.set_index("checkpoint_id").loc[first.checkpoint_id, "parent"] == first.parent

    gpt2 = Path(env["NEXA_DATA_ROOT"]).parent / "gpt2"  # a dense Llama would be upcycled; a GPT-2 is refused
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4)).save_pretrained(gpt2)
    refused = defs.resolve_job_def("training_job").execute_in_process(
        instance=instance,
        raise_on_error=False,
        run_config={"ops": {"moe_checkpoint": {"config": {"init_from": str(gpt2)}}}},
    )
    assert not refused.success
    failure = next(e for e in refused.all_events if e.event_type_value == "STEP_FAILURE")
    assert "a GPT2LMHeadModel checkpoint; training starts only from a Mixtral" in str(
        failure.event_specific_data
    )


def test_base_models_are_measured_on_the_corpus_documents_the_eval_set_froze(lifecycle) -> None:
    """The eval set froze the corpus's eval-side documents (which the base model's training job kept out);
    base_model_eval scores a base model on exactly those in the evaluation worker (per-document loss, a bootstrap
    interval, MLflow, the leaderboard with the version), and a later base model trained on another corpus is
    measured on the same documents."""
    import pandas as pd
    from mlflow.tracking import MlflowClient

    from nexa_dagster.core.data.splits import is_held_out
    from nexa_dagster.core.evaluation.eval_set import load_eval_set

    defs, instance, env, _, _ = lifecycle
    data = Path(env["NEXA_DATA_ROOT"])
    frozen = _metadata(instance, "eval_set")
    assert (
        frozen["corpus_documents"] > 0
        and frozen["corpus_run_hash"] == _corpus_beside_base(instance)["run_hash"]
    )
    manifest = load_eval_set(str(data / "eval_sets"), 1)
    documents = pd.read_parquet(manifest["corpus_path"])["sample_id"].tolist()
    fraction = manifest["corpus"]["fraction"]
    assert len(documents) == manifest["corpus"]["documents"] and all(
        is_held_out(d, fraction) for d in documents
    )
    base_id = _metadata(instance, "base_model")["checkpoint_id"]
    job = json.loads((data / "base_models" / base_id / "training_job.json").read_text())
    assert job["eval_fraction"] == fraction  # its training kept these documents out of both sides

    first = _metadata(instance, "base_model_eval", base_id)
    low, high = first["eval_loss_interval"]
    assert first["eval_set_version"] == 1 and first["documents"] == len(documents)
    assert low <= first["eval_loss"] <= high and first["perplexity"] >= 1
    report = json.loads(Path(first["report_json"]).read_text())
    assert [d["document_id"] for d in report["per_document"]] == documents
    client = MlflowClient(tracking_uri=defs.resources["tracking"].uri())
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        f"tags.checkpoint_id = '{base_id}' and tags.stage = 'base_evaluation'",
    )
    assert runs and runs[0].data.metrics["corpus_eval_loss"] == pytest.approx(report["loss"])

    # a later base model, trained on another (bigger) corpus: worse weights by construction, the same documents
    later = data / "base_models" / "base-later"
    shutil.copytree(data / "base_models" / base_id, later)
    corrupted_model(later)
    record = json.loads((later / "checkpoint.json").read_text())
    (later / "checkpoint.json").write_text(
        json.dumps(
            {
                **record,
                "checkpoint_id": "base-later",
                "path": str(later),
                "dataset_run_hash": "a-bigger-corpus",
            }
        )
    )
    instance.add_dynamic_partitions("base_models", ["base-later"])
    assert (
        defs.resolve_job_def("base_evaluation_job")
        .execute_in_process(instance=instance, partition_key="base-later")
        .success
    )
    second = _metadata(instance, "base_model_eval", "base-later")
    assert (
        second["documents_sha256"] == first["documents_sha256"] and second["documents"] == first["documents"]
    )
    assert [
        d["document_id"] for d in json.loads(Path(second["report_json"]).read_text())["per_document"]
    ] == documents
    assert second["corpus_run_hash"] == "a-bigger-corpus" and second["eval_loss"] > first["eval_loss"]

    defs.resolve_job_def("leaderboard_job").execute_in_process(instance=instance)
    board = pd.read_csv(Path(env["NEXA_RESULTS_ROOT"]) / "evaluation" / "leaderboard.csv")
    bases = board[board["stage"] == "base"]
    assert bases["checkpoint_id"].tolist() == [base_id, "base-later"]  # best first, one eval-set version
    assert set(bases["eval_set_version"]) == {1}


def test_the_sft_dataset_holds_the_train_side_of_the_checkable_tasks_and_none_held_out(lifecycle) -> None:
    """blends/sft.yaml's checkable_tasks source: the packed training rows hold the RL stage's checkable questions
    with their answers (what SFT teaches before RL), from the train side only: no held-out item's passage is
    ever trained on, so the RL gate's held-out prompts stay unseen."""
    from transformers import AutoTokenizer

    from nexa_dagster.core.training.data import load_packed

    _, instance, env, checkpoint, _ = lifecycle
    meta = _metadata(instance, "sft_dataset")
    assert "checkable_tasks" in {s["name"] for s in meta["blend_sources"]}, meta["blend_sources"]
    text = AutoTokenizer.from_pretrained(checkpoint.path).decode(
        load_packed(meta["train_path"])["input_ids"].flatten().tolist()
    )
    assert text.count("Which Python reference topic is this passage from?") >= 3
    tasks = sorted((Path(env["NEXA_DATA_ROOT"]) / "rl" / "tasks").glob("*/held_out.jsonl"))
    held = [json.loads(line) for line in tasks[-1].read_text().splitlines()]
    assert held, "the suite's days give held-out items to check against"
    leaked = [r["item_id"] for r in held if r["prompt"].split("\n\n")[1] in text]
    assert leaked == [], leaked
