"""`make run` (nexa_dagster/demo.py): what a killed run leaves behind is cleared by the next one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg

from nexa_dagster.core.config import REPO_ROOT
from nexa_dagster.core.process_token import process_token, token_alive
from nexa_dagster.demo import LAUNCHER_TAG, fail_orphaned_runs

STUCK_RUN = """
import sys, time
import dagster as dg
from nexa_dagster.core.process_token import process_token
from nexa_dagster.demo import LAUNCHER_TAG

@dg.op
def wait_forever() -> None:
    open(sys.argv[1], "w").write("started")
    time.sleep(600)

@dg.job
def stuck() -> None:
    wait_forever()

stuck.execute_in_process(instance=dg.DagsterInstance.get(), tags={LAUNCHER_TAG: process_token()})
"""


def test_a_run_killed_under_make_run_is_failed_by_the_next_one(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    marker = tmp_path / "started"
    proc = subprocess.Popen([sys.executable, "-c", STUCK_RUN, str(marker)], cwd=REPO_ROOT,
                            env={**os.environ, "DAGSTER_HOME": str(home)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the run never started"
            time.sleep(0.2)
        token = process_token(proc.pid)
        assert token_alive(token) is True
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # no goodbye: the run cannot record its end
    # dead even before its parent reaps it (a zombie, as a killed `make run` under a shell can stay for a while)
    deadline = time.monotonic() + 10
    while token_alive(token) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert token_alive(token) is False and Path(f"/proc/{proc.pid}").exists()
    proc.wait()
    assert token_alive(token) is False

    instance = dg.DagsterInstance.from_config(str(home))
    (killed,) = instance.get_runs()
    assert killed.status == dg.DagsterRunStatus.STARTED  # what the instance showed forever before
    # runs that are not ours to judge: one whose `make run` is alive (this process), one without the tag
    alive = dg.DagsterRun(job_name="stuck", run_id="a" * 36, status=dg.DagsterRunStatus.STARTED,
                          tags={LAUNCHER_TAG: process_token()})
    untagged = dg.DagsterRun(job_name="stuck", run_id="b" * 36, status=dg.DagsterRunStatus.STARTED)
    instance.add_run(alive)
    instance.add_run(untagged)

    assert fail_orphaned_runs(instance) == [killed.run_id]
    status = {r.run_id: r.status for r in instance.get_runs()}
    assert status == {killed.run_id: dg.DagsterRunStatus.FAILURE, alive.run_id: dg.DagsterRunStatus.STARTED,
                      untagged.run_id: dg.DagsterRunStatus.STARTED}
    failure = instance.all_logs(killed.run_id, of_type=dg.DagsterEventType.RUN_FAILURE)[0]
    assert "the `make run` process that executed this run" in failure.message
    assert fail_orphaned_runs(instance) == []  # done once
