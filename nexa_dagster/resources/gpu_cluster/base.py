"""The abstract GPU-cluster resource: what training and evaluation ask of a cluster, whatever its backend.

The asset hands over a ``TrainingJob`` or an ``EvaluationJob``; the resource writes it into the run's work
directory, starts the worker there through the backend's one launch method (``launch_worker``: a local process, a
Slurm job, a Kubernetes pod), streams the worker's log lines and final metrics into the Dagster run through Pipes,
and returns what the worker wrote. A failed worker becomes a ``dg.Failure`` that is retried only when a relaunch
can succeed: a worker that reports a permanent failure (``training.worker.write_failure``: bad data, a wrong
setting, a non-finite loss) is not retried; one that died without a word (a killed process, a lost node) is.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

import dagster as dg
from pydantic import Field

from nexa_dagster import settings
from nexa_dagster.core.cluster.commands import EVALUATION_MODULE, WORKER_MODULE, evaluation_argv, worker_argv
from nexa_dagster.core.common import storage
from nexa_dagster.core.common.artifacts import COMPLETION_MARKER
from nexa_dagster.core.common.workers import FAILURE_FILE, STDERR_LOG
from nexa_dagster.core.evaluation.worker import EvaluationJob
from nexa_dagster.core.packaging.shards import ShardRunner
from nexa_dagster.core.training.init import check_init_checkpoint
from nexa_dagster.core.training.job import TrainingJob, TrainingResult

STDERR_TAIL_LINES = 40
# TQDM_DISABLE: a worker's output goes to the run's log line by line, where a progress bar redrawn in place is noise
# (the workers say their progress in lines of their own); an engine has it too, so one can fork from the workers'
# warm Python (tqdm reads it when it loads)
WORKER_ENV = {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1"}


class WorkerFailed(RuntimeError):
    """A backend's word that the worker ended badly (the reason: an exit state and its output's tail)."""


@dataclass(frozen=True)
class WorkerLaunch:
    """One worker process group to start: what a backend needs to build its command, script or pod.

    ``distributed``: training runs the cluster's ranks (``num_procs`` per node, Slurm's ``nodes``); evaluation
    runs one process on one device.
    """

    kind: Literal["training", "evaluation"]
    run_id: str
    job_file: Path
    work_dir: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def distributed(self) -> bool:
        return self.kind == "training"

    @property
    def name(self) -> str:
        """The script and job name's stem: ``train`` / ``eval``."""
        return "train" if self.kind == "training" else "eval"

    def argv(self, python: str, procs_per_node: int, nodes: int = 1, rendezvous: str = "") -> list[str]:
        """The worker's command line: training's ranks under ``torchrun``, evaluation as one process."""
        if self.distributed:
            return worker_argv(
                python, str(self.job_file), str(self.work_dir), procs_per_node, nodes, rendezvous
            )
        return evaluation_argv(python, str(self.job_file))

    def with_env(self, extra: dict[str, str]) -> WorkerLaunch:
        return replace(self, env={**self.env, **extra})


class GPUClusterResource(dg.ConfigurableResource, ABC):
    """Where training and evaluation run, off the Dagster process. Abstract: configure one of
    ``LocalGPUCluster``, ``SlurmGPUCluster``, ``KubernetesGPUCluster`` (``configs/pipeline.yaml``:
    ``gpu_cluster.backend`` picks it). Assets ask for this type and work with any of them."""

    backend: ClassVar[str] = ""

    num_procs: int = Field(default=1, ge=1, description="ranks per node; more than one launches torchrun")
    accelerator: Literal["cpu", "cuda"] = Field(default="cpu", description="what the cluster's nodes provide")
    env: dict[str, str] = Field(
        default_factory=dict, description="extra environment variables for the worker"
    )
    python_executable: str = Field(default="", description="interpreter for the worker (default: this one)")

    @abstractmethod
    def launch_worker(
        self, context: dg.AssetExecutionContext, launch: WorkerLaunch
    ) -> dg.PipesClientCompletedInvocation:
        """Start ``launch``'s worker on this backend with a Pipes session, wait for it, return the invocation.

        Raise ``WorkerFailed`` (or the Pipes client's error) when the worker ends badly, ``dg.Failure`` when the
        backend lacks what it needs (not retried); a cancelled run (``BaseException``) must stop the worker."""

    def shard_runner(
        self, context: dg.AssetExecutionContext, work_dir: str, max_parallel: int = 0
    ) -> ShardRunner | None:
        """Where packaging shards run on this backend (``shards.run_shards(runner=...)``): ``None`` keeps this
        machine's worker processes (the local backend); Slurm and Kubernetes return a runner that submits one
        element per shard (``core/cluster/slurm.py``, ``core/cluster/kubernetes.py``), ``max_parallel`` at once (0: no limit), its task files and
        logs under ``work_dir``."""
        return None

    def launch_env(self, env: dict[str, str] | None = None) -> dict[str, str]:
        """The variables every worker launch sets over the machine's environment: ``WORKER_ENV``, the resource's
        ``env``, then the launch's own."""
        return {**WORKER_ENV, **self.env, **(env or {})}

    def prestart_warm(self) -> None:
        """Start what makes later workers start faster (the local backend's warm Python); nothing elsewhere."""

    def world_size(self) -> int:
        """Ranks of one training (nodes × ranks per node)."""
        return self.num_procs

    def python(self) -> str:
        return self.python_executable or sys.executable

    def training_launch(
        self, job: TrainingJob, work_dir: Path, env: dict[str, str] | None = None
    ) -> WorkerLaunch:
        return WorkerLaunch("training", job.run_id, work_dir / "job.json", work_dir, self.launch_env(env))

    def evaluation_launch(
        self, job: EvaluationJob, work_dir: Path, env: dict[str, str] | None = None
    ) -> WorkerLaunch:
        return WorkerLaunch(
            "evaluation",
            job.run_id,
            work_dir / "eval_job.json",
            work_dir,
            self.launch_env(env),
        )

    def run_training(
        self, context: dg.AssetExecutionContext, job: TrainingJob, work_dir: Path
    ) -> tuple[TrainingResult, dg.PipesClientCompletedInvocation]:
        """Run ``job`` to completion; return the worker's ``TrainingResult`` and the Pipes invocation.

        For the caller: the worker reports its final metrics as this asset's materialization. An asset without
        an output value returns ``invocation.get_materialize_result()`` (metadata included); an asset that returns
        its own value merges ``invocation.get_materialize_result().metadata`` into its ``dg.Output``. The whole
        ``TrainingResult`` is also a custom message (``invocation.get_custom_messages()[-1]``). A step that opened
        a Pipes session must return typed results (``Output``/``MaterializeResult``), not a bare value.

        Raises ``dg.Failure`` (with the worker's stderr tail) if the worker fails, or before launching if an
        input is missing or the backend lacks what it needs.
        """
        self._check_job(job)
        launch = self.training_launch(job, work_dir)
        _prepare(launch, job.model_dump_json(indent=2))
        if self.num_procs != job.settings.num_procs:
            per_rank = job.settings.micro_batch_size * job.settings.gradient_accumulation_steps
            context.log.warning(
                f"the scale preset trains on {job.settings.num_procs} ranks, this cluster runs "
                f"{self.num_procs}: each step sees {per_rank * self.num_procs} packed rows instead "
                f"of the recipe's {per_rank * job.settings.num_procs}"
            )
        invocation = self._launch(context, launch)
        return read_result(job), invocation

    def run_evaluation(
        self, context: dg.AssetExecutionContext, job: EvaluationJob, work_dir: Path
    ) -> dict[str, Any]:
        """Score ``job``'s models on the eval set in the evaluation worker, off the Dagster process, on this
        cluster (a local process, a Slurm job, a pod: the same launch as training's, one process on one device);
        return what the worker wrote (``core.evaluation_worker.run``)."""
        self._check_evaluation_job(job)
        launch = self.evaluation_launch(job, work_dir)
        _prepare(launch, job.model_dump_json(indent=2))
        if storage.exists(job.output_path):  # an earlier attempt's scores are not this attempt's
            storage.remove(job.output_path)
        self._launch(context, launch)
        if not storage.exists(job.output_path):
            raise dg.Failure(
                f"evaluation {job.run_id}: the worker exited cleanly but wrote no {job.output_path}"
            )
        return storage.read_json(job.output_path)

    def _launch(
        self, context: dg.AssetExecutionContext, launch: WorkerLaunch
    ) -> dg.PipesClientCompletedInvocation:
        try:
            return self.launch_worker(context, launch)
        except dg.Failure:
            raise
        except Exception as e:  # a failed worker (DagsterPipesExecutionError is not public API) or launch;
            # a cancelled run (BaseException) passes through
            raise worker_failure(launch, str(e), self.worker_import_problem(launch)) from e

    # whether this host's interpreter is the one the worker runs (a pod runs its image's: not checked here)
    imports_checked_here: ClassVar[bool] = True

    def worker_import_problem(self, launch: WorkerLaunch) -> str | None:
        """Why the worker's interpreter cannot import the worker, when a failed worker left no word (no failure
        report, no stderr copy: it died before its first line ran), else None. A Python that does not find
        ``nexa_dagster`` (an installation moved or copied from another path, a broken environment) fails every
        relaunch the same way: the caller does not retry it."""
        if not self.imports_checked_here or _worker_spoke(launch.work_dir):
            return None
        module = WORKER_MODULE if launch.kind == "training" else EVALUATION_MODULE
        try:
            probe = subprocess.run(
                [self.python(), "-c", f"import {module}"],
                cwd=str(launch.work_dir),
                env={**settings.environ(), **launch.env},
                capture_output=True,
                text=True,
                timeout=300,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"the worker's Python {self.python()} cannot run: {e}"
        if probe.returncode == 0:
            return None
        last = (probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"])[-1]
        return import_error_line(last) and f"{self.python()} cannot import {module}: {last}"

    def _check_accelerator(self, kind: str, run_id: str, wanted: str) -> None:
        if wanted != self.accelerator:
            raise dg.Failure(
                f"{kind} {run_id} asks for accelerator {wanted!r} but this cluster provides "
                f"{self.accelerator!r}",
                allow_retries=False,
            )

    def _check_evaluation_job(self, job: EvaluationJob) -> None:
        """A model or eval set that is not there fails here, not after a Slurm queue and a worker's start-up."""
        self._check_accelerator("evaluation", job.run_id, job.accelerator)
        inputs = [
            *((f"model {role!r}", path) for role, path in job.models.items()),
            ("eval set", job.examples_path),
        ]
        for what, path in inputs:
            if not storage.exists(path):
                raise dg.Failure(f"evaluation {job.run_id}: {what} not found: {path}", allow_retries=False)

    def _check_job(self, job: TrainingJob) -> None:
        """Fail before spending minutes on process start-up, with the reason in the message; retrying won't help."""
        self._check_accelerator("training", job.run_id, job.accelerator)
        if (Path(job.output_dir) / COMPLETION_MARKER).exists():
            raise dg.Failure(
                f"training {job.run_id}: checkpoint {job.output_dir} is already complete; a new run "
                "needs a new run_id",
                allow_retries=False,
            )
        try:  # a wrong DeepSpeed field or model preset fails here, in seconds, not after the cluster's queue
            # (these import torch and transformers, 3+ s: only when a training is launched, not at every load)
            from nexa_dagster.core.training.loop import fill_deepspeed_config
            from nexa_dagster.core.training.model.config import build_model_config

            fill_deepspeed_config(job, self.world_size())
            build_model_config(job.model_preset, vocab_size=32)
            if job.init_from:  # a wrong architecture or vocabulary fails here, not after the model is loaded
                from transformers import AutoTokenizer  # as above: at a launch, not at every load

                check_init_checkpoint(
                    job.init_from, AutoTokenizer.from_pretrained(job.tokenizer_path), f"{job.train_path}"
                )
        except (ValueError, TypeError, FileNotFoundError) as e:
            raise dg.Failure(f"training {job.run_id}: invalid configuration: {e}", allow_retries=False) from e
        for name, path in (("train", job.train_path), ("validation", job.validation_path)):
            if not storage.exists(path):
                raise dg.Failure(f"training {job.run_id}: {name} data not found: {path}", allow_retries=False)


def _prepare(launch: WorkerLaunch, job_json: str) -> None:
    """Write the job file; remove a previous attempt's failure reports and stderr copies (not this one's)."""
    launch.work_dir.mkdir(parents=True, exist_ok=True)
    launch.job_file.write_text(job_json, encoding="utf-8")
    for pattern in (STDERR_LOG, FAILURE_FILE):
        for old in launch.work_dir.glob(pattern.format(rank="*")):
            old.unlink()


def _worker_spoke(work_dir: Path) -> bool:
    """A rank wrote its failure report or its stderr copy: it got as far as running the project's code."""
    return any(work_dir.glob(FAILURE_FILE.format(rank="*"))) or any(
        work_dir.glob(STDERR_LOG.format(rank="*"))
    )


_IMPORT_ERROR = re.compile(r"\b(ModuleNotFoundError|ImportError)\b|No module named ")


def import_error_line(text: str) -> str | None:
    """The first line of ``text`` that reports a module Python could not import, or None."""
    return next((line.strip() for line in text.splitlines() if _IMPORT_ERROR.search(line)), None)


def worker_failure(launch: WorkerLaunch, what: str, import_problem: str | None = None) -> dg.Failure:
    """The step's failure, with the worker's stderr tail; retried by the step's retry policy only if no rank
    reported a failure that a relaunch repeats (a non-finite loss, bad data or configuration, an unknown benchmark
    task) and the worker could import its code. A worker whose Python cannot import it (``import_problem``, or an
    ImportError in what the backend or the worker's stderr said) fails the same way on every relaunch: not
    retried. A worker that died without a word (a lost node, a killed process) or stopped on SIGTERM with its
    state saved is retried."""
    work_dir = launch.work_dir
    reports = [
        json.loads(f.read_text(encoding="utf-8"))
        for f in sorted(work_dir.glob(FAILURE_FILE.format(rank="*")))
    ]
    permanent = [r for r in reports if not r.get("retryable", True)]
    tail = stderr_tail(work_dir)
    if not permanent and not reports:
        cannot_import = import_problem or import_error_line(f"{what}\n{tail}")
        if cannot_import:
            permanent = [
                {
                    "message": f"{cannot_import} (the installation does not match this checkout: moved or "
                    "copied from another path? rebuild it with `make install`)"
                }
            ]
    verdict = (
        f"not retried, it would fail again: {permanent[0]['message']}"
        if permanent
        else "retried if the step's retry policy allows"
        + (" (a relaunch resumes from the last saved state)" if launch.kind == "training" else "")
    )
    return dg.Failure(
        description=f"{launch.kind} {launch.run_id} failed ({what}); {verdict}; the worker's stderr ended "
        f"with:\n{tail}",
        metadata={
            "job_file": dg.MetadataValue.path(str(launch.job_file)),
            "stderr_tail": dg.MetadataValue.text(tail),
            "retryable": not permanent,
        },
        allow_retries=not permanent,
    )


def stderr_tail(log_dir: Path, lines: int = STDERR_TAIL_LINES) -> str:
    """The last lines of every rank's stderr copy, rank 0 first: where the worker's traceback and message are."""
    parts = []
    for log in sorted(log_dir.glob(STDERR_LOG.format(rank="*"))):
        text = log.read_text(encoding="utf-8", errors="replace").rstrip().splitlines()[-lines:]
        parts.append(f"--- {log.name}\n" + "\n".join(text))
    return (
        "\n".join(parts)
        if parts
        else "(no stderr copy: see the step's stderr in the Dagster run, or the Slurm output file)"
    )


def read_result(job: TrainingJob) -> TrainingResult:
    summary = Path(job.output_dir) / "training_summary.json"
    if not summary.exists():
        raise dg.Failure(f"training {job.run_id}: the worker exited cleanly but wrote no {summary}")
    return TrainingResult.model_validate(json.loads(summary.read_text(encoding="utf-8")))
