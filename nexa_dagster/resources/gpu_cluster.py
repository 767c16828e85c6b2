"""The GPU-cluster resource: where training runs, launched and watched through Dagster Pipes.

The asset hands over a ``TrainingJob``; this resource starts the worker process (``local``: this machine's GPUs
or CPU ranks; ``slurm`` and ``kubernetes`` are issue #5), streams its logs and metrics into the Dagster run, and
returns the ``TrainingResult`` the worker wrote beside the checkpoint. Cancelling the Dagster run terminates the
worker (Pipes forwards the termination).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import dagster as dg
from pydantic import Field

from nexa_dagster.core.training.job import TrainingJob, TrainingResult

BACKENDS = ("local", "slurm", "kubernetes")


class GPUClusterResource(dg.ConfigurableResource):
    backend: str = Field(default="local", description="local | slurm | kubernetes")
    num_procs: int = Field(default=1, description="ranks per node (torchrun) for the local backend")
    accelerator: str = Field(default="cpu", description="cpu | cuda")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for the worker")
    python_executable: str = Field(default="", description="interpreter for the worker (default: this one)")

    def command(self, job_file: Path) -> list[str]:
        python = self.python_executable or sys.executable
        module = ["-m", "nexa_dagster.core.training.worker", "--job", str(job_file)]
        if self.num_procs > 1:
            return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.num_procs}",
                    *module]
        return [python, *module]

    def run_training(self, context: dg.AssetExecutionContext, job: TrainingJob,
                     work_dir: Path) -> tuple[TrainingResult, dg.PipesClientCompletedInvocation]:
        """Run the job to completion; return its result and the Pipes invocation.

        The worker reports its final metrics as a Pipes custom message (``invocation.get_custom_messages()``);
        the asset returns its own artifact, so the worker reports no materialization of its own.
        """
        if self.backend not in BACKENDS:
            raise ValueError(f"GPUClusterResource.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend != "local":
            raise NotImplementedError(f"the {self.backend} backend is added by issue #5 (cluster launch through "
                                      "Pipes); use backend='local'")
        for path in (job.train_path, job.validation_path):
            if "://" not in path and not Path(path).exists():
                raise dg.Failure(f"training input not found: {path}", allow_retries=False)
        work_dir.mkdir(parents=True, exist_ok=True)
        job_file = work_dir / "job.json"
        job_file.write_text(job.model_dump_json(indent=2))
        (work_dir / "error.txt").unlink(missing_ok=True)
        env = {"DS_ACCELERATOR": "cpu"} if self.accelerator == "cpu" else {}
        env.update({"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **self.env})
        try:
            invocation = dg.PipesSubprocessClient().run(context=context, command=self.command(job_file), env=env,
                                                        cwd=str(work_dir))
        except dg.DagsterPipesExecutionError as e:
            error = work_dir / "error.txt"
            detail = error.read_text().strip() if error.exists() else str(e)
            raise dg.Failure(f"training worker failed: {detail} (job: {job_file})") from e
        summary = Path(job.output_dir) / "training_summary.json"
        if not summary.exists():
            raise dg.Failure(f"training worker exited cleanly but wrote no {summary}")
        return TrainingResult.model_validate(json.loads(summary.read_text())), invocation

    def cleanup(self, work_dir: Path) -> None:
        shutil.rmtree(work_dir, ignore_errors=True)
