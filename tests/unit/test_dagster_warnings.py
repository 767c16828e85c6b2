"""The warnings a user sees are the ones that mean something: loading the code location prints no beta or preview
warning (the beta APIs the project chose are filtered in nexa_dagster/dagster_warnings.py, by exact message), and
a beta API it did not choose still warns."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import dagster as dg

from nexa_dagster.core.common.config import REPO_ROOT
from nexa_dagster.dagster_warnings import filter_known_beta_warnings, known_warnings


def test_loading_the_code_location_prints_no_beta_or_preview_warning() -> None:
    # a fresh interpreter that shows every warning each time (-W always), as a `dagster` command loading it would
    proc = subprocess.run(
        [sys.executable, "-W", "always", "-c", "import nexa_dagster.definitions"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    shown = [line for line in proc.stderr.splitlines() if "BetaWarning" in line or "PreviewWarning" in line]
    assert not shown, "\n".join(shown)


def test_only_the_chosen_beta_apis_are_silenced() -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        filter_known_beta_warnings()
        for message, category in known_warnings():
            warnings.warn(
                message.replace("\\", "") + ", and may have breaking changes", category, stacklevel=1
            )
        warnings.warn("Function `some_new_api` is currently in beta", dg.BetaWarning, stacklevel=1)
        warnings.warn(
            "Parameter `backfill_policy` of function `asset` is currently in beta", UserWarning, stacklevel=1
        )
    assert [str(w.message) for w in seen] == [
        "Function `some_new_api` is currently in beta",
        "Parameter `backfill_policy` of function `asset` is currently in beta",
    ]


def test_dg_check_defs_loads_the_code_location_without_a_warning(tmp_path: Path) -> None:
    """`dg check defs` (docs/operations.md): dagster-dg-cli is installed with the dev extra and [tool.dg] in
    pyproject.toml points it at the code location. Under a Dagster home holding the project's dagster.yaml, as
    `make home` makes one, not the checkout's `.dagster_home`: on a fresh checkout that has none until `make run`,
    `make lint` or `make ui`, and Dagster warns of the missing file (make test-fast failed so on a fresh machine)."""
    dg_cli = Path(sys.executable).parent / "dg"
    shutil.copy(REPO_ROOT / "dagster.yaml", tmp_path / "dagster.yaml")
    proc = subprocess.run(
        [str(dg_cli), "check", "defs"],
        cwd=REPO_ROOT,
        env={**os.environ, "DAGSTER_HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "All definitions loaded successfully" in out, out
    assert "warning" not in out.lower(), out
