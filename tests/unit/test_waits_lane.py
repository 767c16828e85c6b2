"""`make test`'s third worker runs the tests that wait and nothing else (tests/support/waits_lane.py): a real
`pytest -n 3` on a small suite, with and without the lane's scheduler."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from support.waits_lane import waits

from nexa_dagster.core.common.config import REPO_ROOT

SUITE = """
import os
import time

import pytest


def _ran(name):
    with open(os.environ["RAN"], "a") as f:
        f.write(f"{name} {os.environ['PYTEST_XDIST_WORKER']}\\n")


@pytest.mark.parametrize("n", range(9))
def test_computes(n):
    time.sleep(0.2)
    _ran(f"computes{n}")


@pytest.mark.parametrize("n", range(2))
@pytest.mark.xdist_group("waits")
def test_waits(n):
    time.sleep(0.2)
    _ran(f"waits{n}")


@pytest.mark.parametrize("n", range(2))
@pytest.mark.xdist_group("cluster")
@pytest.mark.xdist_group("waits")
def test_waits_in_a_group_of_its_own(n):
    _ran(f"cluster{n}")
"""


def _workers(tmp_path: Path, *options: str) -> dict[str, set[str]]:
    """Run the small suite on three workers; which worker ran which kind of test."""
    (tmp_path / "test_small.py").write_text(SUITE)
    ran = tmp_path / "ran.txt"
    ran.unlink(missing_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "3", "--dist", "loadgroup", "-p", "no:cacheprovider"]
        + ["-p", "xdist.plugin", *options, "."],
        cwd=tmp_path,
        # a pytest of its own (PYTEST_ADDOPTS is the suite's), the plugin importable as make test imports it; only
        # pytest-xdist among the installed plugins (hypothesis', typeguard's and the others' imports in each of the
        # four processes were 4 of its 5 CPU-s)
        env={
            **{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"},
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
            "RAN": str(ran),
            "PYTHONPATH": str(REPO_ROOT / "tests"),
        },
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0 and "13 passed" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    by_kind: dict[str, set[str]] = defaultdict(set)
    for line in ran.read_text().splitlines():
        name, worker = line.split()
        by_kind[name.rstrip("0123456789")].add(worker)
    return by_kind


def test_the_third_worker_runs_every_test_that_waits_and_only_those(tmp_path: Path) -> None:
    lane = _workers(tmp_path, "-p", "support.waits_lane")
    assert lane["waits"] == lane["cluster"] == {"gw2"}, dict(lane)
    assert "gw2" not in lane["computes"] and lane["computes"], dict(lane)
    # without the lane's scheduler, pytest-xdist's loadgroup gives the third worker tests that compute
    plain = _workers(tmp_path)
    assert "gw2" in plain["computes"], dict(plain)


def test_a_group_is_the_lanes_by_its_name_not_by_a_word_in_a_test_name() -> None:
    assert waits("tests/x.py::test_a@waits") and waits("tests/x.py::test_a@slurm_waits")
    assert not waits("tests/x.py::test_a@slurm") and not waits("tests/x.py::test_waits_for_it")
    assert not waits("tests/x.py::test_a[waits]@serving_endpoint")
