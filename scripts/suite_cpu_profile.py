"""Where a command's CPU goes, by kind of process and by the test that started it: ``python
scripts/suite_cpu_profile.py -- make test``.

Why: the suite is CPU-bound on 2 cores (issue 49), and pytest's ``--durations`` gives wall seconds, which on a loaded
machine say little about cost: a test that waits on a timer and one that compiles C++ can take the same time. This
samples every process started after the command, once a ``--interval`` (1 s): its CPU seconds (user + system, the
last value seen is its total, short of the last interval), its command line, and the test that started it.
Processes are matched by start time, not by ancestry, so the ones that daemonize or are re-parented to init (forked
workers, engines' children) are counted too; a process that lives less than an interval is missed. The machine's
idle share comes from ``/proc/stat`` over the same run.

The test that started a process, the first of these that says (its row's ``by``):
* ``timeline``: with ``--timeline FILE`` (what ``pytest -p support.timeline --timeline=FILE`` wrote in the same run),
  the test its pytest process was running when the process started, that pytest process found among the process's
  ancestors when it was first seen. A start time is known to a clock tick (10 ms), and the skew measured with it
  (below): the start is read two ticks late, so that a process a test starts in its first milliseconds (a bench's
  subprocess, a fixture's server) is its own and not the phase's before; one started in a phase's last 20 ms goes to
  the next (a phase's end stops processes more than it starts them). The product starts its engines, workers and
  Dagster processes with a filtered environment that carries no ``PYTEST_CURRENT_TEST``, and a warm Python forks a
  child for a later test than the one that started it: 2,104 of the suite's 3,999 CPU-s went to no test without
  this (the run at ``3f8ce5d``), 427 of 3,956 with it;
* ``environment``: the ``PYTEST_CURRENT_TEST`` its environment inherited;
* ``parent``: the test of the nearest ancestor already seen with one.

It prints a table of process kinds, the 25 tests whose processes cost the most (with ``--timeline``, plus each
test's CPU in its own pytest process; and the 25 slowest tests with their CPU), and one JSON object last. The
command's exit code is this script's.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from bisect import bisect_right
from collections import defaultdict
from pathlib import Path
from typing import Any

import psutil

# (kind, pattern on the command line): the first match names a process
# (execnet's bootstrap is how pytest-xdist starts its workers: ``python -u -c "import sys;exec(eval(sys.stdin.
# readline()))"``, no word of pytest on the line; 289 CPU-s of the clean-clone suite at 3376a9d were filed as
# "other python" before it was named here. An install comes before vLLM: the vLLM environment's pip and its
# byte-compiling probe name vllm, and were 99 CPU-s of "vLLM engine" in the same run. vLLM is named by its
# environment, modules and process titles, not the bare word: `bench/rl.py --vllm no` runs no vLLM.)
KINDS = [
    ("pytest worker", r"pytest-xdist|/pytest |-m pytest|exec\(eval\(sys\.stdin\.readline\(\)\)\)"),
    ("install (pip, byte-compiling)", r"-m pip |compileall"),
    ("compiler (C++)", r"cc1plus|/g\+\+ |/c\+\+ |ninja"),
    ("vLLM engine", r"vllm[-_.]|/vllm\b|VLLM::"),
    ("transformers serve", r"transformers serve|transformers_engine"),
    ("training worker", r"core\.training\.worker|torch\.distributed\.run"),
    ("evaluation worker", r"core\.evaluation\.worker"),
    ("dagster / dg CLI or daemon", r"dagster|/dg |nexa_dagster\.cli"),
    ("multiprocessing child", r"spawn_main|forkserver"),
    ("services (PostgreSQL, Slurm, HAProxy, Chromium)", r"postgres|slurm|haproxy|chromium"),
]


def kind_of(argv: list[str]) -> str:
    """The first kind whose pattern the command line matches; else "other python" for a Python program itself
    (not a shell whose command mentions one), else "other"."""
    cmdline = " ".join(argv)
    found = next((kind for kind, pattern in KINDS if re.search(pattern, cmdline)), None)
    if found is not None:
        return found
    return "other python" if argv and Path(argv[0]).name.startswith("python") else "other"


def idle_ticks() -> tuple[int, int]:
    """(idle + iowait, all) jiffies of the whole machine since boot."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return fields[3] + fields[4], sum(fields)


def test_of(process: psutil.Process) -> str:
    """The test whose process tree started ``process`` (its inherited environment), or ""."""
    try:
        current = process.environ().get("PYTEST_CURRENT_TEST", "")
    except (psutil.Error, OSError):
        return ""
    return current.rsplit(" ", 1)[0]  # "path::name (call)" -> "path::name"


def ancestors(process: psutil.Process) -> list[int]:
    """The pids of ``process``'s parent, its parent's parent, ... up to init, as they are now."""
    try:
        return [parent.pid for parent in process.parents()]
    except (psutil.Error, OSError):
        return []


def sample(since: float, me: int, seen: dict[tuple[int, float], dict[str, Any]]) -> None:
    live: dict[int, dict[str, Any]] = {}  # this sample's processes by pid, for a new one's ancestors' tests
    for p in psutil.process_iter(["pid", "create_time", "cmdline", "name", "cpu_times"]):
        info = p.info
        if info["pid"] == me or info["create_time"] is None or info["create_time"] < since:
            continue
        if info["cpu_times"] is None:
            continue
        key = (info["pid"], info["create_time"])
        entry = seen.get(key)
        if entry is None:
            argv = info["cmdline"] or [info["name"] or ""]
            entry = seen[key] = {
                "pid": info["pid"],  # with ancestors[0], the parent: a fork shares its parent's command line
                "cmdline": " ".join(argv)[:300],
                "kind": kind_of(argv),
                "test": test_of(p),
                "by": "environment",
                "started_s": round(info["create_time"] - since, 1),
                "created": info["create_time"],
                "ancestors": ancestors(p),
            }
            if not entry["test"]:  # the nearest ancestor seen with a test (parents come first in pid order)
                known = (live.get(pid) for pid in entry["ancestors"])
                entry["test"] = next((a["test"] for a in known if a is not None and a["test"]), "")
                entry["by"] = "parent" if entry["test"] else ""
        live[info["pid"]] = entry
        entry["cpu"] = info["cpu_times"].user + info["cpu_times"].system
        # how long it lived (to the last sample that saw it): a long life at little CPU is a process that idles
        entry["lived_s"] = round(time.time() - info["create_time"], 1)


CLOCK_TICK_S = 0.01  # the resolution of a process's start time in /proc (USER_HZ = 100)


def attribute_by_timeline(
    seen: dict[tuple[int, float], dict[str, Any]], timeline: list[dict[str, Any]], skew: float = 0.0
) -> None:
    """Each process descending from a pytest process of ``timeline`` (its rows' ``pid``) given to the test that
    pytest process was running when it started: the last phase that had begun by then (a module's fixture starts in
    the set-up of its first test; a process started after a phase ended, by its teardown's leftovers, is still that
    test's). ``skew``: how far psutil's start times run ahead of the clock the timeline was written by."""
    phases: dict[int, list[tuple[float, str]]] = defaultdict(list)  # pid -> (start, test), by start
    for row in sorted(timeline, key=lambda row: row["start"]):
        if row.get("pid"):
            phases[row["pid"]].append((row["start"], row["nodeid"]))
    starts = {pid: [start for start, _ in rows] for pid, rows in phases.items()}
    for entry in seen.values():
        runner = next((pid for pid in entry["ancestors"] if pid in phases), None)
        if runner is None:
            continue
        i = bisect_right(starts[runner], entry["created"] - skew + 2 * CLOCK_TICK_S) - 1
        if i >= 0:
            entry["test"], entry["by"] = phases[runner][i][1], "timeline"


def own_cpu(timeline: list[dict[str, Any]]) -> dict[str, float]:
    """Each test's CPU in its own pytest process, its phases summed (``support/timeline.py``'s ``cpu_s``)."""
    cpu: dict[str, float] = defaultdict(float)
    for row in timeline:
        cpu[row["nodeid"]] += row.get("cpu_s") or 0.0
    return cpu


def wall_seconds(timeline: list[dict[str, Any]]) -> dict[str, float]:
    """Each test's wall seconds, its set-up, call and teardown summed: a module fixture's build counts to the first
    test that uses it, as pytest's ``--durations`` and junit's ``time`` count it."""
    wall: dict[str, float] = defaultdict(float)
    for row in timeline:
        wall[row["nodeid"]] += row["stop"] - row["start"]
    return wall


def summarize(
    seen: dict[tuple[int, float], dict[str, Any]],
    wall_s: float,
    idle_share: float,
    in_pytest: dict[str, float] | None = None,
    walls: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The kinds' and the tests' CPU; with ``walls`` (from a timeline) also ``slowest``: the 25 tests that took the
    longest, each with its CPU, since a test that waits on a timer and one that computes take the same wall time
    and not the same CPU (docs/testing.md's list of the slowest tests is this table)."""
    kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    tests: dict[str, float] = defaultdict(float, in_pytest or {})
    for entry in seen.values():
        kinds[entry["kind"]][0] += 1
        kinds[entry["kind"]][1] += entry.get("cpu", 0.0)
        if entry["test"] and entry["kind"] != "pytest worker":  # a worker's CPU is every test's it ran
            tests[entry["test"]] += entry.get("cpu", 0.0)
    total = sum(cpu for _, cpu in kinds.values())
    return {
        "wall_s": round(wall_s, 1),
        "cores": psutil.cpu_count(),
        "idle_share": round(idle_share, 3),
        "processes": len(seen),
        "cpu_s": round(total, 1),
        "kinds": {
            k: {"processes": int(n), "cpu_s": round(c, 1), "share": round(c / total, 3) if total else 0.0}
            for k, (n, c) in sorted(kinds.items(), key=lambda kv: -kv[1][1])
        },
        "unattributed_cpu_s": round(sum(e.get("cpu", 0.0) for e in seen.values() if not e["test"]), 1),
        "tests": {t: round(c, 1) for t, c in sorted(tests.items(), key=lambda kv: -kv[1])[:25]},
        "slowest": [
            {"test": t, "s": round(s, 1), "cpu_s": round(tests.get(t, 0.0), 1)}
            for t, s in sorted((walls or {}).items(), key=lambda kv: -kv[1])[:25]
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between two samples")
    parser.add_argument("--out", type=Path, help="also write the JSON summary there")
    parser.add_argument(
        "--processes",
        type=Path,
        help="also write every process there, one JSON object a line (its command line, kind, test, CPU-s, "
        "start after the command's and life in seconds): what a kind's total is made of",
    )
    parser.add_argument(
        "--timeline",
        type=Path,
        help="the file `pytest -p support.timeline --timeline=FILE` writes in the same run: processes given to "
        "the test their pytest process was running when they started, and each test's own CPU added",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: python scripts/suite_cpu_profile.py -- make test")
    seen: dict[tuple[int, float], dict[str, Any]] = {}
    since, (idle0, all0) = time.time() - 1.0, idle_ticks()
    started, launched = time.monotonic(), time.time()
    proc, me = subprocess.Popen(command), psutil.Process().pid
    # a process's start time as psutil reads it (boot time, a whole second, plus the jiffies since) is off the
    # clock's by up to a second: measured on the command's own start, and taken off every process's
    skew = psutil.Process(proc.pid).create_time() - launched
    while proc.poll() is None:
        sample(since, me, seen)
        time.sleep(args.interval)
    idle1, all1 = idle_ticks()
    in_pytest = walls = None
    if args.timeline and args.timeline.exists():
        timeline = [json.loads(line) for line in args.timeline.read_text().splitlines() if line.strip()]
        attribute_by_timeline(seen, timeline, skew)
        in_pytest, walls = own_cpu(timeline), wall_seconds(timeline)
    idle_share = (idle1 - idle0) / max(1, all1 - all0)
    summary = summarize(seen, time.monotonic() - started, idle_share, in_pytest, walls)
    print(
        f"\n{' '.join(command)}: {summary['wall_s']} s wall, {summary['cpu_s']} CPU-s in {summary['processes']} "
        f"processes started by it, the machine {summary['idle_share']:.0%} idle"
    )
    print(f"{'CPU-s':>9} {'share':>6} {'procs':>6}  kind")
    for kind, row in summary["kinds"].items():
        print(f"{row['cpu_s']:9.1f} {row['share']:6.1%} {row['processes']:6d}  {kind}")
    own = (
        "its own pytest process's CPU included"
        if in_pytest is not None
        else "its pytest process's own not counted"
    )
    print(
        f"\n{'CPU-s':>9}  the processes a test started ({own}; {summary['unattributed_cpu_s']} CPU-s to no test)"
    )
    for test, cpu in summary["tests"].items():
        print(f"{cpu:9.1f}  {test}")
    if summary["slowest"]:
        print(f"\n{'s':>9} {'CPU-s':>9}  the slowest tests (set-up, call and teardown)")
        for row in summary["slowest"]:
            print(f"{row['s']:9.1f} {row['cpu_s']:9.1f}  {row['test']}")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))
    if args.processes:
        rows = sorted(seen.values(), key=lambda e: -e.get("cpu", 0.0))
        args.processes.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(json.dumps(summary))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
