"""The `slurm` backend of the GPU-cluster resource against a real Slurm cluster (one node on the loopback).

The training asset is launched with sbatch, its progress streams into the Dagster run through Pipes (files in the
shared work directory), the checkpoint appears; cancelling the Dagster run cancels the Slurm job. Evaluation goes
through the same launch and scores a checkpoint as the local backend does.
"""

import datetime
import math
import re
import signal
import subprocess
import time
from pathlib import Path

import dagster as dg
import pandas as pd
import psutil
import pytest
from support.planted_secrets import PLANTED, environ_of, leaked
from support.training_jobs import launch_training_in_dagster, make_job

from nexa_dagster.core.cluster.slurm import slurm_job_fields, slurm_state, wait_for_slurm_job
from nexa_dagster.core.common.artifacts import COMPLETION_MARKER
from nexa_dagster.core.common.faults import STEP_PAUSE, fault_env
from nexa_dagster.core.evaluation.eval_set import freeze_eval_set, load_eval_set
from nexa_dagster.core.evaluation.worker import EvaluationJob
from nexa_dagster.resources.gpu_cluster import (
    GPUClusterResource,
    LocalGPUCluster,
    SlurmGPUCluster,
    gpu_cluster_from_settings,
)

# a Slurm cluster and jobs on it: left out of make test-fast
pytestmark = pytest.mark.slow

SLURM_WARNING_S = 20  # --signal=TERM@20: one step and a save of the tiny model fit with room to spare


def test_training_runs_as_a_slurm_job_and_streams_back_through_pipes(
    tmp_path: Path, teacher_dir: Path, slurm: dict[str, str]
) -> None:
    job = make_job(tmp_path, teacher_dir, steps=3, log_every=1)

    @dg.asset
    def trained(context: dg.AssetExecutionContext, gpu_cluster: GPUClusterResource) -> dg.MaterializeResult:
        return gpu_cluster.run_training(context, job, tmp_path / "work")[1].get_materialize_result()

    instance = dg.DagsterInstance.ephemeral()
    res = dg.materialize(
        [trained],
        resources={"gpu_cluster": SlurmGPUCluster(slurm_cpus_per_task=1, poll_interval_s=0.5)},
        instance=instance,
    )
    assert res.success
    assert res.asset_materializations_for_node("trained")[0].metadata["steps"].value == 3
    logs = [e.user_message for e in instance.all_logs(res.run_id)]
    submitted = [m for m in logs if m.startswith("submitted Slurm job")]
    assert submitted, logs
    assert any("step 3/3 loss" in m for m in logs), "worker progress did not come back through Pipes"
    job_id = submitted[0].split()[3]
    assert slurm_state(job_id) == "COMPLETED"
    assert (Path(job.output_dir) / COMPLETION_MARKER).exists()
    assert "step 3/3 loss" in (tmp_path / "work" / f"slurm-{job_id}.out").read_text()


def test_evaluation_runs_as_a_slurm_job_and_scores_like_the_local_backend(
    tmp_path: Path, tiny_model_dir: Path, tiny_tokenizer, slurm: dict[str, str]
) -> None:  # noqa: ANN001
    """``run_evaluation`` on the Slurm backend: the evaluation worker as an sbatch job (the launch training uses),
    its progress back through Pipes files, and the same per-example losses and answers as the local backend on the
    same checkpoint and eval set. A worker failure a relaunch repeats (here an eval-set file that is not Parquet)
    fails the step at once, naming it, with the Slurm job's state."""
    n = 6
    samples = pd.DataFrame(
        {
            "sample_id": [f"id{i:03d}" for i in range(n)],
            "day": ["2026-11-20"] * n,
            "system_prompt": ["Be brief."] * n,
            "prompt": [f"What is {i} + 1?" for i in range(n)],
            "response": [f"It is {i + 1}." for i in range(n)],
        }
    )
    freeze_eval_set(samples, tiny_tokenizer, str(tmp_path / "eval_sets"), 1, 0.5, 64, log=lambda m: None)
    examples = load_eval_set(str(tmp_path / "eval_sets"), 1)["path"]

    def evaluate(
        cluster: GPUClusterResource, name: str, examples_path: str
    ) -> tuple[dg.ExecuteInProcessResult, list[str]]:
        job = EvaluationJob(
            run_id=f"ckpt-{name}",
            models={"candidate": str(tiny_model_dir)},
            examples_path=examples_path,
            eval_set_version=1,
            prompts=["What is 1 + 1?"],
            max_new_tokens=4,
            output_path=str(tmp_path / name / "scores.json"),
        )

        @dg.asset(retry_policy=dg.RetryPolicy(max_retries=1))
        def scored(context: dg.AssetExecutionContext, gpu_cluster: GPUClusterResource) -> dg.Output[dict]:
            return dg.Output(gpu_cluster.run_evaluation(context, job, tmp_path / name)["scores"]["candidate"])

        instance = dg.DagsterInstance.ephemeral()
        res = dg.materialize(
            [scored], resources={"gpu_cluster": cluster}, instance=instance, raise_on_error=False
        )
        return res, [e.user_message for e in instance.all_logs(res.run_id)]

    local, _ = evaluate(LocalGPUCluster(), "local", examples)
    slurm_cluster_ = SlurmGPUCluster(slurm_cpus_per_task=1, poll_interval_s=0.5)
    on_slurm, logs = evaluate(slurm_cluster_, "slurm", examples)
    assert local.success and on_slurm.success, logs[-20:]
    job_id = next(m.split()[3] for m in logs if m.startswith("submitted Slurm job"))
    assert slurm_state(job_id) == "COMPLETED"
    assert "-m nexa_dagster.core.evaluation.worker --job" in (tmp_path / "slurm" / "eval.sbatch").read_text()
    assert any("ckpt-slurm candidate: eval-set loss" in m for m in logs), "worker progress did not come back"
    expected, got = local.output_for_node("scored"), on_slurm.output_for_node("scored")
    assert len(got["nll"]) == len(expected["nll"]) > 0 and got["tokens"] == expected["tokens"]
    assert got["nll"] == pytest.approx(expected["nll"], rel=1e-5) and got["answers"] == expected["answers"]

    (tmp_path / "garbage.parquet").write_text("not parquet")
    broken, logs = evaluate(slurm_cluster_, "broken", str(tmp_path / "garbage.parquet"))
    events = broken.all_events
    assert not broken.success and not [e for e in events if e.event_type_value == "STEP_UP_FOR_RETRY"]
    failure = broken.get_step_failure_events()[0].step_failure_data.user_failure_data.description
    assert "evaluation ckpt-broken failed (Slurm job" in failure and "ended FAILED" in failure, failure
    assert "not retried, it would fail again: evaluation ckpt-broken failed: ArrowInvalid" in failure, failure


def test_cancelling_the_dagster_run_cancels_the_slurm_job(
    tmp_path: Path, teacher_dir: Path, slurm: dict[str, str]
) -> None:
    """Also, while the job runs: its processes (srun and the worker, started by slurmd) hold none of the secrets
    planted in the submitting Dagster process's environment, which that process does hold (Slurm exports the
    whole environment of sbatch to the job by default)."""
    launcher, log = launch_training_in_dagster(
        tmp_path,
        teacher_dir,
        {"backend": "slurm", "slurm_cpus_per_task": 1, "poll_interval_s": 0.5},
        timeout_s=180,
        env=PLANTED,
    )
    job_id = next(
        line.split("submitted Slurm job ")[1].split()[0]
        for line in log.read_text().splitlines()
        if "submitted Slurm job" in line
    )
    assert slurm_state(job_id) == "RUNNING"
    assert leaked(environ_of(launcher.pid)) == sorted(PLANTED)  # the check can fail
    in_job = _job_processes(job_id)  # the batch shell, srun, the worker
    started = [
        p for p in in_job if "nexa_dagster.core.training.worker" in " ".join(p.cmdline())
    ]  # srun, worker
    assert len(started) >= 2, [p.cmdline() for p in in_job]
    for process in in_job:
        job_env = environ_of(process.pid)
        assert leaked(job_env) == [], process.cmdline()
        assert "PATH" in job_env and "HOME" in job_env, process.cmdline()
    # the script's exports (Pipes' bootstrap) reach what it starts (the batch shell's own /proc/<pid>/environ is
    # what it was started with, before it ran its export lines)
    assert all("DAGSTER_PIPES_CONTEXT" in environ_of(p.pid) for p in started)

    launcher.send_signal(signal.SIGINT)  # what a cancelled run's worker receives
    assert launcher.wait(timeout=60) is not None
    text = log.read_text(errors="replace")
    assert f"cancelled Slurm job {job_id}" in text and "RUN FAILED" in text, text[-3000:]
    deadline = time.monotonic() + 60
    while slurm_state(job_id) not in ("CANCELLED", "COMPLETED", "FAILED"):
        assert time.monotonic() < deadline, slurm_state(job_id)
        time.sleep(0.5)
    assert slurm_state(job_id) == "CANCELLED"
    # the worker's job file (the launcher's is tmp_path/job.json): slurmd kills the job's processes, SIGKILL after
    # the cluster's KillWait (5 s)
    deadline = time.monotonic() + 30
    while leftovers := [
        p
        for p in psutil.process_iter(["cmdline"])
        if str(tmp_path / "work" / "job.json") in " ".join(p.info["cmdline"] or [])
    ]:
        assert time.monotonic() < deadline, (
            f"the training process outlived its cancelled Slurm job: {leftovers}"
        )
        time.sleep(0.5)


def _job_processes(job_id: str) -> list[psutil.Process]:
    """This machine's processes of Slurm job ``job_id`` (slurmd's children, not ours: found by SLURM_JOB_ID)."""
    found = []
    for process in psutil.process_iter():
        try:
            if environ_of(process.pid).get("SLURM_JOB_ID") == job_id:
                found.append(process)
        except OSError:  # gone since the listing, or a kernel thread
            continue
    return found


def test_a_time_limited_slurm_job_is_warned_saves_its_state_and_the_relaunch_resumes(
    tmp_path: Path, teacher_dir: Path, slurm: dict[str, str]
) -> None:
    """A job reaching its real time limit gets the warning signal from slurmctld itself (``--signal=TERM@N``, no
    ``B:``: it reaches the job step's tasks, not only the batch shell) while it trains; nothing in this test signals
    anything. The worker finishes its step, saves its resumable state and stops before the limit; the job ends, the
    Dagster step fails (retryable), and the relaunch of the same training resumes from the saved step, not step 0.

    slurmctld checks time limits every 30 s (``PERIODIC_TIMEOUT``, compiled in) and sends the warning at the first
    check at most ``N + 30`` s before the limit. The worker's start-up (torch, DeepSpeed) takes 20 to 60+ s on a
    loaded machine, so a fixed minimal limit would warn it before its first step on one machine and waste a minute
    on another: the job is submitted with a long limit and, once it trains, the test shortens the limit (``scontrol
    update TimeLimit``, what an administrator does) to the nearest whole minute that leaves the warning due within
    the next check or two. One rank: with several, ``torchrun`` is the step's task and forwards SIGTERM to its
    ranks, which agree on the stop in the per-step all-reduce."""
    cluster = {
        "backend": "slurm",
        "slurm_cpus_per_task": 1,
        "poll_interval_s": 0.5,
        "slurm_time_limit": "10",
        "slurm_stop_warning_s": SLURM_WARNING_S,
    }
    # a step a second: the wait for slurmctld's warning (35-95 s) spent asleep, not training at full speed (92
    # CPU-s of its worker in the suite); the warning still lands while the job trains and is seen at the next step
    pace = fault_env(STEP_PAUSE, 1)
    launcher, log = launch_training_in_dagster(tmp_path, teacher_dir, cluster, timeout_s=300, env=pace)
    job_id = next(
        line.split("submitted Slurm job ")[1].split()[0]
        for line in log.read_text().splitlines()
        if "submitted Slurm job" in line
    )
    script = (tmp_path / "work" / "train.sbatch").read_text()
    assert [line for line in script.splitlines() if "--signal" in line] == [
        f"#SBATCH --signal=TERM@{SLURM_WARNING_S}"
    ]
    start = datetime.datetime.fromisoformat(slurm_job_fields(job_id)["StartTime"]).timestamp()
    limit_min = math.ceil(
        (time.time() - start + SLURM_WARNING_S + 30 + 5) / 60
    )  # warning due >= 5 s from now
    subprocess.run(["scontrol", "update", f"JobId={job_id}", f"TimeLimit={limit_min}"], check=True)
    assert slurm_job_fields(job_id)["TimeLimit"] == f"00:{limit_min:02d}:00"
    end = start + 60 * limit_min
    out = tmp_path / "work" / f"slurm-{job_id}.out"
    saved = None
    while saved is None:  # only slurmctld's warning can stop this training
        text = out.read_text(errors="replace") if out.exists() else ""
        saved = re.search(r"saved resumable state at step (\d+); stopping as asked", text)
        assert saved or (launcher.poll() is None and time.time() < end + 30), (
            text + log.read_text(errors="replace")
        )[-3000:]
        time.sleep(0.5)
    before_limit_s = end - time.time()
    assert launcher.wait(timeout=120) is not None
    step = int(saved.group(1))
    assert (
        "SIGTERM: saving the resumable state" in (tmp_path / "work" / "worker.rank0.stderr.log").read_text()
    )
    assert (
        step >= 1
        and (tmp_path / "checkpoints" / "test-run.state" / "latest").read_text().strip() == f"step{step:08d}"
    )
    # stopped by the warning, before the limit: the job failed with the worker's exit code (75), not TIMEOUT
    assert "RUN FAILED" in log.read_text() and slurm_state(job_id) == "FAILED", slurm_state(job_id)
    assert 0 < before_limit_s <= SLURM_WARNING_S + 30 + 5, before_limit_s
    print(
        f"time limit {limit_min} min, warning {SLURM_WARNING_S} s: state saved at step {step}, "
        f"{before_limit_s:.0f} s before the limit"
    )

    job = make_job(tmp_path, teacher_dir, steps=step + 2, log_every=1)  # the same training, relaunched

    @dg.asset
    def trained(context: dg.AssetExecutionContext, gpu_cluster: GPUClusterResource) -> dg.MaterializeResult:
        return gpu_cluster.run_training(context, job, tmp_path / "work")[1].get_materialize_result()

    instance = dg.DagsterInstance.ephemeral()
    res = dg.materialize(
        [trained], resources={"gpu_cluster": gpu_cluster_from_settings(cluster)}, instance=instance
    )
    assert res.success
    metadata = res.asset_materializations_for_node("trained")[0].metadata
    assert metadata["resumed_from_step"].value == step and metadata["steps"].value == step + 2
    assert any(f"resumed from step {step}" in e.user_message for e in instance.all_logs(res.run_id))


def test_waiting_for_a_job_slurm_does_not_know_ends_with_a_clear_error(slurm: dict[str, str]) -> None:
    """A job id neither the controller nor accounting knows (``UNKNOWN``) used to be polled forever; after a grace
    period (a controller restart comes back) the wait fails naming the job and what was asked."""
    logged: list[str] = []
    started = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"Slurm job 999999: neither the controller .* has known it for 1 s"
    ):
        wait_for_slurm_job("999999", 0.2, logged.append, unknown_grace_s=1.0)
    assert time.monotonic() - started < 30
    assert logged == ["Slurm job 999999: UNKNOWN"]
