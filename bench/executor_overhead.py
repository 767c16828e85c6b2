"""What Dagster's orchestration costs a ``daily_data_job`` run: the multiprocess executor starting its steps with
``spawn`` (Dagster's default), from a ``forkserver`` that preloaded the code location (the project's
``step_executor``, nexa_dagster/step_executor.py) or from one configured as Dagster's ``forkserver: {}``
(``forkserver_bare``: Dagster 1.13 then preloads nothing of the code location, and every step imports it again),
and the in-process executor.

Run (from the repo root)::

    .venv/bin/python bench/executor_overhead.py --runs 2

In a sandbox (the tests' landing day, ``tests/data/landing``, its own Dagster home and data root), the job runs once to
warm the caches (the teacher's answers are stored, so later runs of the same day do the same work; ``--warmup 0``
leaves that run out, for a check that the bench still runs, as the suite's: figures not comparable), then ``--runs``
times with each executor, alternating, each as ``dagster job execute`` in a fresh process. For each run: wall time,
and the CPU time (user + system) of the whole process tree, from ``RUSAGE_CHILDREN``. The work inside the steps is
the same with every executor, so the difference is the orchestration: one process start, Python import of the code
location, resource set-up and IPC per step with ``multiprocess`` (``spawn``); one import of the code location per
run, then a fork per step, with ``forkserver`` (its steps' CPU is not in RUSAGE_CHILDREN: compare it by wall time,
or by ``machine_cpu_s``, the whole machine's busy CPU seconds from ``/proc/stat`` over the run, which counts them
when nothing else runs); none with ``in_process``. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(REPO / "tests"))
DAY = "2026-11-20"
# the project's definitions plus the selection (daily_data_job's by default) under each executor (the project pins one)
DEFS = """
import dagster as dg
from nexa_dagster.assets.partitions import daily_partitions
from nexa_dagster.definitions import build_defs
from nexa_dagster.step_executor import step_executor

ASSETS = __ASSETS__
jobs = [dg.define_asset_job(f"daily_{name}", selection=dg.AssetSelection.assets(*ASSETS),
                            partitions_def=daily_partitions, executor_def=executor)
        for name, executor in (("multiprocess", dg.multiprocess_executor), ("forkserver", step_executor),
                               ("forkserver_bare", dg.multiprocess_executor.configured(
                                   {"start_method": {"forkserver": {}}}, name="forkserver_bare")),
                               ("in_process", dg.in_process_executor))]
defs = dg.Definitions.merge(build_defs(), dg.Definitions(jobs=jobs))
"""


def run_job(root: Path, executor: str, assets: list[str]) -> dict[str, float]:
    from support.sandbox import sandbox_env

    module = root / "executor_defs.py"
    module.write_text(DEFS.replace("__ASSETS__", json.dumps(assets)))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    machine_before = machine_busy_s()
    start = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dagster",
            "job",
            "execute",
            "-f",
            str(module),
            "-j",
            f"daily_{executor}",
            "--tags",
            json.dumps({"dagster/partition": DAY}),
        ],
        env=sandbox_env(root),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    wall = time.perf_counter() - start
    machine = machine_busy_s() - machine_before
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"{assets} ({executor}) failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    import dagster as dg

    with dg.DagsterInstance.from_config(str(root / "home")) as instance:  # how many processes ran its steps
        run = instance.get_runs(limit=1)[0]
        pids = {
            e.dagster_event.pid for e in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.STEP_START)
        }
    # RUSAGE_CHILDREN counts reaped descendants only: a forkserver's steps are reaped by the forkserver, which the
    # run process never waits for, so their CPU is not seen (compare forkserver runs by wall time or machine_cpu_s)
    return {
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "machine_cpu_s": round(machine, 2),
        "step_processes": len(pids),
    }


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (neither idle nor waiting on I/O) since boot."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument(
        "--warmup",
        type=int,
        choices=(0, 1),
        default=1,
        help="0: no warm-up run (the first executor's run then pays for the teacher's answers: its figures are "
        "not comparable; for a check that the bench runs, as the suite's)",
    )
    parser.add_argument(
        "--assets",
        default=None,
        help="the day's assets each run materializes, comma-separated (default daily_data_job's; the suite's "
        "smallest run takes raw_documents alone: an asset and its check, two steps, no model loaded)",
    )
    args = parser.parse_args()
    from nexa_dagster.jobs import DATA_ASSETS

    assets = args.assets.split(",") if args.assets else list(DATA_ASSETS)
    from support.sandbox import make_sandbox

    root = make_sandbox(Path(tempfile.mkdtemp(prefix="nexa-executor-")) / "sandbox", [DAY])
    if args.warmup:
        print(f"warm-up: {run_job(root, 'multiprocess', assets)}", flush=True)
    results: dict[str, list[dict[str, float]]] = {
        e: [] for e in ("multiprocess", "forkserver", "forkserver_bare", "in_process")
    }
    for _ in range(args.runs):
        for executor in results:
            results[executor].append(run_job(root, executor, assets))
            print(f"{executor}: {results[executor][-1]}", flush=True)
    mean = {e: {k: round(sum(r[k] for r in rs) / len(rs), 2) for k in rs[0]} for e, rs in results.items()}
    print(
        json.dumps(
            {
                "runs": args.runs,
                "assets": assets,
                "multiprocess": mean["multiprocess"],
                "forkserver": mean["forkserver"],
                "forkserver_bare": mean["forkserver_bare"],
                "in_process": mean["in_process"],
                "orchestration_cpu_s_saved_per_run": round(
                    mean["multiprocess"]["cpu_s"] - mean["in_process"]["cpu_s"], 2
                ),
                "forkserver_vs_spawn_wall": round(
                    mean["forkserver"]["wall_s"] / mean["multiprocess"]["wall_s"], 3
                ),
                # the code location preloaded against Dagster's `forkserver: {}`, same job, same run
                "preload_vs_bare_machine_cpu": round(
                    mean["forkserver"]["machine_cpu_s"] / mean["forkserver_bare"]["machine_cpu_s"], 3
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
