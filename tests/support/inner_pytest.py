"""A pytest of its own in a test's folder, for the tests of the suite's own tooling (the timeline plugin, the CPU
profiler): the suite's options (``PYTEST_ADDOPTS``) and the outer test's ``PYTEST_CURRENT_TEST`` stay out, and
``support/`` is importable as in the suite."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from nexa_dagster.core.common.config import REPO_ROOT


def inner_pytest(cwd: Path, *args: str, under: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    """``python -m pytest -q -p no:cacheprovider ARGS`` in ``cwd``, after ``under`` (a command that runs it, such
    as the profiler and its ``--``); asserts it passed and returns it."""
    proc = subprocess.run(
        [*under, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        env={
            **{k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST")},
            "PYTHONPATH": str(REPO_ROOT / "tests"),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc
