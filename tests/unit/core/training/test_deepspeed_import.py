"""``import_deepspeed``: DeepSpeed without the MLflow import its autotuner makes (a training worker's start-up),
and nothing else changed: ``mlflow`` is importable afterwards, and a process that already has it keeps it."""

from __future__ import annotations

import subprocess
import sys

from nexa_dagster.core.common.config import REPO_ROOT

PROBE = """
import sys
{before}
from nexa_dagster.core.training.loop import import_deepspeed
deepspeed = import_deepspeed()
import deepspeed.autotuning.autotuner as autotuner
print(int("mlflow" in sys.modules), int(autotuner.has_mlflow), int(deepspeed.initialize is not None))
import mlflow
print(int(hasattr(mlflow, "start_run")))
"""


def _probe(before: str = "") -> list[str]:
    return subprocess.run(
        [sys.executable, "-c", PROBE.format(before=before)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin", "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1"},
    ).stdout.split()


def test_deepspeed_comes_without_mlflow_which_stays_importable() -> None:
    assert _probe() == ["0", "0", "1", "1"]


def test_a_process_that_imported_mlflow_first_keeps_it() -> None:
    assert _probe("import mlflow") == ["1", "1", "1", "1"]
