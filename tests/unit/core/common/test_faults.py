"""The fault hooks (core/common/faults.py) a fault test arms through one environment variable of the process it
starts: armed after the module was imported, as in a worker forked from a warm Python that imported it under its
own environment (core/cluster/warm_python.py), the fault still strikes; disarmed, nothing does."""

from __future__ import annotations

import time

import pytest

from nexa_dagster.core.common import faults


def test_a_fault_armed_after_the_import_strikes_at_its_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faults.NAN_AT_STEP, raising=False)
    assert not faults.fault_point(faults.NAN_AT_STEP, step=3)
    monkeypatch.setenv(faults.NAN_AT_STEP, "3")  # after the import, as a forked worker's environment
    assert faults.fault_point(faults.NAN_AT_STEP, step=3)
    assert not faults.fault_point(faults.NAN_AT_STEP, step=2)
    assert not faults.fault_point(faults.STALL_AT_STEP, step=3)  # another fault, not armed
    with pytest.raises(ValueError, match="unknown fault"):
        faults.fault_env("NEXA_FAULT_NOPE", 1)


def test_a_step_pause_sleeps_its_seconds_at_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faults.STEP_PAUSE, raising=False)
    started = time.monotonic()
    assert not faults.fault_point(faults.STEP_PAUSE, step=1)
    assert time.monotonic() - started < 0.1  # disarmed: no pause
    monkeypatch.setenv(faults.STEP_PAUSE, "0.3")
    for step in (1, 2):  # every step, not one armed step
        started = time.monotonic()
        assert faults.fault_point(faults.STEP_PAUSE, step=step)
        assert time.monotonic() - started >= 0.3
