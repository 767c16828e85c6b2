"""Issue 49's figures from clean clones, measured the way a newcomer and CI meet the project, beside its goals
for the machine kind they ran on.

Run: python3 scripts/clean_clone_times.py [--commit REV] [--work DIR] [--suite] [--test-fast] [--no-run]

* ``make run`` (default): a ``git clone`` of the commit, every cache outside it empty (``.ci/empty_caches.sh``, as
  ``.ci/run`` sets them: pip downloads every wheel), then ``make install`` and ``make run``, each timed; the
  pipeline's seconds from the run's own summary, then ``bench/pipeline_profile.py`` on the run's instance (its
  fixed-cost share). Clone to summary is the install's and the run's wall time together.
* ``--test-fast``: ``make test-fast`` in that clone afterwards (the dev extra installed first, a step of its own:
  a contributor's first ``make test-fast`` after ``make run``).
* after ``make run`` (and ``make test-fast``): ``scripts/start_up_floor.py``, what a fresh process of each class the
  suite starts imports on this machine (its CPU-s, about two minutes): the kind's figures beside another's.
* ``--suite``: ``.ci/run`` in a second clean clone (the Debian services, the install, lint, then ``make test``, as
  CI runs it), timed whole; the suite's seconds from pytest's last line.

Per step: its wall time, the 1-minute load before it and the share of the cores idle while it ran (``/proc/stat``),
so a reader can tell an idle machine from a busy one. The machine kind is read from ``/proc/cpuinfo``: issue 49
sets goals on the 2-core AMD EPYC without AVX-512 (the slowest kind) and one on the Intel Xeon; on a kind without
goals the figures are reported with none. The last line is one JSON object.

Standard library only: it runs before any virtual environment exists, since the install is one of the things timed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
AVX2_AMD, XEON, AVX512_AMD = "AMD EPYC, AVX2 (no AVX-512)", "Intel Xeon, AVX-512", "AMD EPYC, AVX-512"
# Issue 49's goals, in seconds (the fixed costs as a share of the pipeline), by machine kind; they are the issue's,
# not chosen here. A kind not listed has none.
GOALS: dict[str, dict[str, float]] = {
    AVX2_AMD: {
        "make_run_pipeline_s": 480,
        "clone_to_summary_s": 12 * 60,
        "fixed_share": 0.30,
        "suite_s": 30 * 60,
        "test_fast_s": 5 * 60,
    },
    XEON: {"make_run_pipeline_s": 300},
}
PIPELINE = re.compile(r"tiny pipeline finished in (\d+) s \((\d+) nights\)")
PYTEST_LAST = re.compile(r"^=+ (?P<counts>.+?) in (?P<seconds>[\d.]+)s(?: \([\d:]+\))? =+$", re.MULTILINE)
COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)")


@dataclass
class Step:
    """One timed command: how long it took, whether it worked, and how busy the machine was around it."""

    name: str
    command: str
    wall_s: float = 0.0
    returncode: int | None = None
    load_before: float = 0.0
    idle_share: float | None = None
    log: str = ""
    figures: dict[str, Any] = field(default_factory=dict)


def machine_kind(cpuinfo: str) -> dict[str, Any]:
    """The machine's kind from ``/proc/cpuinfo``'s text: issue 49 tells the AMD EPYC kinds apart by AVX-512."""
    first = dict(
        (k.strip(), v.strip())
        for k, _, v in (line.partition(":") for line in cpuinfo.split("\n\n")[0].splitlines())
    )
    name, flags = first.get("model name", ""), set(first.get("flags", "").split())
    avx512 = "avx512f" in flags
    if "AMD EPYC" in name:
        kind = AVX512_AMD if avx512 else AVX2_AMD
    elif "Xeon" in name:
        kind = XEON if avx512 else f"Intel Xeon, {'AVX2' if 'avx2' in flags else 'no AVX2'}"
    else:
        kind = name or "unknown"
    return {
        "kind": kind,
        "model_name": name,
        "cpu_family": first.get("cpu family"),
        "model": first.get("model"),
        "avx512f": avx512,
        "cores": cpuinfo.count("processor\t:") or os.cpu_count(),
    }


def against_goals(kind: str, figures: dict[str, float | None]) -> dict[str, dict[str, Any]]:
    """Each figure that has a goal on ``kind``: the figure, the goal and whether it is met (at most the goal)."""
    return {
        name: {
            "value": figures.get(name),
            "goal": goal,
            "met": figures.get(name) is not None and figures[name] <= goal,
        }
        for name, goal in GOALS.get(kind, {}).items()
        if name in figures
    }


def pytest_figures(output: str) -> dict[str, Any] | None:
    """pytest's last summary line (``== 1077 passed, 5 skipped, 11 warnings in 1857.26s (0:30:57) ==``): its seconds
    and its counts; None when the output has none (pytest never reached its end)."""
    found = list(PYTEST_LAST.finditer(output))
    if not found:
        return None
    last = found[-1]
    counts = {
        word.removesuffix("s") if word in ("errors", "warnings") else word: int(n)
        for n, word in COUNT.findall(last["counts"])
    }
    return {"seconds": float(last["seconds"]), "counts": counts}


def make_run_figures(output: str) -> dict[str, Any] | None:
    """``make run``'s summary: the pipeline's seconds and nights, and the summary's lines (its decisions, which a
    reader compares with another run's); None when the run printed none."""
    found = PIPELINE.search(output)
    if found is None:
        return None
    summary = output[found.start() :].splitlines()
    return {"pipeline_s": int(found[1]), "nights": int(found[2]), "summary": summary}


def cpu_times() -> tuple[int, int]:
    """The machine's busy and idle jiffies so far (``/proc/stat``'s first line; idle includes I/O wait)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, idle


def run_step(step: Step, cwd: Path, env: dict[str, str], logs: Path) -> Step:
    """Run ``step.command`` in a shell, its output to a log file, timed; the machine's idle share over it."""
    log = logs / f"{step.name}.log"
    step.log, step.load_before = str(log), round(os.getloadavg()[0], 2)
    busy0, idle0 = cpu_times()
    start = time.monotonic()
    print(f"==> {step.name}: {step.command}", flush=True)
    with open(log, "wb") as out:
        step.returncode = subprocess.run(
            ["bash", "-c", step.command], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT
        ).returncode
    step.wall_s = round(time.monotonic() - start, 1)
    busy1, idle1 = cpu_times()
    total = (busy1 - busy0) + (idle1 - idle0)
    step.idle_share = round((idle1 - idle0) / total, 3) if total else None
    print(f"    {step.wall_s:.1f} s, rc {step.returncode}, load before {step.load_before}", flush=True)
    return step


def clean_environment(clone: Path) -> tuple[dict[str, str], Path]:
    """This process's environment with every cache pointed at a new empty folder, by ``.ci/empty_caches.sh`` (one
    list of the caches, which ``.ci/run`` sources too); the folder, for the caller to remove."""
    dump = subprocess.run(
        ["bash", "-c", 'source .ci/empty_caches.sh && echo "$caches" && env -0'],
        cwd=clone,
        check=True,
        capture_output=True,
    ).stdout.decode()
    caches, _, rest = dump.partition("\n")
    env = dict(entry.split("=", 1) for entry in rest.split("\0") if "=" in entry)
    return env, Path(caches)


def fresh_clone(commit: str, dest: Path) -> Path:
    """A ``git clone`` of this repository at ``commit`` (what is committed, nothing of the working tree)."""
    subprocess.run(["git", "clone", "-q", str(REPO), str(dest)], check=True)
    subprocess.run(["git", "-C", str(dest), "checkout", "-q", commit], check=True)
    return dest


def library_versions(clone: Path) -> dict[str, str]:
    """The versions the clone's install resolved to, of the libraries whose speed the figures depend on."""
    names = ["torch", "transformers", "deepspeed", "dagster"]
    code = f"import importlib.metadata as m; print(' '.join(m.version(n) for n in {names!r}))"
    python = clone / ".venv" / "bin" / "python"
    if not python.exists():
        return {}
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True).stdout.split()
    return dict(zip(names, out, strict=True)) if len(out) == len(names) else {}


def last_json(path: str) -> dict[str, Any] | None:
    """A bench's last line, one JSON object; None when it wrote none."""
    lines = Path(path).read_text(errors="replace").strip().splitlines()
    try:
        return json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None


def measure_make_run(clone: Path, logs: Path, test_fast: bool) -> list[Step]:
    """``make install`` and ``make run`` in ``clone`` with empty caches, the profile, and ``make test-fast``."""
    env, caches = clean_environment(clone)
    steps: list[Step] = []
    try:
        for step in (Step("install", "make install"), Step("make_run", "make run")):
            steps.append(run_step(step, clone, env, logs))
            if step.returncode:
                return steps
        steps[-1].figures = make_run_figures(Path(steps[-1].log).read_text(errors="replace")) or {}
        profile = Step("profile", ".venv/bin/python bench/pipeline_profile.py --dagster-home .dagster_home")
        steps.append(run_step(profile, clone, env, logs))
        profile.figures = last_json(profile.log) or {}
        if test_fast:  # the dev extra first, timed apart: a contributor's `make test-fast` after `make run`
            steps.append(run_step(Step("install_dev", "make install-dev"), clone, env, logs))
            if steps[-1].returncode:
                return steps
            fast = run_step(Step("test_fast", "make test-fast"), clone, env, logs)
            fast.figures = pytest_figures(Path(fast.log).read_text(errors="replace")) or {}
            steps.append(fast)
        # what a fresh process of each class imports, here: set beside another kind's, the two kinds' ratio on the
        # suite's start-up, more than a third of its CPU (docs/measurements.md, "How much of the CPU is start-up")
        start_up = run_step(Step("start_up", ".venv/bin/python scripts/start_up_floor.py"), clone, env, logs)
        start_up.figures = (last_json(start_up.log) or {}).get("costs", {})
        steps.append(start_up)
    finally:
        shutil.rmtree(caches, ignore_errors=True)
    return steps


def figures_of(steps: dict[str, Step]) -> dict[str, float | None]:
    """The figures issue 49 sets goals on, from the steps that ran."""
    run, install = steps.get("make_run"), steps.get("install")
    profile, fast, suite = steps.get("profile"), steps.get("test_fast"), steps.get("suite")
    return {
        "make_run_pipeline_s": run.figures.get("pipeline_s") if run else None,
        "clone_to_summary_s": round(install.wall_s + run.wall_s, 1)
        if run and install and not run.returncode
        else None,
        "fixed_share": profile.figures.get("fixed_share") if profile else None,
        "suite_s": suite.figures.get("seconds") if suite else None,
        "test_fast_s": fast.figures.get("seconds") if fast else None,
    }


def print_table(
    commit: str,
    machine: dict[str, Any],
    started: str,
    steps: list[Step],
    figures: dict[str, float | None],
    verdicts: dict[str, dict[str, Any]],
) -> None:
    """What a person reads: each step's time and the machine's state around it, then each figure and its goal."""
    print(
        f"\n{commit[:12]} on {machine['kind']} ({machine['model_name']}, {machine['cores']} cores), from {started}"
    )
    for s in steps:
        print(
            f"  {s.name:<10} {s.wall_s:8.1f} s  rc {s.returncode}  load before {s.load_before:<5} idle {s.idle_share}"
        )
    for name, value in figures.items():
        goal = verdicts.get(name)
        said = (
            f"goal {goal['goal']}: {'met' if goal['met'] else 'NOT met'}" if goal else "no goal on this kind"
        )
        print(f"  {name:<20} {value!s:>8}  {said}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commit", default="HEAD", help="what to clone (default: HEAD, committed work only)")
    parser.add_argument(
        "--work", default="", help="where the clones and logs go (default: a temporary folder)"
    )
    parser.add_argument("--suite", action="store_true", help=".ci/run in a second clean clone, timed")
    parser.add_argument("--test-fast", action="store_true", help="make test-fast after make run, timed")
    parser.add_argument("--no-run", action="store_true", help="skip make run (with --suite: the suite only)")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="nexa-clean-clone-"))
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", args.commit], check=True, capture_output=True, text=True
    ).stdout.strip()
    machine = machine_kind(Path("/proc/cpuinfo").read_text())
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    steps: list[Step] = []
    if not args.no_run:
        clone = fresh_clone(commit, work / "run")
        steps += measure_make_run(clone, logs, args.test_fast)
    if args.suite and not any(s.returncode for s in steps):
        suite = run_step(
            Step("suite", ".ci/run"), fresh_clone(commit, work / "suite"), dict(os.environ), logs
        )
        suite.figures = pytest_figures(Path(suite.log).read_text(errors="replace")) or {}
        steps.append(suite)
    by_name = {s.name: s for s in steps}
    figures = figures_of(by_name)
    verdicts = against_goals(machine["kind"], figures)
    print_table(commit, machine, started, steps, figures, verdicts)
    clone_dir = work / ("run" if not args.no_run else "suite")
    report = {
        "commit": commit,
        "started": started,
        "machine": machine,
        "versions": library_versions(clone_dir),
        "figures": figures,
        "goals": verdicts,
        "start_up_costs": by_name["start_up"].figures if "start_up" in by_name else {},
        "steps": [asdict(s) for s in steps],
    }
    print(json.dumps(report))
    return 1 if any(s.returncode for s in steps) else 0


if __name__ == "__main__":
    sys.exit(main())
