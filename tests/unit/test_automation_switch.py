"""`make ui AUTOMATION=off` (``NEXA_AUTOMATION=off``): the schedule and every sensor start stopped; by default
they start running (a deployment's nightly retrain needs no one to turn it on); a typo fails the load."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nexa_dagster.core.common.config import REPO_ROOT

PRINT_STATUSES = """
from nexa_dagster.definitions import defs
for d in [*defs.sensors, *defs.schedules]:
    print(d.name, d.default_status.value)
"""


def _statuses(automation: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NEXA_AUTOMATION"}
    if automation is not None:
        env["NEXA_AUTOMATION"] = automation
    return subprocess.run(
        [sys.executable, "-c", PRINT_STATUSES],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("automation", "expected"), [(None, "RUNNING"), ("on", "RUNNING"), ("off", "STOPPED")]
)
def test_the_schedule_and_sensors_follow_nexa_automation(automation: str | None, expected: str) -> None:
    proc = _statuses(automation)
    assert proc.returncode == 0, proc.stderr
    statuses = dict(line.split() for line in proc.stdout.splitlines())
    assert "nightly_retrain" in statuses and "automation_sensor" in statuses and len(statuses) >= 6, statuses
    assert set(statuses.values()) == {expected}, statuses


def test_a_typo_fails_the_load_naming_the_variable() -> None:
    proc = _statuses("of")
    assert proc.returncode != 0 and "NEXA_AUTOMATION='of': expected on or off" in proc.stderr, proc.stderr
