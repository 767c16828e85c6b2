"""tests/support/timeline.py: each test phase's wall times and the CPU its pytest process spent in it, through
pytest-xdist's workers to the controller's file (a test that waits and one that computes take the same wall time
and not the same CPU, which is what a CPU-bound suite pays)."""

from __future__ import annotations

import json
from pathlib import Path

from support.inner_pytest import inner_pytest

TESTS = """
import os
import time
from pathlib import Path

def test_computes():
    Path("test_computes.pid").write_text(str(os.getpid()))
    end = time.process_time() + 0.4
    while time.process_time() < end:
        pass

def test_waits():
    Path("test_waits.pid").write_text(str(os.getpid()))
    time.sleep(0.4)
"""


def test_a_phase_that_computes_is_told_from_one_that_waits_through_xdist(tmp_path: Path) -> None:
    (tmp_path / "test_two.py").write_text(TESTS)
    timeline = tmp_path / "timeline.jsonl"
    proc = inner_pytest(tmp_path, "-n", "2", "-p", "support.timeline", f"--timeline={timeline}", ".")
    calls = {
        line["nodeid"].split("::")[1]: line
        for line in map(json.loads, timeline.read_text().splitlines())
        if line["phase"] == "call"
    }
    for name in ("test_computes", "test_waits"):
        assert calls[name]["stop"] - calls[name]["start"] >= 0.35, calls[name]  # both take the wall time
        assert calls[name]["worker"].startswith("gw"), calls[
            name
        ]  # run on a worker, written by the controller
        # the process that ran it, which scripts/suite_cpu_profile.py finds among a process's ancestors
        assert calls[name]["pid"] == int((tmp_path / f"{name}.pid").read_text()), calls[name]
    assert calls["test_computes"]["cpu_s"] >= 0.35, calls
    assert calls["test_waits"]["cpu_s"] < 0.1, calls
    assert "timeline:" in proc.stdout
