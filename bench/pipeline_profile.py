"""Each job of a pipeline run split into the stage's own work and its fixed costs, from what the run recorded.

Run: .venv/bin/python bench/pipeline_profile.py                      # the runs in $DAGSTER_HOME (after `make run`)
     .venv/bin/python bench/pipeline_profile.py --part night [--work DIR]   # run a part of `make run`, then profile it
     (--part data: the first night's daily_data_job; night: that night's data, base, training and evaluations)

Nothing is re-run or re-timed to profile: every figure comes from the Dagster event log of the runs (in creation
order): a run's creation, start and end, each step's start and end, and the spans the stages log around their own
work and their fixed costs (``nexa_dagster/core/common/spans.py``: ``span work/training_steps: 11.204 s``). Per job:

* launch: the run's creation to its start (Dagster's run launch);
* Dagster: the run's start to end less its steps (step launches, events, the executor);
* worker start-up: a worker process's time less the spans it logged itself (interpreter, imports, teardown);
* every ``fixed/`` span (model and DeepSpeed start-up, model loads, the judge's start, checkpoint writes, MLflow)
  and every ``work/`` span (training steps, scoring, benchmarks, judging, generation: the teacher's
  ``generation_wall_s``);
* unattributed/<step>: a step's time outside any span (its tables, IO manager, a model load or the work of a
  stage with no span yet): where a span is still missing.

Printed as a table; the last line is one JSON object: per job its seconds in each part, and the totals with
``fixed_share`` (fixed costs over the pipeline's time, the issue-49 goal: at most 0.30) and ``work_share``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# run as a script, bench/ is sys.path[0] and its other scripts (bench/packaging.py) would shadow installed modules
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import dagster as dg  # noqa: E402

from nexa_dagster import settings  # noqa: E402
from nexa_dagster.core.common.config import REPO_ROOT  # noqa: E402
from nexa_dagster.core.common.spans import PATTERN, WORKER_PROCESS  # noqa: E402

WORK_METADATA = {"generation_wall_s": "generation"}  # a span a stage records as metadata: its name as a span
LAUNCH, DAGSTER, STARTUP, UNATTRIBUTED = "launch", "dagster", "worker_startup", "unattributed"
WORKER_SUFFIX = WORKER_PROCESS.format(kind="")


@dataclass
class Span:
    kind: str  # work | fixed
    name: str
    seconds: float
    end: float  # the time it was logged (its end)
    step: str | None
    order: int  # its place in the run's log

    @property
    def start(self) -> float:
        return self.end - self.seconds

    def holds(self, other: Span) -> bool:
        """A worker process's span holds the spans its worker sent: logged before it (the launcher logs it once
        the worker's messages are all read), begun after the process started."""
        return (
            self.name.endswith(WORKER_SUFFIX)
            and other.step == self.step
            and other.order < self.order
            and other.start >= self.start
        )


@dataclass
class JobProfile:
    label: str
    total_s: float
    parts: dict[str, float] = field(
        default_factory=lambda: defaultdict(float)
    )  # "fixed/<name>", "work/<name>"

    def of(self, kind: str) -> float:
        return sum(s for k, s in self.parts.items() if k.startswith(kind + "/"))


def run_label(run: Any) -> str:
    partition = run.tags.get("dagster/partition", "")
    subset = sorted(k.to_user_string() for k in (run.asset_selection or ()))
    return f"{run.job_name} {partition[:24]}".strip() + (f" ({', '.join(subset)})" if subset else "")


def spans_of(entries: list[Any]) -> list[Span]:
    """The spans a run's log holds, and the work its materializations record as metadata."""
    out = []
    for order, entry in enumerate(entries):
        match = PATTERN.match(entry.user_message or "") if entry.dagster_event is None else None
        if match:
            seconds = float(match["seconds"])
            out.append(Span(match["kind"], match["name"], seconds, entry.timestamp, entry.step_key, order))
        event = entry.dagster_event
        if event is not None and event.event_type_value == "ASSET_MATERIALIZATION":
            metadata = event.event_specific_data.materialization.metadata
            for key, name in WORK_METADATA.items():
                if key in metadata:
                    seconds = float(metadata[key].value)
                    out.append(Span("work", name, seconds, entry.timestamp, entry.step_key, order))
    return out


def step_times(entries: list[Any]) -> dict[str, float]:
    """Each step's seconds from its start to its success or failure."""
    started: dict[str, float] = {}
    took: dict[str, float] = {}
    for entry in entries:
        event = entry.dagster_event
        if event is None or not entry.step_key:
            continue
        if event.event_type_value == "STEP_START":
            started[entry.step_key] = entry.timestamp
        elif event.event_type_value in ("STEP_SUCCESS", "STEP_FAILURE") and entry.step_key in started:
            took[entry.step_key] = entry.timestamp - started[entry.step_key]
    return took


def profile_run(instance: dg.DagsterInstance, record: Any) -> JobProfile:
    entries = instance.all_logs(record.dagster_run.run_id)
    kinds = {e.dagster_event.event_type_value: e.timestamp for e in entries if e.dagster_event is not None}
    start = kinds.get("RUN_START", record.create_timestamp.timestamp())
    end = kinds.get("RUN_SUCCESS", kinds.get("RUN_FAILURE", max(e.timestamp for e in entries)))
    job = JobProfile(run_label(record.dagster_run), end - record.create_timestamp.timestamp())
    job.parts[f"fixed/{LAUNCH}"] = max(0.0, start - record.create_timestamp.timestamp())
    steps = step_times(entries)
    job.parts[f"fixed/{DAGSTER}"] = max(0.0, (end - start) - sum(steps.values()))
    spans = spans_of(entries)
    for step, seconds in steps.items():
        own = [s for s in spans if s.step == step]
        top = [s for s in own if not any(o.holds(s) for o in own)]
        for s in top:
            nested = [n for n in own if s.holds(n)]
            for n in nested:
                job.parts[f"{n.kind}/{n.name}"] += n.seconds
            if nested:  # a worker process: what it spent outside its own spans is its start-up and teardown
                job.parts[f"fixed/{STARTUP}"] += max(0.0, s.seconds - sum(n.seconds for n in nested))
            else:
                job.parts[f"{s.kind}/{s.name}"] += s.seconds
        job.parts[f"{UNATTRIBUTED}/{step}"] += max(0.0, seconds - sum(s.seconds for s in top))
    return job


def profile(instance: dg.DagsterInstance) -> list[JobProfile]:
    records = sorted(instance.get_run_records(), key=lambda r: r.create_timestamp)
    return [profile_run(instance, r) for r in records]


def report(jobs: list[JobProfile]) -> dict[str, Any]:
    """The table, and the figures of the JSON line."""
    print(f"{'job':<58} {'total s':>8} {'work s':>7} {'fixed s':>8} {'other s':>8}  largest fixed costs")
    totals: dict[str, float] = defaultdict(float)
    out_jobs = []
    for job in jobs:
        work, fixed, other = job.of("work"), job.of("fixed"), job.of(UNATTRIBUTED)
        largest = sorted(((s, k) for k, s in job.parts.items() if k.startswith("fixed/")), reverse=True)[:3]
        costs = ", ".join(f"{k.removeprefix('fixed/')} {s:.1f}" for s, k in largest if s >= 0.05)
        print(f"{job.label[:58]:<58} {job.total_s:8.1f} {work:7.1f} {fixed:8.1f} {other:8.1f}  {costs}")
        for key, seconds in job.parts.items():
            totals[key] += seconds
        rounded = {k: round(v, 2) for k, v in sorted(job.parts.items())}
        out_jobs.append({"job": job.label, "total_s": round(job.total_s, 2), "parts": rounded})
    total = sum(j.total_s for j in jobs)
    work = sum(v for k, v in totals.items() if k.startswith("work/"))
    fixed = sum(v for k, v in totals.items() if k.startswith("fixed/"))
    other = sum(v for k, v in totals.items() if k.startswith(UNATTRIBUTED + "/"))
    print(f"{'all runs':<58} {total:8.1f} {work:7.1f} {fixed:8.1f} {other:8.1f}")
    print("by part: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(totals.items(), key=lambda kv: -kv[1])))
    return {
        "runs": len(jobs),
        "total_s": round(total, 2),
        "work_s": round(work, 2),
        "fixed_s": round(fixed, 2),
        "unattributed_s": round(other, 2),
        "work_share": round(work / total, 3) if total else None,
        "fixed_share": round(fixed / total, 3) if total else None,
        "parts": {k: round(v, 2) for k, v in sorted(totals.items())},
        "jobs": out_jobs,
        "cpus": os.cpu_count(),
        "load_after": round(os.getloadavg()[0], 2),
    }


def run_part(part: str, work: Path) -> None:
    """``part`` of ``make run`` in a fresh instance and data root under ``work`` (the environment points there)."""
    home, data = work / "dagster_home", work / "data"
    home.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO_ROOT / "dagster.yaml", home / "dagster.yaml")
    settings.export(settings.DAGSTER_HOME, str(home))
    settings.export(settings.DATA_ROOT, str(data))
    settings.export(settings.RESULTS_ROOT, str(work / "results"))
    settings.export_default(settings.HF_HUB_OFFLINE)
    # imported here, after the environment points at ``work``: the code location builds its resources on import
    from nexa_dagster.core.common.config import resolve_path
    from nexa_dagster.core.data.ingest import landed_days
    from nexa_dagster.core.tiny.install import install_tiny_models
    from nexa_dagster.definitions import build_defs
    from nexa_dagster.demo import Demo
    from nexa_dagster.resources.build import local_model_dirs

    defs = build_defs()
    install_tiny_models(local_model_dirs(defs.resources))
    demo = Demo(defs, dg.DagsterInstance.get())
    day = landed_days(resolve_path(demo.storage.landing_root))[0]
    if part == "data":
        demo.run("daily_data_job", partition_key=day)
    else:
        demo.run_nights([day])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dagster-home", default="", help="the instance to profile (default: $DAGSTER_HOME)")
    parser.add_argument(
        "--part", choices=("data", "night"), default="", help="run this part of `make run` first"
    )
    parser.add_argument("--work", default="", help="where --part runs (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nexa-profile-") as scratch:
        if args.part:
            run_part(args.part, Path(args.work or scratch).resolve())
        elif args.dagster_home:
            # Dagster takes only an absolute DAGSTER_HOME; a person types `--dagster-home .dagster_home`.
            settings.export(settings.DAGSTER_HOME, str(Path(args.dagster_home).resolve()))
        if not settings.DAGSTER_HOME.is_set():
            parser.error("no instance: set DAGSTER_HOME, --dagster-home, or --part")
        figures = report(profile(dg.DagsterInstance.get()))
    print(json.dumps({"part": args.part or "instance", **figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
