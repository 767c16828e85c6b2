"""SIGKILL of the run process at each daily stage in turn, at the worst moment (the stage's output fully
written, not yet renamed into place), then a rerun: nothing half-written is ever read as complete, and every
stage ends with the same outputs as an uninterrupted run.

Runs are `dagster asset materialize` processes, as from a shell or a run worker; the kill is a real SIGKILL from
the fault point in `core/storage.atomic_writer` (`NEXA_FAULT_KILL_BEFORE_RENAME`).

One kill per stage: a killed run turns its steps' retries off (`execution.config.retries: disabled`). With them
on, the teacher's and the gate's retry policy (3 retries, back-off 2-8 s) ran the killed step three more times,
and the fault, armed in every step process of the run, killed each retry at the same point, after the same work:
the same kill proved three more times, about 45% of the test's time (821 s at load 6-9 on the 2-core machine,
of which 290 s the six retries). What a retry would read after a kill (the teacher's generation store, the
gate's dedup store, the hidden temporary files) the rerun reads, and is checked below.
"""

import json
import subprocess
from pathlib import Path

import pandas as pd
import pytest
from support.sandbox import make_sandbox, materialize_command, sandbox_env

from nexa_dagster.core.common.config import REPO_ROOT

DAY = "2026-11-20"
ASSETS = "raw_documents,teacher_samples,filtered_samples,rejected_samples"
STAGES = ["raw_documents", "teacher_samples", "filtered_samples"]  # ingest, teacher, gate


NO_RETRIES = json.dumps({"execution": {"config": {"retries": {"disabled": {}}}}})


def _materialize(root: Path, fault: str | None = None) -> subprocess.CompletedProcess[str]:
    if not (root / "landing").exists():
        make_sandbox(root, [DAY])
    return subprocess.run(
        materialize_command(ASSETS, DAY, *(("--config-json", NO_RETRIES) if fault else ())),
        env=sandbox_env(root, fault),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _output(root: Path, asset: str) -> Path:
    return root / "data" / "assets" / asset / f"{DAY}.parquet"


# five materializations of a day on the tiny models (one straight, a kill per stage, a rerun): 821 s before the
# retries were turned off (load 6-9); the limit is there to catch a hang, not to time the test (each process has
# its own 600 s limit)
@pytest.mark.timeout(1800)
def test_killing_each_stage_then_rerunning_gives_the_uninterrupted_outputs(tmp_path: Path) -> None:
    straight = _materialize(tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]

    killed = tmp_path / "killed"
    for stage in STAGES:
        proc = _materialize(killed, fault=f"*/assets/{stage}/{DAY}.parquet")
        # the multiprocess executor runs each step in a child process: the killed step fails the run
        assert proc.returncode != 0 and "terminated by signal 9 (SIGKILL)" in proc.stderr + proc.stdout, (
            stage,
            proc.stderr[-2000:],
        )
        assert not _output(killed, stage).exists(), (
            f"{stage}: an unpublished output is visible under its name"
        )
        for earlier in STAGES[: STAGES.index(stage)]:
            assert _output(killed, earlier).exists(), f"{earlier} was lost when {stage} was killed"
    rerun = _materialize(killed)
    assert rerun.returncode == 0, rerun.stderr[-3000:]

    ingest = [pd.read_parquet(_output(root, "raw_documents")) for root in (tmp_path / "straight", killed)]
    pd.testing.assert_frame_equal(*ingest)
    teacher = [pd.read_parquet(_output(root, "teacher_samples")) for root in (tmp_path / "straight", killed)]
    # keys hash the model's path, which differs between the two data roots: compare what was asked instead
    asked = [sorted(zip(t["doc_id"], t["generation_index"], t["prompt"], strict=True)) for t in teacher]
    assert asked[0] == asked[1]
    assert teacher[1]["sample_id"].is_unique, "a teacher row was duplicated by the kills"
    assert teacher[1]["error"].isna().all() and (teacher[1]["response"].str.len() > 0).all()
    gated = [pd.read_parquet(_output(root, "filtered_samples")) for root in (tmp_path / "straight", killed)]
    rejected = [
        pd.read_parquet(_output(root, "rejected_samples")) for root in (tmp_path / "straight", killed)
    ]
    for run in (0, 1):  # every teacher row ends in exactly one of the two tables
        assert sorted([*gated[run]["sample_id"], *rejected[run]["sample_id"]]) == sorted(
            teacher[run]["sample_id"]
        )
    # the killed writes leave their temporary files: hidden names beside the target, which no reader opens
    leftovers = [p for p in (killed / "data").rglob("*") if p.is_file() and ".tmp" in p.name]
    assert leftovers and all(p.name.startswith(".") and p.name.endswith(".tmp") for p in leftovers), leftovers
