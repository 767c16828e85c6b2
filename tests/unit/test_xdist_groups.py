"""The suite's xdist groups hold: tests marked with one ``xdist_group`` run on one worker, and a dropped mark is
caught (tests/support/xdist_groups.py)."""

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from support.xdist_groups import ungrouped

GROUPED = """
import os
import pytest

pytestmark = pytest.mark.xdist_group("shared")


@pytest.fixture(scope="module")
def built():
    with open(os.environ["SETUPS"], "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")


@pytest.mark.parametrize("n", range(6))
def test_reads(built, n):
    pass


@pytest.mark.parametrize("n", range(6))
@pytest.mark.xdist_group("free")
def test_elsewhere(n):
    pass
"""


def test_one_group_runs_on_one_worker_and_builds_its_module_fixture_once(tmp_path: Path) -> None:
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    setups = tmp_path / "setups.txt"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "2",
            "--dist",
            "loadgroup",
            "-p",
            "no:cacheprovider",
            ".",
        ],
        cwd=tmp_path,
        # a pytest of its own: options meant for the suite (PYTEST_ADDOPTS, e.g. the timeline plugin) stay out
        env={**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}, "SETUPS": str(setups)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert len(setups.read_text().split()) == 1, "the module-scoped fixture was built on each worker"


@dataclass
class _Item:
    nodeid: str
    groups: list[str] = field(default_factory=list)

    def iter_markers(self, name: str):
        return (
            iter(pytest.mark.xdist_group(g).mark for g in self.groups) if name == "xdist_group" else iter(())
        )


def test_a_group_mark_pytest_xdist_dropped_is_reported() -> None:
    items = [
        _Item("tests/e2e/test_pipeline.py::test_a@lifecycle", ["lifecycle"]),
        _Item("tests/e2e/test_pipeline.py::test_b", ["lifecycle"]),  # marked, not grouped
        _Item("tests/unit/test_x.py::test_c[a@b]"),  # an '@' in a parameter id is not a group
    ]
    assert ungrouped(items) == ["tests/e2e/test_pipeline.py::test_b"]
    assert ungrouped([_Item("t.py::test[user@host]", ["g"])]) == ["t.py::test[user@host]"]
