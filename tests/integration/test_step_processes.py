"""A run's steps fork from a server that imported the code location once (``STEP_EXECUTOR``, docs/operations.md,
"Step processes"): a real ``dagster asset materialize`` of a two-step selection (an asset and its check) imports
``nexa_dagster.definitions`` in two processes, the command's and the forkserver's, and in no step; nor does a step
import the instance's storage (SQLAlchemy).

Who imported what is recorded by the processes themselves: a ``sitecustomize`` on ``PYTHONPATH`` (every interpreter
runs it; a forked step inherits it from the forkserver) appends the module and its process id to a file whenever a
process looks the module up because it does not hold it yet. Before the modules were named in the executor's
``preload_modules`` (Dagster 1.13 reads an absent one as an empty list and preloads only its executor), each step
imported the code location again (about 1 s of CPU per step on the 2-core machine) and the storage (0.5 s).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import dagster as dg
from support.sandbox import make_sandbox, materialize_command, sandbox_env

from nexa_dagster.core.common.config import REPO_ROOT

DAY = "2026-11-20"
MODULES = ("nexa_dagster.definitions", "sqlalchemy")
# a finder first in line that never finds anything: it only notes who asked (a process importing one afresh)
RECORDER = """
import os, sys

class _Recorder:
    def find_spec(self, name, path=None, target=None):
        if name in {modules!r}:
            with open({log!r}, "a") as out:
                out.write(f"{{name}} {{os.getpid()}}\\n")
        return None

sys.meta_path.insert(0, _Recorder())
"""


def test_steps_fork_from_a_server_that_imported_the_code_location_once(tmp_path: Path) -> None:
    root = make_sandbox(tmp_path / "world", [DAY])
    site, log = tmp_path / "site", tmp_path / "imports.log"
    site.mkdir()
    (site / "sitecustomize.py").write_text(RECORDER.format(modules=MODULES, log=str(log)))
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        materialize_command("raw_documents", DAY),
        cwd=REPO_ROOT,
        env=sandbox_env(root, PYTHONPATH=path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with dg.DagsterInstance.from_config(str(root / "home")) as instance:
        (run,) = instance.get_runs()
        steps = {
            e.dagster_event.step_key: e.dagster_event.pid
            for e in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.STEP_START)
        }
    importers: dict[str, list[int]] = {module: [] for module in MODULES}
    for line in log.read_text().splitlines():
        module, pid = line.split()
        importers[module].append(int(pid))
    # two steps, each in a process of its own, which imported neither the code location nor the storage
    assert len(steps) == 2 and len(set(steps.values())) == 2, steps
    assert not set(steps.values()) & {pid for pids in importers.values() for pid in pids}, (steps, importers)
    # the code location: by the command (which loads it to plan the run) and the forkserver, once each
    code_location = importers["nexa_dagster.definitions"]
    assert len(code_location) == len(set(code_location)) == 2, importers
    assert set(importers["sqlalchemy"]) <= set(code_location), importers
