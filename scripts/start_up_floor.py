"""How much of a suite run's CPU is start-up: the imports each freshly started Python pays before its own work.
``python scripts/start_up_floor.py --processes PROCS.jsonl`` (the file ``scripts/suite_cpu_profile.py
--processes`` wrote for the run).

Why: the suite is CPU-bound on two cores (issue 49), and a test's cost is the processes it starts (docs/testing.md,
"What the runs found"). A process of the product that loads a model imports torch and transformers before it does
anything (about 6 CPU-s on the 2-core machines), a vLLM process vLLM (about 11), a Dagster process the code location
(about 3). Cutting what the tests do leaves that part whole: this says how large it is, so a goal on the suite's time
can be held against what is left to cut without starting fewer processes.

Method, per process of the file (rows carry ``pid`` from stop 81 on):
* **forked**: its parent (``ancestors[0]``) is in the file with the same command line. A fork inherits its parent's
  imports and pays none (a forkserver's step processes, a warm Python's workers, an engine's model process);
* **a server that imports and forks** (Dagster's forkserver, a warm Python): all of its CPU is start-up;
* **a fresh start of a class** (``CLASSES``, the first whose pattern its command line matches): the CPU-s a fresh
  Python of that class spends on its imports, measured here alone (``python -c "import ..."``, the median of three),
  at most the process's own CPU-s;
* anything else (shells, services, compilers, installs, processes ``multiprocessing`` spawns, other Python
  programs): none counted.

So the figure is a floor: start-up the method cannot name is left out. Without ``pid`` in the rows (files written
before stop 81) a process counts as forked when an earlier process of the same command line has its parent's
ancestry, which can take a fresh engine started beside another for a fork: less start-up, never more.

It prints one row per class and one JSON object last (the run's CPU-s, the start-up CPU-s, their share, and the
measured costs, which ``--costs`` can give instead of measuring: another machine's, or a test's). Without
``--processes`` it measures and prints the costs alone: a machine kind's figures (``scripts/clean_clone_times.py``
records them), whose ratio to another kind's is the two kinds' on the suite's start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ALL = "all of its CPU"  # a server whose work is importing, then forking
MODELS = "transformers.modeling_utils"  # what loading a model imports (torch with it)
INSTALL = "install (pip, byte-compiling)"  # suite_cpu_profile's kind: an interpreter at work, not starting


@dataclass(frozen=True)
class StartClass:
    """Processes started fresh whose command line matches ``pattern``, and the imports one pays first."""

    name: str
    pattern: str
    imports: str  # a statement for ``python -c``, or ALL
    vllm: bool = False  # measured with the vLLM environment's interpreter


CLASSES = [
    StartClass("forkserver or warm Python", r"multiprocessing\.forkserver|core\.cluster\.warm_python", ALL),
    StartClass("vLLM process", r"^\S*vllm[^ ]*/bin/python\S* (?!-m pip)", "from vllm import LLM", vllm=True),
    StartClass(
        "transformers serve engine",
        r"transformers_engine\.py",
        f"import uvicorn, {MODELS}, transformers.cli.serve, transformers.cli.serving.chat_completion",
    ),
    # before the workers: its command line names the module it runs
    StartClass("torchrun", r"torch\.distributed\.run", "import torch.distributed.run"),
    StartClass(
        "training worker", r"core\.training\.worker", f"import nexa_dagster.core.training.worker, {MODELS}"
    ),
    StartClass(
        "evaluation worker",
        r"core\.evaluation\.worker",
        f"import nexa_dagster.core.evaluation.worker, {MODELS}",
    ),
    StartClass("nexa-dagster command", r"nexa_dagster\.cli|bin/nexa-dagster", "import nexa_dagster.cli"),
    StartClass(
        "Dagster process (code location)",
        r"-m dagster |bin/dagster|python\S* dagster|dagster-daemon|dagster_webserver|/dg |"
        r"nexa_dagster\.definitions|build_defs|nexa_dagster\.demo",
        "import dagster, nexa_dagster.definitions",
    ),
    # what a worker's collection imports: the test modules import the code location, torch and transformers
    StartClass(
        "pytest-xdist worker",
        r"exec\(eval\(sys\.stdin\.readline",
        f"import pytest, xdist, nexa_dagster.definitions, {MODELS}",
    ),
]


def forked(rows: list[dict[str, Any]]) -> set[int]:
    """Indices of the rows that are forks of a process in the file with the same command line."""
    found = set()
    in_order = sorted(enumerate(rows), key=lambda ir: ir[1]["created"])
    if all("pid" in r for r in rows):
        holder: dict[int, dict[str, Any]] = {}  # pid -> the latest process started with it (pids are reused)
        for i, r in in_order:
            parent = holder.get(r["ancestors"][0]) if r["ancestors"] else None
            if parent is not None and parent["cmdline"] == r["cmdline"]:
                found.add(i)
            holder[r["pid"]] = r
        return found
    # files without pids: the parent is known only by its own ancestry (see the module's docstring)
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for i, r in in_order:
        if (r["cmdline"], tuple(r["ancestors"][1:])) in seen:
            found.add(i)
        seen.add((r["cmdline"], tuple(r["ancestors"])))
    return found


def class_of(cmdline: str) -> StartClass | None:
    return next((c for c in CLASSES if re.search(c.pattern, cmdline)), None)


def floor(rows: list[dict[str, Any]], costs: dict[str, float]) -> dict[str, Any]:
    """Per class: fresh starts, forks, CPU-s and start-up CPU-s; and the run's totals."""
    forks = forked(rows)
    table: dict[str, dict[str, float]] = defaultdict(
        lambda: {"started": 0, "forked": 0, "cpu_s": 0.0, "start_up_s": 0.0}
    )
    for i, r in enumerate(rows):
        klass = None if r.get("kind") == INSTALL else class_of(r["cmdline"])
        name = (
            "forked (inherits its imports)" if i in forks else klass.name if klass else "other (none counted)"
        )
        row = table[name]
        row["forked" if i in forks else "started"] += 1
        row["cpu_s"] += r.get("cpu", 0.0)
        if i not in forks and klass is not None:
            # a class not measured (vLLM not installed where the costs were measured) counts none
            cost = r.get("cpu", 0.0) if klass.imports == ALL else costs.get(klass.name, 0.0)
            row["start_up_s"] += min(r.get("cpu", 0.0), cost)
    total = sum(r.get("cpu", 0.0) for r in rows)
    start_up = sum(row["start_up_s"] for row in table.values())
    return {
        "cpu_s": round(total, 1),
        "start_up_cpu_s": round(start_up, 1),
        "share": round(start_up / total, 3) if total else 0.0,
        "classes": {
            k: {f: round(v, 1) for f, v in row.items()}
            for k, row in sorted(table.items(), key=lambda kv: -kv[1]["start_up_s"])
        },
    }


def cpu_of(argv: list[str], env: dict[str, str]) -> float:
    """User + system CPU-s of one run of ``argv`` (and its children), from the kernel's accounting."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(
        argv, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def measure(classes: Iterable[StartClass], repeats: int = 3) -> dict[str, float]:
    """Each class's imports in a fresh Python, the median of ``repeats`` runs, in CPU-s. A class whose interpreter
    is missing here (vLLM not installed), or whose imports fail (no dev extra: no pytest-xdist), is left out, said
    on stderr: its processes then count no start-up."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1"}
    vllm = _vllm_python()
    costs = {}
    for klass in classes:
        if klass.imports == ALL:
            continue
        python = vllm if klass.vllm else sys.executable
        if python is None:
            print(f"{klass.name}: no vLLM environment here; left out", file=sys.stderr)
            continue
        try:
            runs = [cpu_of([str(python), "-c", klass.imports], env) for _ in range(repeats)]
        except subprocess.CalledProcessError:
            print(f"{klass.name}: `{klass.imports}` fails here; left out", file=sys.stderr)
            continue
        costs[klass.name] = round(statistics.median(runs), 2)
    return costs


def _vllm_python() -> Path | None:
    try:
        from nexa_dagster.core.llm.vllm_env import vllm_python
    except ImportError:  # run from outside the project's environment
        return None
    return vllm_python()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--processes", type=Path, help="suite_cpu_profile.py's --processes file (without it: the costs alone)"
    )
    parser.add_argument(
        "--costs", type=Path, help="a JSON object of class -> CPU-s, instead of measuring here"
    )
    args = parser.parse_args(argv)
    costs = json.loads(args.costs.read_text()) if args.costs else measure(CLASSES)
    # without a run's processes: this machine's figures, to set beside another's (scripts/clean_clone_times.py)
    if args.processes is None:
        for name, cost in costs.items():
            print(f"{cost:8.2f}  {name}")
        print(json.dumps({"costs": costs}))
        return 0
    rows = [json.loads(line) for line in args.processes.read_text().splitlines() if line.strip()]
    result = floor(rows, costs)
    print(
        f"{'started':>8} {'forked':>7} {'CPU-s':>8} {'start-up':>9}  class (its imports' CPU-s, measured alone)"
    )
    servers = {c.name for c in CLASSES if c.imports == ALL}
    for name, row in result["classes"].items():
        cost = ALL if name in servers else costs.get(name, "-")
        print(
            f"{row['started']:8.0f} {row['forked']:7.0f} {row['cpu_s']:8.1f} {row['start_up_s']:9.1f}  {name} ({cost})"
        )
    print(
        f"start-up: {result['start_up_cpu_s']} of {result['cpu_s']} CPU-s ({result['share']:.0%}), a floor "
        "(start-up the classes do not name is not counted)"
    )
    print(json.dumps({**result, "costs": costs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
