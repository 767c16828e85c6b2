"""The production instance: PostgreSQL storage (configs/dagster/production.yaml), the run queue and the daemon.

A real PostgreSQL server is started for this module (tests/services.py); Dagster's schema is created in it by
Dagster itself, and every check reads back through Dagster and straight from the database.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
from services import postgres_server

from nexa_dagster.core.config import REPO_ROOT

DAYS = [f"2026-11-{d:02d}" for d in range(1, 21)]  # 20 daily partitions


@pytest.fixture(scope="module")
def pg() -> Iterator[dict[str, str]]:
    with postgres_server() as env:
        yield env


def _home(tmp_path: Path, pg: dict[str, str]) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(REPO_ROOT / "configs" / "dagster" / "production.yaml", home / "dagster.yaml")
    os.environ["DAGSTER_PG_URL"] = pg["DAGSTER_PG_URL"]  # the instance config reads it from the environment
    return home


def _psql(pg: dict[str, str], sql: str) -> str:
    import psycopg2

    with psycopg2.connect(host=pg["host"], port=int(pg["port"]), user="postgres", dbname=pg["db"]) as conn, \
            conn.cursor() as cur:
        cur.execute(sql)
        return cur.fetchall()


def _landing(root: Path) -> dict[str, int]:
    """20 landing folders of distinct documents; returns how many documents each day holds."""
    counts = {}
    for i, day in enumerate(DAYS):
        (root / day).mkdir(parents=True)
        docs = [{"title": f"note {day} {j}", "text": f"Day {day}, note {j}: " + "lorem ipsum dolor " * (5 + j)}
                for j in range(3 + i % 4)]
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
            [raw_documents], partition_key=DAYS[0], instance=instance,
            resources={"io_manager": NexaIOManager(data_root=data),
                       "storage": StorageResource(data_root=data, landing_root=str(tmp_path / "landing"))})
        assert result.success
        event = instance.get_latest_materialization_event(dg.AssetKey("raw_documents"))
        assert event is not None and event.run_id == result.run_id
        assert event.asset_materialization.metadata["dagster/row_count"].value == counts[DAYS[0]]
        rows = _psql(pg, "SELECT count(*) FROM event_logs WHERE asset_key = '[\"raw_documents\"]' "
                         "AND dagster_event_type = 'ASSET_MATERIALIZATION'")
        assert rows[0][0] == 1
    finally:
        instance.dispose()


def test_twenty_partition_runs_through_the_queue_lose_and_duplicate_nothing(tmp_path: Path,
                                                                             pg: dict[str, str]) -> None:
    """`dagster job backfill` queues 20 runs; the real daemon dequeues them (8 at a time) against Postgres."""
    counts = _landing(tmp_path / "landing")
    home = _home(tmp_path, pg)
    env = {**os.environ, "DAGSTER_HOME": str(home), "NEXA_DATA_ROOT": str(tmp_path / "data"),
           "NEXA_RESULTS_ROOT": str(tmp_path / "results"), "NEXA_LANDING_ROOT": str(tmp_path / "landing"),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    cmd = [sys.executable, "-m", "dagster", "job", "backfill", "-w", "workspace.yaml", "-j", "ingest_job",
           "--from", DAYS[0], "--to", DAYS[-1], "--noprompt"]
    proc = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    instance = dg.DagsterInstance.from_config(str(home))
    daemon = subprocess.Popen([str(Path(sys.executable).parent / "dagster-daemon"), "run", "-w", "workspace.yaml"],
                              env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        deadline, statuses = time.monotonic() + 900, {}
        while time.monotonic() < deadline:
            runs = instance.get_runs(dg.RunsFilter(job_name="ingest_job"))
            statuses = {r.tags["dagster/partition"]: r.status for r in runs}
            if len(statuses) == len(DAYS) and all(s in (dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE)
                                                  for s in statuses.values()):
                break
            time.sleep(3)
        assert statuses == {d: dg.DagsterRunStatus.SUCCESS for d in DAYS}, statuses
        assert len(instance.get_runs(dg.RunsFilter(job_name="ingest_job"))) == len(DAYS), "a run was duplicated"
        assert instance.get_materialized_partitions(dg.AssetKey("raw_documents")) == set(DAYS)
    finally:
        os.killpg(daemon.pid, signal.SIGTERM)
        daemon.wait(timeout=60)
        instance.dispose()

    files = sorted((tmp_path / "data").rglob("raw_documents/*.parquet"))
    frames = {f.stem: pd.read_parquet(f) for f in files}
    assert sorted(frames) == DAYS
    assert {day: len(frame) for day, frame in frames.items()} == counts, "rows lost"
    ids = pd.concat(frames.values())["doc_id"]
    assert ids.is_unique, "rows duplicated"
    rows = _psql(pg, "SELECT count(*) FROM event_logs WHERE asset_key = '[\"raw_documents\"]' "
                     "AND dagster_event_type = 'ASSET_MATERIALIZATION'")
    assert rows[0][0] == len(DAYS) + 1  # + the first test's materialization
