"""The GPU-cluster resource: where training runs, launched and watched through Dagster Pipes.

The asset hands over a ``TrainingJob``; this resource starts the worker process (``local``: this machine's GPUs
or CPU ranks; ``slurm`` and ``kubernetes`` are issue #5), streams its log lines and final metrics into the
Dagster run, and returns the ``TrainingResult`` the worker wrote beside the checkpoint.

Stopping: cancelling the Dagster run makes ``PipesSubprocessClient`` send SIGINT to the worker (or to ``torchrun``,
which stops its ranks); the worker exits within its grace period even if stuck in native code, and it also exits
by itself when the launching process disappears (a killed run worker), so no orphan keeps a GPU busy.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import dagster as dg
from pydantic import Field

from nexa_dagster.core import storage
from nexa_dagster.core.tiny_model import COMPLETION_MARKER
from nexa_dagster.core.training.job import TrainingJob, TrainingResult
from nexa_dagster.core.training.worker import LAUNCHER_PID_ENV, STDERR_LOG

BACKENDS = ("local", "slurm", "kubernetes")
ACCELERATORS = ("cpu", "cuda")
STDERR_TAIL_LINES = 40


class GPUClusterResource(dg.ConfigurableResource):
    """Runs training jobs off the Dagster process; configured per deployment (tiny CPU demo vs. GPU cluster)."""

    backend: str = Field(default="local", description="local | slurm | kubernetes (the latter two: issue #5)")
    num_procs: int = Field(default=1, ge=1, description="ranks per node; more than one launches torchrun")
    accelerator: str = Field(default="cpu", description="cpu | cuda: what the cluster's nodes provide")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables for the worker")
    python_executable: str = Field(default="", description="interpreter for the worker (default: this one)")

    def worker_command(self, job_file: Path, log_dir: Path) -> list[str]:
        """The worker's command line: ``python -m ...worker``, under ``torchrun`` for more than one rank."""
        python = self.python_executable or sys.executable
        worker = ["-m", "nexa_dagster.core.training.worker", "--job", str(job_file), "--log-dir", str(log_dir)]
        if self.num_procs == 1:
            return [python, *worker]
        return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.num_procs}", *worker]

    def run_training(self, context: dg.AssetExecutionContext, job: TrainingJob,
                     work_dir: Path) -> tuple[TrainingResult, dg.PipesClientCompletedInvocation]:
        """Run ``job`` to completion; return the worker's ``TrainingResult`` and the Pipes invocation.

        For the caller: the worker reports its final metrics as this asset's materialization. An asset without
        an output value returns ``invocation.get_materialize_result()`` (metadata included); an asset that returns
        its own value merges ``invocation.get_materialize_result().metadata`` into its ``dg.Output``. The whole
        ``TrainingResult`` is also a custom message (``invocation.get_custom_messages()[-1]``). A step that opened
        a Pipes session must return typed results (``Output``/``MaterializeResult``), not a bare value.

        Raises ``dg.Failure`` (with the worker's stderr tail) if the worker fails, or before launching if an
        input is missing; ``NotImplementedError`` for the cluster backends not built yet.
        """
        self._check_backend()
        self._check_job(job)
        work_dir.mkdir(parents=True, exist_ok=True)
        job_file = work_dir / "job.json"
        job_file.write_text(job.model_dump_json(indent=2), encoding="utf-8")
        for old in work_dir.glob(STDERR_LOG.format(rank="*")):  # a previous attempt's, not this one's
            old.unlink()
        if self.num_procs != job.settings.num_procs:
            per_rank = job.settings.micro_batch_size * job.settings.gradient_accumulation_steps
            context.log.warning(f"the scale preset trains on {job.settings.num_procs} ranks, this cluster runs "
                                f"{self.num_procs}: each step sees {per_rank * self.num_procs} packed rows instead "
                                f"of the recipe's {per_rank * job.settings.num_procs}")
        env = {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **self.env,
               LAUNCHER_PID_ENV: str(os.getpid())}
        command = self.worker_command(job_file, work_dir)
        context.log.info(f"launching {' '.join(command)}")
        try:
            invocation = dg.PipesSubprocessClient().run(context=context, command=command, env=env,
                                                        cwd=str(work_dir))
        except Exception as e:  # a failed worker (DagsterPipesExecutionError is not public API) or launch;
            tail = stderr_tail(work_dir)  # a cancelled run is a BaseException and passes through untouched
            raise dg.Failure(
                description=f"training {job.run_id} failed ({e}); the worker's stderr ended with:\n{tail}",
                metadata={"job_file": dg.MetadataValue.path(str(job_file)),
                          "stderr_tail": dg.MetadataValue.text(tail)},
            ) from e
        return read_result(job), invocation

    def _check_backend(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"GPUClusterResource.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend != "local":
            raise NotImplementedError(f"the {self.backend} backend is added by issue #5 (cluster launch through "
                                      "Dagster Pipes); use backend='local' until then")

    def _check_job(self, job: TrainingJob) -> None:
        """Fail before spending minutes on process start-up, with the reason in the message; retrying won't help."""
        if self.accelerator not in ACCELERATORS:
            raise ValueError(f"GPUClusterResource.accelerator must be one of {ACCELERATORS}, got {self.accelerator!r}")
        if job.accelerator != self.accelerator:
            raise dg.Failure(f"training {job.run_id} asks for accelerator {job.accelerator!r} but this cluster "
                             f"provides {self.accelerator!r}", allow_retries=False)
        if (Path(job.output_dir) / COMPLETION_MARKER).exists():
            raise dg.Failure(f"training {job.run_id}: checkpoint {job.output_dir} is already complete; a new run "
                             "needs a new run_id", allow_retries=False)
        for name, path in (("train", job.train_path), ("validation", job.validation_path)):
            if not storage.exists(path):
                raise dg.Failure(f"training {job.run_id}: {name} data not found: {path}", allow_retries=False)


def stderr_tail(log_dir: Path, lines: int = STDERR_TAIL_LINES) -> str:
    """The last lines of every rank's stderr copy, rank 0 first: where the worker's traceback and message are."""
    parts = []
    for log in sorted(log_dir.glob(STDERR_LOG.format(rank="*"))):
        text = log.read_text(encoding="utf-8", errors="replace").rstrip().splitlines()[-lines:]
        parts.append(f"--- {log.name}\n" + "\n".join(text))
    return "\n".join(parts) if parts else "(no stderr copy: the worker died before it started logging; see the " \
                                         "step's stderr in the Dagster run)"


def read_result(job: TrainingJob) -> TrainingResult:
    summary = Path(job.output_dir) / "training_summary.json"
    if not summary.exists():
        raise dg.Failure(f"training {job.run_id}: the worker exited cleanly but wrote no {summary}")
    return TrainingResult.model_validate(json.loads(summary.read_text(encoding="utf-8")))
