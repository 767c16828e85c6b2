"""The production instance: PostgreSQL storage (configs/dagster/production.yaml), the run queue and the daemon.

A real PostgreSQL server is started for this module (tests/services.py); Dagster's schema is created in it by
Dagster itself, and every check reads back through Dagster and straight from the database.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
import yaml
from support.pipeline_runs import configs_with
from support.sandbox import make_sandbox, sandbox_env

from nexa_dagster.core.common.config import REPO_ROOT, load_scale
from nexa_dagster.core.llm.managed_server import ManagedServer
from nexa_dagster.definitions import config_resources

# a PostgreSQL server and a daemon draining a queue of runs: left out of make test-fast
pytestmark = pytest.mark.slow

# 6 daily partitions: 3 times the backfill runs production.yaml allows at once
DAYS = [f"2026-11-{d:02d}" for d in range(1, 7)]
PRODUCTION = REPO_ROOT / "configs" / "dagster" / "production.yaml"


def _backfill_limit() -> int:
    """How many runs of one backfill production.yaml lets the daemon run at once (its dagster/backfill limit)."""
    limits = yaml.safe_load(PRODUCTION.read_text())["concurrency"]["runs"]["tag_concurrency_limits"]
    return next(int(x["limit"]) for x in limits if x["key"] == "dagster/backfill")


def _most_at_once(records: list[dg.RunRecord]) -> int:
    """The most runs that were running at the same moment (from each run's start and end time)."""
    # at one instant an end (-1) sorts before a start (+1): a run that ends as another starts is not beside it
    edges = sorted([(r.start_time, 1) for r in records] + [(r.end_time, -1) for r in records])
    running = most = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


def _home(tmp_path: Path, pg: dict[str, str]) -> Path:
    make_sandbox(tmp_path, settings=PRODUCTION)
    os.environ["DAGSTER_PG_URL"] = pg["DAGSTER_PG_URL"]  # the instance config reads it from the environment
    return tmp_path / "home"


def _psql(pg: dict[str, str], sql: str) -> str:
    import psycopg2

    with (
        psycopg2.connect(host=pg["host"], port=int(pg["port"]), user="postgres", dbname=pg["db"]) as conn,
        conn.cursor() as cur,
    ):
        cur.execute(sql)
        return cur.fetchall()


def _landing(root: Path) -> dict[str, int]:
    """A landing folder of distinct documents per day; returns how many documents each day holds."""
    counts = {}
    for i, day in enumerate(DAYS):
        (root / day).mkdir(parents=True)
        docs = [
            {"title": f"note {day} {j}", "text": f"Day {day}, note {j}: " + "lorem ipsum dolor " * (5 + j)}
            for j in range(3 + i % 4)
        ]
        (root / day / "notes.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
        counts[day] = len(docs)
    return counts


def test_a_materialization_is_stored_in_postgres(tmp_path: Path, pg: dict[str, str]) -> None:
    from nexa_dagster.assets.ingest import raw_documents
    from nexa_dagster.resources.io_manager import NexaIOManager
    from nexa_dagster.resources.storage import StorageResource

    counts = _landing(tmp_path / "landing")
    instance = dg.DagsterInstance.from_config(str(_home(tmp_path, pg)))
    try:
        assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
        data = str(tmp_path / "data")
        result = dg.materialize(
            [raw_documents],
            partition_key=DAYS[0],
            instance=instance,
            resources={
                **config_resources(),
                "io_manager": NexaIOManager(data_root=data),
                "storage": StorageResource(data_root=data, landing_root=str(tmp_path / "landing")),
            },
        )
        assert result.success
        event = instance.get_latest_materialization_event(dg.AssetKey("raw_documents"))
        assert event is not None and event.run_id == result.run_id
        assert event.asset_materialization.metadata["dagster/row_count"].value == counts[DAYS[0]]
        rows = _psql(
            pg,
            "SELECT count(*) FROM event_logs WHERE asset_key = '[\"raw_documents\"]' "
            "AND dagster_event_type = 'ASSET_MATERIALIZATION'",
        )
        assert rows[0][0] == 1
    finally:
        instance.dispose()


def _wait_for_runs(
    instance: dg.DagsterInstance, job: str, timeout_s: float
) -> dict[str, dg.DagsterRunStatus]:
    """Poll until every queued partition run of ``job`` has finished; returns status by partition."""
    deadline, statuses = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        statuses = {
            r.tags["dagster/partition"]: r.status for r in instance.get_runs(dg.RunsFilter(job_name=job))
        }
        if len(statuses) == len(DAYS) and all(
            s in (dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE) for s in statuses.values()
        ):
            break
        time.sleep(3)
    return statuses


def _read_partitions(data: Path, asset: str) -> dict[str, pd.DataFrame]:
    return {f.stem: pd.read_parquet(f) for f in sorted(data.rglob(f"{asset}/*.parquet"))}


@pytest.mark.timeout(1800)  # 6 runs through the daemon's queue, 2 at a time: minutes on 2 cores
def test_daily_data_runs_through_the_queue_lose_and_duplicate_nothing(
    tmp_path: Path, pg: dict[str, str], tiny_model_dir: Path
) -> None:
    """`dagster job backfill` queues 6 runs of the data stages (ingest, teacher, judge); the real daemon dequeues
    them against Postgres within production.yaml's limit on one backfill's runs (2 at a time, so the others wait in
    the queue), and all share one OpenAI-compatible model server, as a lab's runs share one vLLM endpoint. Each
    day's documents, answers and verdicts arrive once: none lost, none twice."""
    counts = _landing(tmp_path / "landing")
    home = _home(tmp_path, pg)
    data = tmp_path / "data"
    with ManagedServer(tiny_model_dir, tmp_path / "server-logs", continuous_batching=True) as server:
        endpoint = {
            f"NEXA_{role}_{key}": value
            for role in ("TEACHER", "JUDGE")
            for key, value in {
                "BACKEND": "openai",
                "URL": server.base_url,
                "MODEL": server.model_name,
                "API_KEY": "unused-by-transformers-serve",
            }.items()
        }
        # the queue is under test, not the answers: the teacher writes 8 tokens, not the preset's 40 (the one
        # shared model server answers every run's requests, and generation was most of this test's time)
        configs = configs_with(tmp_path / "configs", {"scales/tiny.yaml": {"teacher.max_new_tokens": 8}})
        env = sandbox_env(tmp_path, **endpoint, NEXA_CONFIG_DIR=str(configs))
        cmd = [
            sys.executable,
            "-m",
            "dagster",
            "job",
            "backfill",
            "-w",
            "workspace.yaml",
            "-j",
            "daily_data_job",
            "--from",
            DAYS[0],
            "--to",
            DAYS[-1],
            "--noprompt",
        ]
        proc = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]

        instance = dg.DagsterInstance.from_config(str(home))
        daemon = subprocess.Popen(
            [str(Path(sys.executable).parent / "dagster-daemon"), "run", "-w", "workspace.yaml"],
            env=env,
            cwd=REPO_ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            statuses = _wait_for_runs(instance, "daily_data_job", timeout_s=1200)
            failed = [
                r.run_id
                for r in instance.get_runs(dg.RunsFilter(job_name="daily_data_job"))
                if r.status != dg.DagsterRunStatus.SUCCESS
            ]
            errors = [
                str(e.dagster_event.event_specific_data)[:800]
                for run_id in failed[:2]
                for e in instance.all_logs(run_id)
                if e.dagster_event and e.dagster_event.is_failure
            ]
            assert statuses == {d: dg.DagsterRunStatus.SUCCESS for d in DAYS}, (statuses, errors)
            assert len(instance.get_runs(dg.RunsFilter(job_name="daily_data_job"))) == len(DAYS), (
                "a run was duplicated"
            )
            for asset in ("raw_documents", "teacher_samples", "filtered_samples", "rejected_samples"):
                assert instance.get_materialized_partitions(dg.AssetKey(asset)) == set(DAYS), asset
            # the queue held them: never more than the limit running at once, and the limit reached
            records = list(instance.get_run_records(dg.RunsFilter(job_name="daily_data_job")))
            assert _most_at_once(records) == _backfill_limit() < len(DAYS), [
                (r.start_time, r.end_time) for r in records
            ]
        finally:
            os.killpg(daemon.pid, signal.SIGTERM)
            daemon.wait(timeout=60)
            instance.dispose()

    raw = _read_partitions(data, "raw_documents")
    assert {day: len(frame) for day, frame in raw.items()} == counts, "documents lost"
    assert pd.concat(raw.values())["doc_id"].is_unique, "documents duplicated"

    teacher = _read_partitions(data, "teacher_samples")
    generations = load_scale().generations_per_prompt
    for day, frame in teacher.items():
        assert frame["error"].isna().all(), (day, frame["error"].dropna().tolist()[:3])
        assert sorted(frame["doc_id"]) == sorted(raw[day]["doc_id"].repeat(generations)), (
            f"answers lost on {day}"
        )
    assert sorted(teacher) == DAYS and pd.concat(teacher.values())["sample_id"].is_unique, (
        "answers duplicated"
    )

    kept, rejected = _read_partitions(data, "filtered_samples"), _read_partitions(data, "rejected_samples")
    for day in DAYS:
        judged = list(kept[day]["sample_id"]) + list(rejected[day]["sample_id"])
        assert sorted(judged) == sorted(teacher[day]["sample_id"]), f"a verdict lost or doubled on {day}"

    rows = _psql(
        pg,
        "SELECT count(*) FROM event_logs WHERE asset_key = '[\"teacher_samples\"]' "
        "AND dagster_event_type = 'ASSET_MATERIALIZATION'",
    )
    assert rows[0][0] == len(DAYS)
