"""The tests' workers fork from a warm Python (``support.worker_launch``) where a fresh process would be the same,
and start cold where it would not: without the first, the worker tests quietly pay a cold start each again (a
tiny training's ~7 s, most of it imports); without the second, a worker would run under an environment its
libraries did not import under."""

import sys

import pytest
from support.worker_launch import start_worker_process

HELP = [sys.executable, "-m", "nexa_dagster.core.training.worker", "--help"]


def test_a_worker_forks_from_the_warm_python_and_runs_as_a_fresh_one_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker = start_worker_process(HELP, env={"NEXA_FAULT_NAN_AT_STEP": "4"})  # read at run time: still forked
    out, _ = worker.communicate(timeout=300)
    assert worker.returncode == 0 and "usage: worker.py" in out, out
    assert worker.forked
    # a session fixture sets a variable after the warm Python started (the Slurm cluster's SLURM_CONF): the next
    # worker still forks, from a warm Python started again under the new environment (a full suite run caught
    # every later worker starting cold)
    monkeypatch.setenv("SLURM_CONF", "/tmp/a-cluster-started-later/slurm.conf")
    worker = start_worker_process(HELP)
    out, _ = worker.communicate(timeout=300)
    assert worker.returncode == 0 and "usage: worker.py" in out, out
    assert worker.forked


def test_a_worker_whose_import_time_environment_differs_starts_cold(capfd) -> None:  # noqa: ANN001
    # a module that starts in milliseconds cold (the decision is the same for any `python -m`)
    command = [sys.executable, "-m", "json.tool", "--help"]
    worker = start_worker_process(
        command, env={"OMP_WAIT_POLICY": "ACTIVE"}
    )  # libgomp reads it when it loads
    out, _ = worker.communicate(timeout=300)
    assert worker.returncode == 0 and "usage:" in out, out
    assert not worker.forked
    assert "starting the worker cold: its OMP_WAIT_POLICY differ" in capfd.readouterr().err
