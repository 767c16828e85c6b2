"""A world of its own for one pipeline run in a temporary directory, and the environment that points at it.

Tests that run the code location in another process (`dagster asset materialize`, `dagster dev`, the daemon) need
the same layout: landing days copied from `sample_data/`, a Dagster home with the project's instance settings,
and data and results roots, all under one root, so that two runs side by side never share a file.
"""

import os
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

from nexa_dagster.core.common.config import REPO_ROOT
from nexa_dagster.core.common.faults import KILL_BEFORE_RENAME as FAULT_KILL_ENV
from nexa_dagster.core.tiny.install import install_tiny_models

# The three sample days with a dozen documents each, in the same formats (sample_data/landing holds ~280 a day, for
# make run's gate to decide on enough evidence; a test that needs that many reads sample_data/ itself).
# Regenerate: python -m nexa_dagster.core.data.sample_corpus tests/data/landing 12
SAMPLE_LANDING = REPO_ROOT / "tests" / "data" / "landing"


def make_sandbox(
    root: Path,
    days: Iterable[str] = (),
    settings: Path = REPO_ROOT / "dagster.yaml",
    extra_settings: str = "",
    landing: Path = SAMPLE_LANDING,
) -> Path:
    """``root/landing/<day>`` for each sample day (from ``landing``: the small test copy unless a test needs
    make run's own days), ``root/home/dagster.yaml`` and the tiny models the configuration names
    (``nexa-dagster tiny-models``, as ``make run`` installs them); returns ``root``."""
    install_tiny_models([root / "data" / "models" / "tiny-teacher"])
    for day in days:
        shutil.copytree(landing / day, root / "landing" / day)
    (root / "home").mkdir(parents=True)
    (root / "home" / "dagster.yaml").write_text(settings.read_text() + extra_settings)
    return root


def sandbox_env(root: Path, fault: str | None = None, **overrides: str) -> dict[str, str]:
    """This process's environment pointed at ``root``: its Dagster home, data, results and landing roots.

    ``fault`` arms the kill-before-rename fault point (a glob of the path to die on); an inherited one is dropped,
    so a run is never killed by accident. The venv's ``bin`` comes first on PATH, so the `dagster` command a
    subprocess starts (the daemon's run workers, `dagster dev`'s code server) is this project's.
    """
    env = {
        **os.environ,
        "DAGSTER_HOME": str(root / "home"),
        "NEXA_DATA_ROOT": str(root / "data"),
        "NEXA_RESULTS_ROOT": str(root / "results"),
        "NEXA_LANDING_ROOT": str(root / "landing"),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    env.pop(FAULT_KILL_ENV, None)
    if fault:
        env[FAULT_KILL_ENV] = fault
    return {**env, **overrides}


def materialize_command(select: str, partition: str | None = None, *extra: str) -> list[str]:
    """``dagster asset materialize`` of the code location, as an operator runs it, with this interpreter (run it
    with ``cwd=REPO_ROOT`` and ``env=sandbox_env(root)``)."""
    return [
        sys.executable,
        "-m",
        "dagster",
        "asset",
        "materialize",
        "-m",
        "nexa_dagster.definitions",
        "--select",
        select,
        *(["--partition", partition] if partition else []),
        *extra,
    ]
