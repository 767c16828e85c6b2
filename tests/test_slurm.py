"""The `slurm` backend of the GPU-cluster resource against a real Slurm cluster (one node on the loopback).

The training asset is launched with sbatch, its progress streams into the Dagster run through Pipes (files in the
shared work directory), the checkpoint appears; cancelling the Dagster run cancels the Slurm job.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import re  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import dagster as dg  # noqa: E402
import psutil  # noqa: E402
import pytest  # noqa: E402
from services import slurm_cluster  # noqa: E402
from test_training import launch_training_in_dagster, make_job  # noqa: E402

from nexa_dagster.core.tiny_model import COMPLETION_MARKER, build_tiny_causal_lm  # noqa: E402
from nexa_dagster.resources.gpu_cluster import GPUClusterResource, slurm_state  # noqa: E402


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_causal_lm(tmp_path_factory.mktemp("slurm") / "models" / "tiny-teacher")


@pytest.fixture(scope="module")
def slurm() -> Iterator[dict[str, str]]:
    with slurm_cluster() as env:
        os.environ.update(env)
        try:
            yield env
        finally:
            for key in env:
                os.environ.pop(key, None)


def test_training_runs_as_a_slurm_job_and_streams_back_through_pipes(tmp_path: Path, teacher_dir: Path,
                                                                     slurm: dict[str, str]) -> None:
    job = make_job(tmp_path, teacher_dir, steps=3, log_every=1)

    @dg.asset
    def trained(context: dg.AssetExecutionContext, gpu_cluster: GPUClusterResource) -> dg.MaterializeResult:
        return gpu_cluster.run_training(context, job, tmp_path / "work")[1].get_materialize_result()

    instance = dg.DagsterInstance.ephemeral()
    res = dg.materialize([trained], resources={"gpu_cluster": GPUClusterResource(backend="slurm", slurm_cpus_per_task=1,
                                                                                  poll_interval_s=0.5)},
                         instance=instance)
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


def test_cancelling_the_dagster_run_cancels_the_slurm_job(tmp_path: Path, teacher_dir: Path,
                                                         slurm: dict[str, str]) -> None:
    launcher, log = launch_training_in_dagster(
        tmp_path, teacher_dir, {"backend": "slurm", "slurm_cpus_per_task": 1, "poll_interval_s": 0.5}, timeout_s=180)
    job_id = next(line.split("submitted Slurm job ")[1].split()[0]
                  for line in log.read_text().splitlines() if "submitted Slurm job" in line)
    assert slurm_state(job_id) == "RUNNING"

    launcher.send_signal(signal.SIGINT)  # what a cancelled run's worker receives
    assert launcher.wait(timeout=60) is not None
    text = log.read_text(errors="replace")
    assert f"cancelled Slurm job {job_id}" in text and "RUN FAILED" in text, text[-3000:]
    deadline = time.monotonic() + 60
    while slurm_state(job_id) not in ("CANCELLED", "COMPLETED", "FAILED"):
        assert time.monotonic() < deadline, slurm_state(job_id)
        time.sleep(0.5)
    assert slurm_state(job_id) == "CANCELLED"
    time.sleep(2)
    leftovers = [p for p in psutil.process_iter(["cmdline"])
                 if str(tmp_path / "job.json") in " ".join(p.info["cmdline"] or [])]
    assert not leftovers, "the training process outlived its cancelled Slurm job"


def test_a_signalled_slurm_job_saves_its_state_and_the_relaunch_resumes(tmp_path: Path, teacher_dir: Path,
                                                                       slurm: dict[str, str]) -> None:
    """Before the time limit Slurm sends SIGTERM to the job step's tasks (``--signal=TERM@N``, no ``B:``). Here the
    same signal is sent the way slurmctld sends it then, with ``scancel --signal=TERM`` (steps only, not the batch
    shell), after a few steps: the worker saves its resumable state and stops; the job ends, the Dagster step fails
    (retryable), and the relaunch of the same training resumes from the saved step instead of step 0. One rank: with
    several, ``torchrun`` is the step's task and forwards SIGTERM to its ranks (torch's elastic agent does so for
    SIGTERM, SIGINT, SIGHUP and SIGQUIT), which agree on the stop in the per-step all-reduce."""
    cluster = {"backend": "slurm", "slurm_cpus_per_task": 1, "poll_interval_s": 0.5}
    launcher, log = launch_training_in_dagster(tmp_path, teacher_dir, cluster, timeout_s=300)
    job_id = next(line.split("submitted Slurm job ")[1].split()[0]
                  for line in log.read_text().splitlines() if "submitted Slurm job" in line)
    script = (tmp_path / "work" / "train.sbatch").read_text()
    assert "#SBATCH --signal=TERM@120" in script and "B:" not in script
    out = tmp_path / "work" / f"slurm-{job_id}.out"
    deadline = time.monotonic() + 120
    while "step 3/" not in (out.read_text(errors="replace") if out.exists() else ""):
        assert time.monotonic() < deadline and launcher.poll() is None, log.read_text(errors="replace")[-3000:]
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=TERM", job_id], check=True)
    assert launcher.wait(timeout=120) is not None
    text = out.read_text(errors="replace")
    saved = re.search(r"saved resumable state at step (\d+); stopping as asked", text)
    assert saved, text[-3000:]
    step = int(saved.group(1))
    assert "SIGTERM: saving the resumable state" in (tmp_path / "work" / "worker.rank0.stderr.log").read_text()
    assert step >= 3 and (tmp_path / "checkpoints" / "test-run.state" / "latest").read_text().strip() == \
        f"step{step:08d}"
    assert "RUN FAILED" in log.read_text() and slurm_state(job_id) == "FAILED"

    job = make_job(tmp_path, teacher_dir, steps=step + 2, log_every=1)  # the same training, relaunched

    @dg.asset
    def trained(context: dg.AssetExecutionContext, gpu_cluster: GPUClusterResource) -> dg.MaterializeResult:
        return gpu_cluster.run_training(context, job, tmp_path / "work")[1].get_materialize_result()

    instance = dg.DagsterInstance.ephemeral()
    res = dg.materialize([trained], resources={"gpu_cluster": GPUClusterResource(**cluster)}, instance=instance)
    assert res.success
    metadata = res.asset_materializations_for_node("trained")[0].metadata
    assert metadata["resumed_from_step"].value == step
    assert any(f"resumed from step {step}" in e.user_message for e in instance.all_logs(res.run_id))
