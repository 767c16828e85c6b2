"""SIGKILL of the whole run (its process group, as a lost node or the OOM killer would) inside each
downstream stage in turn -- packaging, training, evaluation, serving -- then a rerun: nothing the killed run left
is read as complete, no process of it survives, and every stage ends with the outputs of an uninterrupted run
(packed rows equal, training by loss sequence, evaluation by its metrics, serving by its smoke answer).

Each kill lands at a named point inside the stage's work (a line the stage logs, and for serving a live model
server; for packaging, too quick to catch from outside at tiny scale, the fault point that kills it with its output
written and not yet renamed), never after a guessed delay, so it is the same kill on a fast or a loaded machine.
The daily stages (ingest, teacher, gate) have their own kill test in test_kill_each_stage.py.

What is not repeated (the suite's time, issue 49): the benchmarks are off (a configuration copy in the sandbox:
`evaluation.benchmarks.tasks: []`), since no comparison below reads them and every evaluation here would run the
harness again (test_benchmarks.py and test_pipeline.py's lifecycle test them); and the training is rerun from the
failure (`moe_checkpoint` alone, on the dataset the killed run had packaged, as for the deployment below), not
packaged a third time: the packed rows compared are those packaged after the packaging kill.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pandas as pd
import psutil
import pytest
from support.pipeline_runs import configs_with
from support.sandbox import make_sandbox, materialize_command, sandbox_env

from nexa_dagster.core.common.artifacts import COMPLETION_MARKER
from nexa_dagster.core.common.config import REPO_ROOT
from nexa_dagster.core.packaging.formats.packed_split import read_packed_frame

DAY = "2026-11-20"
TRAIN = "sft_dataset,moe_checkpoint"
SERVE = "eval_report,model_deployment"


@dataclass
class _Run:
    """A ``dagster asset materialize`` in its own process group (the kill takes all of the run at once), its
    output in a file: a pipe nobody reads until the kill would block a run that logs more than the pipe holds."""

    proc: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _materialize(root: Path, select: str, partition: str | None = None, fault: str | None = None) -> _Run:
    logs = root / "materialize-logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{len(list(logs.iterdir())):02d}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            materialize_command(select, partition),
            env=sandbox_env(root, fault, NEXA_CONFIG_DIR=str(root / "configs")),
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return _Run(proc, log)


def _finish(run: _Run) -> str:
    try:
        run.proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(run.proc.pid, signal.SIGKILL)
        raise
    out = run.output()
    assert run.proc.returncode == 0, out[-4000:]
    return out


def _instance(root: Path) -> dg.DagsterInstance:
    return dg.DagsterInstance.from_config(str(root / "home"))


def _kill_inside(
    root: Path,
    select: str,
    partition: str | None,
    step: str,
    marker: str,
    ready: Callable[[], bool] = lambda: True,
) -> str:
    """Start a run and SIGKILL its whole process group once ``step`` has logged a line matching ``marker`` (a
    point inside the stage's real work, whatever the machine's speed) and ``ready()`` holds. Returns the run id."""
    with _instance(root) as instance:  # one instance for the whole wait: opening one costs more than a query
        before = {r.run_id for r in instance.get_runs()}
        run = _materialize(root, select, partition)
        deadline = time.monotonic() + 600
        run_id, cursor, reached = "", None, False
        try:
            while not (reached and ready()):
                assert run.proc.poll() is None, f"the run ended before the kill point: {run.output()[-3000:]}"
                assert time.monotonic() < deadline, f"{step} never reached {marker!r}"
                time.sleep(0.1)
                if not run_id:
                    run_id = next((r.run_id for r in instance.get_runs() if r.run_id not in before), "")
                    continue
                # only the events since the last look
                page = instance.get_records_for_run(run_id, cursor=cursor)
                cursor = page.cursor
                reached = reached or any(
                    r.event_log_entry.step_key == step
                    and re.search(marker, r.event_log_entry.user_message or "")
                    for r in page.records
                )
        finally:
            os.killpg(run.proc.pid, signal.SIGKILL)
            run.proc.wait(timeout=60)
    assert run.proc.returncode == -signal.SIGKILL
    # A run killed outright stays STARTED and keeps its `gpu` pool slot until something declares it dead and frees
    # the slot: in production the daemon's run monitoring (`free_slots_after_run_end_seconds`), by hand an
    # operator's "terminate" in the UI. Do what they do.
    with _instance(root) as instance:
        instance.report_run_failed(instance.get_run_by_id(run_id), "SIGKILLed by the test")
        instance.event_log_storage.free_concurrency_slots_for_run(run_id)
    return run_id


def _killed_before_publishing(root: Path, select: str, fault: str) -> str:
    """A run whose stage is SIGKILLed by the fault point in `storage.atomic_writer`: its output fully written
    under a temporary name, not yet renamed (the worst moment for a stage too quick to catch from outside)."""
    run = _materialize(root, select, fault=fault)
    run.proc.wait(timeout=600)
    out = run.output()
    assert run.proc.returncode != 0 and "terminated by signal 9 (SIGKILL)" in out, out[-3000:]
    with _instance(root) as instance:
        return instance.get_runs(limit=1)[0].run_id


def _materialized_in(root: Path, run_id: str) -> set[str]:
    with _instance(root) as instance:
        return {
            e.dagster_event.asset_key.to_user_string()
            for e in instance.all_logs(run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION)
        }


def _survivors(root: Path) -> list[str]:
    """Processes still running that belong to a run on this data root (training workers, model servers)."""
    mine = []
    for p in psutil.process_iter(["pid", "cmdline", "environ"]):
        try:
            if p.pid != os.getpid() and str(root) in " ".join(p.info["cmdline"] or []) + str(
                p.info["environ"] or ""
            ):
                mine.append(f"{p.pid}: {' '.join(p.info['cmdline'] or [])[:200]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return mine


def _assert_nothing_left_running(root: Path) -> None:
    deadline = time.monotonic() + 30  # a model server gets SIGTERM from its dead parent and needs a moment
    while (left := _survivors(root)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes of the killed run survive it: {left}"


def _metadata(root: Path, key: str, partition: str | None = None) -> dict:
    with _instance(root) as instance:
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(
                asset_key=dg.AssetKey(key), asset_partitions=[partition] if partition else None
            ),
            limit=1,
        ).records
        return {k: v.value for k, v in records[0].event_log_entry.asset_materialization.metadata.items()}


def _checkpoint_partitions(root: Path) -> list[str]:
    with _instance(root) as instance:
        return list(instance.get_dynamic_partitions("checkpoints"))


def _production(root: Path) -> str | None:
    path = root / "data" / "serving" / "production.json"
    return (json.loads(path.read_text()).get("current") or {}).get("checkpoint_id") if path.exists() else None


@pytest.mark.timeout(1800)
def test_killing_each_downstream_stage_then_rerunning_gives_the_uninterrupted_outputs(tmp_path: Path) -> None:
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    make_sandbox(straight, [DAY])
    configs_with(straight / "configs", {"scales/tiny.yaml": {"evaluation.benchmarks.tasks": []}})
    _finish(_materialize(straight, "raw_documents,teacher_samples,filtered_samples,rejected_samples", DAY))
    # pretraining_job's assets in one run: the frozen eval set both evaluations are measured on, and the base both
    # fine-tunings start from (init_from: base; from scratch the tiny student's greedy smoke answer is an empty
    # <|im_end|>, which the deployment refuses)
    _finish(_materialize(straight, "pretrain_corpus,eval_set,base_model"))
    shutil.copytree(straight, killed)  # both start from the same day of data (and the same instance history)

    # the uninterrupted run
    _finish(_materialize(straight, TRAIN))
    checkpoint = _metadata(straight, "moe_checkpoint")["checkpoint_id"]
    _finish(_materialize(straight, SERVE, checkpoint))

    # 1. packaging, killed with its packed train split written but not yet renamed into place (at tiny scale the
    #    whole stage takes a fraction of a second): no dataset is published, nothing downstream starts
    run = _killed_before_publishing(killed, TRAIN, "*/sft/*/train.shards.json")
    assert _materialized_in(killed, run) == set(), "a killed packaging run published something"
    _assert_nothing_left_running(killed)

    # 2. training, killed after its first optimizer step: no complete checkpoint, no evaluation partition for it
    run = _kill_inside(killed, TRAIN, None, "moe_checkpoint", r"^step 1/\d+ loss")
    assert _materialized_in(killed, run) == {"sft_dataset"}
    half_trained = [p for p in (killed / "data" / "checkpoints").iterdir() if not p.name.startswith(".")]
    assert not any((p / COMPLETION_MARKER).exists() for p in half_trained), half_trained
    assert _checkpoint_partitions(killed) == []
    _assert_nothing_left_running(killed)

    # ... rerun from the failure (the training step, on the dataset the killed run packaged): the same packed rows,
    # and training gives the same loss at every logged step
    _finish(_materialize(killed, "moe_checkpoint"))
    for split in ("train_path", "validation_path"):
        pd.testing.assert_frame_equal(
            read_packed_frame(_metadata(straight, "sft_dataset")[split]),
            read_packed_frame(_metadata(killed, "sft_dataset")[split]),
        )
    curves = [
        json.loads(
            (Path(_metadata(root, "moe_checkpoint")["checkpoint_path"]) / "training_summary.json").read_text()
        )["loss_curve"]
        for root in (straight, killed)
    ]
    assert [s for s, _ in curves[0]] == [s for s, _ in curves[1]]
    assert [loss for _, loss in curves[1]] == pytest.approx([loss for _, loss in curves[0]], abs=1e-5)
    retrained = _metadata(killed, "moe_checkpoint")["checkpoint_id"]
    assert _checkpoint_partitions(killed) == [retrained]

    # 3. evaluation, killed between scoring the eval set and judging answers: no report, nothing served
    run = _kill_inside(killed, SERVE, retrained, "eval_report", r"eval-set loss \d")
    assert _materialized_in(killed, run) == set()
    assert not (killed / "results" / "evaluation" / "reports" / retrained / "report.json").exists()
    _assert_nothing_left_running(killed)

    # 4. serving, killed while its model server runs: no deployment recorded, no promotion, no server left
    run = _kill_inside(
        killed,
        SERVE,
        retrained,
        "model_deployment",
        r"^deploying ",
        ready=lambda: any(" serve" in p for p in _survivors(killed)),
    )
    assert _materialized_in(killed, run) == {"eval_report"}
    assert not (killed / "results" / "deployments" / retrained / "deployment.json").exists()
    assert _production(killed) is None
    _assert_nothing_left_running(killed)

    # ... rerun from the failure (Dagster's "re-execute from failure": the deployment step, on the report the
    # killed run completed): the same evaluation metrics and the same (greedy) smoke answer, and the checkpoint in
    # production
    _finish(_materialize(killed, "model_deployment", retrained))
    reports = [
        _metadata(root, "eval_report", ckpt) for root, ckpt in ((straight, checkpoint), (killed, retrained))
    ]
    for metric in ("eval_loss", "perplexity", "judge_score"):
        assert reports[1][metric] == pytest.approx(reports[0][metric], rel=1e-4), metric
    answers = [
        _metadata(root, "model_deployment", ckpt)["smoke_response"]
        for root, ckpt in ((straight, checkpoint), (killed, retrained))
    ]
    assert answers[0] == answers[1]
    assert _production(killed) == retrained
