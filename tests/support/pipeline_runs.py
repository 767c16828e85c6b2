"""The project's jobs run in a process of their own against a sandbox (``support.sandbox``), as `make run` runs them:
``run_jobs(root, "daily_data_job:2026-11-20", "training_job", "evaluation_job:@trained")`` executes each job in
turn on the sandbox's Dagster instance and returns what each did. And a copy of ``configs/`` with a few values
changed, for a sandbox whose test is about something other than those values.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from nexa_dagster.core.common.config import REPO_ROOT
from support.sandbox import sandbox_env

MARK = "JOB-RESULT "

DRIVER = """
import json, sys
import dagster as dg
from nexa_dagster.definitions import build_defs

defs = build_defs(warm_workers=True)  # one process runs every job, as make run: workers fork from a warm Python
instance = dg.DagsterInstance.get()
trained = None
for spec in sys.argv[1:]:
    job, _, partition = spec.partition(":")
    job, _, keys = job.rstrip("]").partition("[")
    selection = [dg.AssetKey(k) for k in keys.split(",")] if keys else None
    if partition == "@trained":
        partition = trained
    if job == "add_partition":
        instance.add_dynamic_partitions("checkpoints", [partition])
        continue
    result = defs.resolve_job_def(job).execute_in_process(
        instance=instance, partition_key=partition or None, raise_on_error=False, asset_selection=selection
    )
    record = {
        "job": job,
        "partition": partition,
        "success": result.success,
        "run_id": result.run_id,
        "materialized": sorted(
            e.asset_key.to_user_string() for e in result.get_asset_materialization_events()
        ),
        "metadata": {  # each materialization's plain values (numbers, flags, short text: no images, tables)
            e.asset_key.to_user_string(): {
                k: getattr(v, "value", None)
                for k, v in e.step_materialization_data.materialization.metadata.items()
                if isinstance(getattr(v, "value", None), (int, float, bool, str)) and len(str(v.value)) < 300
            }
            for e in result.get_asset_materialization_events()
        },
        "checks": {
            c.check_name: {"passed": c.passed, **{k: getattr(v, "value", None) for k, v in c.metadata.items()}}
            for c in result.get_asset_check_evaluations()
        },
        "errors": [
            (e.step_failure_data.error.message if e.step_failure_data.error else str(e.message))[-3000:]
            for e in result.all_events
            if e.is_step_failure
        ],
    }
    if job in ("training_job", "pretraining_job") and result.success and not selection:
        node = "moe_checkpoint" if job == "training_job" else "base_model"
        ckpt = result.output_for_node(node)
        record.update(checkpoint_id=ckpt.checkpoint_id, path=ckpt.path, parent=ckpt.parent)
        if job == "training_job":
            trained = ckpt.checkpoint_id
    print("JOB-RESULT " + json.dumps(record, default=str), flush=True)  # MARK
"""


def run_jobs(root: Path, *specs: str, timeout_s: float = 1800, **env: str) -> list[dict[str, Any]]:
    """Run ``specs`` in one process against the sandbox ``root``: ``job`` or ``job:partition`` (``@trained``: the
    checkpoint the last training_job trained), ``job[asset,...]`` for some of a job's assets, or
    ``add_partition:<checkpoint id>``. Returns one record per job (success, the assets materialized, the asset
    checks' results with their metadata, failure messages; a training's checkpoint id, path and parent; each
    materialization's plain metadata values, by asset)."""
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, *specs],
        cwd=REPO_ROOT,
        env=sandbox_env(root, **env),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads(line[len(MARK) :]) for line in proc.stdout.splitlines() if line.startswith(MARK)]


def configs_with(out: Path, changes: dict[str, dict[str, Any]]) -> Path:
    """A copy of the repository's ``configs/`` at ``out`` with ``changes`` ({file: {dotted.key: value}}) applied:
    point ``NEXA_CONFIG_DIR`` at it."""
    shutil.copytree(REPO_ROOT / "configs", out)
    for name, values in changes.items():
        path = out / name
        data = yaml.safe_load(path.read_text())
        for dotted, value in values.items():
            *parents, key = dotted.split(".")
            node = data
            for part in parents:
                node = node[part]
            node[key] = value
        path.write_text(yaml.safe_dump(data, sort_keys=False))
    return out
