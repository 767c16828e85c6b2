"""Where the suite's wall time goes: ``pytest -p support.timeline --timeline=FILE`` appends one JSON line per test
phase (worker, node id, phase, start, end, ``cpu_s``: the CPU its pytest process spent in it, and ``pid``: that
process) and prints, at the end, each worker's busy time and how long the last worker ran alone (the tail an
ordering change could save). docs/testing.md, "Suite time".

``cpu_s`` is the test's own work in its pytest process (an in-process Dagster run, a client's requests); what it
starts in other processes is ``scripts/suite_cpu_profile.py``'s to count, so the two together say what a test costs
a CPU-bound suite. Given this file (``--timeline``), the profiler gives a process to the test its pytest process
(``pid``, found among the process's ancestors) was running when the process started."""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--timeline", default=None, help="append each test phase's start and end to this JSON-lines file"
    )


_PATH: Path | None = None  # the file the controller (or a lone process) writes; workers only report


def pytest_configure(config: pytest.Config) -> None:
    global _PATH
    if not hasattr(config, "workerinput") and config.getoption("timeline"):
        _PATH = Path(config.getoption("timeline"))


_MARK: dict[str, float] = {}  # this process's CPU clock at the end of the last phase it ran


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:  # noqa: ARG001
    """On the process that runs the test: its CPU clock when the test starts."""
    _MARK["cpu"] = time.process_time()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:  # noqa: ARG001
    """After each phase, on the process that ran it: the CPU it spent since the phase before (or the test's start)
    and its pid, carried to the controller in the report's ``user_properties`` (what pytest-xdist serializes)."""
    report: pytest.TestReport = yield
    if item.config.getoption("timeline"):
        now = time.process_time()
        report.user_properties.append(("cpu_s", round(now - _MARK.get("cpu", now), 3)))
        report.user_properties.append(("pid", os.getpid()))
        _MARK["cpu"] = now
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """On the controller (or a lone process): every phase's report carries its start and stop times."""
    if _PATH is None:
        return
    node = getattr(
        report, "node", None
    )  # set by pytest-xdist on the controller: the worker that ran the test
    props = dict(report.user_properties)
    line = {
        "worker": node.gateway.id if node is not None else os.environ.get("PYTEST_XDIST_WORKER", "main"),
        "nodeid": report.nodeid,
        "phase": report.when,
        "outcome": report.outcome,
        "start": report.start,
        "stop": report.stop,
        "cpu_s": props.get("cpu_s"),
        "pid": props.get("pid"),
    }
    with _PATH.open("a") as f:
        f.write(json.dumps(line) + "\n")


def summarize(lines: list[dict]) -> dict:
    """Busy seconds per worker, the span of the whole run, and the seconds the last worker ran alone."""
    busy: dict[str, float] = defaultdict(float)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for line in lines:
        w = line["worker"]
        busy[w] += line["stop"] - line["start"]
        first[w] = min(first.get(w, line["start"]), line["start"])
        last[w] = max(last.get(w, line["stop"]), line["stop"])
    ends = sorted(last.values())
    return {
        "span_s": round(max(ends) - min(first.values()), 1),
        "busy_s": {w: round(s, 1) for w, s in sorted(busy.items())},
        "tail_alone_s": round(ends[-1] - ends[-2], 1) if len(ends) > 1 else 0.0,
    }


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:  # noqa: ANN001
    if _PATH is not None and _PATH.exists():
        lines = [json.loads(x) for x in _PATH.read_text().splitlines()]
        terminalreporter.write_line(f"timeline: {json.dumps(summarize(lines))}")
