"""A run's steps fork from a server that imported the code location once (``step_executor``, docs/operations.md,
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
import sys
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


def _recorded_run(
    root: Path, command: list[str], modules: tuple[str, ...], site: Path
) -> tuple[dict[str, int], list[tuple[str, int]]]:
    """``command`` (a Dagster CLI run) on ``root`` with the recorder of ``modules`` on ``PYTHONPATH`` (in ``site``):
    its one run's steps with their pids, and every (module, pid) imported afresh."""
    log = site / "imports.log"
    site.mkdir()
    (site / "sitecustomize.py").write_text(RECORDER.format(modules=modules, log=str(log)))
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        command,
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
    return steps, [(line.split()[0], int(line.split()[1])) for line in log.read_text().splitlines()]


def test_steps_fork_from_a_server_that_imported_the_code_location_once(tmp_path: Path) -> None:
    root = make_sandbox(tmp_path / "world", [DAY])
    steps, imports = _recorded_run(
        root, materialize_command("raw_documents", DAY), MODULES, tmp_path / "site"
    )
    importers: dict[str, list[int]] = {module: [] for module in MODULES}
    for module, pid in imports:
        importers[module].append(pid)
    # two steps, each in a process of its own, which imported neither the code location nor the storage
    assert len(steps) == 2 and len(set(steps.values())) == 2, steps
    assert not set(steps.values()) & {pid for pids in importers.values() for pid in pids}, (steps, importers)
    # the code location: by the command (which loads it to plan the run) and the forkserver, once each
    code_location = importers["nexa_dagster.definitions"]
    assert len(code_location) == len(set(code_location)) == 2, importers
    assert set(importers["sqlalchemy"]) <= set(code_location), importers


JOBS = """
import dagster as dg

from nexa_dagster.assets.common import IMPORTS_MODELS
from nexa_dagster.step_executor import step_executor


@dg.op(tags=IMPORTS_MODELS)
def tokenize() -> int:
    import torch

    return int(torch.ones(1).item())


@dg.op(tags=IMPORTS_MODELS)
def train(x: int) -> int:
    import torch

    return x + int(torch.zeros(1).item())


@dg.op
def report(x: int) -> int:  # imports torch too, untagged: as a step with a local model only would
    import torch

    return x + int(torch.zeros(1).item())


@dg.job(executor_def=step_executor)
def two_model_steps():
    train(tokenize())


@dg.job(executor_def=step_executor)
def one_model_step():
    report(tokenize())


defs = dg.Definitions(jobs=[two_model_steps, one_model_step])
"""


def _torch_importers(tmp_path: Path, job: str) -> tuple[dict[str, int], list[int]]:
    """A real ``dagster job execute`` of ``job`` (JOBS) on the step executor: its steps' pids, and every process
    that imported torch afresh."""
    jobs = tmp_path / "model_jobs.py"
    jobs.write_text(JOBS)
    command = [sys.executable, *("-m", "dagster", "job", "execute"), "-f", str(jobs), "-j", job]
    steps, imports = _recorded_run(
        make_sandbox(tmp_path / job), command, ("torch",), tmp_path / f"site-{job}"
    )
    return steps, [pid for _, pid in imports]


def test_torch_is_imported_once_by_the_server_for_two_steps_that_need_it_and_by_the_step_for_one(
    tmp_path: Path,
) -> None:
    """The step executor's per-run preload (step_executor.py), in real runs: with two steps tagged IMPORTS_MODELS
    the forkserver imports torch before the first step and neither step imports it; with one, nothing preloads it,
    and each step that uses it imports it itself, as every step did before."""
    steps, importers = _torch_importers(tmp_path, "two_model_steps")
    assert len(steps) == 2 and len(importers) == 1, (steps, importers)
    assert not set(steps.values()) & set(importers), (steps, importers)  # the server's, not a step's

    steps, importers = _torch_importers(tmp_path, "one_model_step")
    assert len(steps) == 2 and sorted(importers) == sorted(steps.values()), (steps, importers)
