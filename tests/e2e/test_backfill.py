"""A multi-run backfill from the command line, run by the real Dagster daemon through the run queue."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
from support.sandbox import make_sandbox, sandbox_env

from nexa_dagster.core.common.config import REPO_ROOT

DAYS = ["2026-11-20", "2026-11-21"]


def test_dagster_job_backfill_queues_one_run_per_day_and_the_daemon_runs_them(tmp_path: Path) -> None:
    make_sandbox(tmp_path, DAYS)
    home, env = tmp_path / "home", sandbox_env(tmp_path)

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
        DAYS[1],
        "--noprompt",
    ]
    proc = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    instance = dg.DagsterInstance.from_config(str(home))
    try:
        runs = instance.get_runs(dg.RunsFilter(job_name="daily_data_job"))
        assert sorted(r.tags["dagster/partition"] for r in runs) == DAYS
        assert all(r.tags.get("dagster/backfill") for r in runs)  # one backfill, one run per day

        # the daemon dequeues and launches them (run queue + default run launcher), as in production
        daemon = subprocess.Popen(
            [str(Path(sys.executable).parent / "dagster-daemon"), "run", "-w", "workspace.yaml"],
            env={**env, "PATH": f"{Path(sys.executable).parent}:{env['PATH']}"},
            cwd=REPO_ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                statuses = {
                    r.tags["dagster/partition"]: r.status
                    for r in instance.get_runs(dg.RunsFilter(job_name="daily_data_job"))
                }
                if all(
                    s in (dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE) for s in statuses.values()
                ):
                    break
                time.sleep(2)
        finally:
            os.killpg(daemon.pid, signal.SIGTERM)
            daemon.wait(timeout=60)
        assert statuses == {d: dg.DagsterRunStatus.SUCCESS for d in DAYS}, statuses
        for key in ("raw_documents", "teacher_samples", "filtered_samples", "rejected_samples"):
            assert instance.get_materialized_partitions(dg.AssetKey(key)) == set(DAYS), key
        for run in instance.get_runs(
            dg.RunsFilter(job_name="daily_data_job")
        ):  # the in-process executor: one
            starts = instance.all_logs(run.run_id, of_type=dg.DagsterEventType.STEP_START)  # process per run
            assert len(starts) >= 3 and len({e.dagster_event.pid for e in starts}) == 1, run.run_id
    finally:
        instance.dispose()
