"""The GPU-cluster resource: where training runs, launched and watched through Dagster Pipes.

The asset hands over a ``TrainingJob``; this resource starts the worker process and streams its log lines and
final metrics into the Dagster run, then returns the ``TrainingResult`` the worker wrote beside the checkpoint.
Three backends, one worker (``core/training/launch_specs.py`` builds what each one submits):

* ``local``: this machine's GPUs (or CPU ranks), through ``PipesSubprocessClient``; ``torchrun`` for several ranks;
* ``slurm``: an ``sbatch`` script (one task per node, ``torchrun`` inside), job id, polling with ``scontrol``/
  ``sacct``, ``scancel`` when the Dagster run is cancelled; Pipes context and messages go through files in the
  run's work directory, which must be on a filesystem the nodes share;
* ``kubernetes``: Dagster's ``PipesK8sClient`` (package ``dagster-k8s``) with a pod spec from this config.

Stopping: cancelling the Dagster run makes the local backend send SIGINT to the worker (or to ``torchrun``), the
Slurm backend ``scancel`` the job, and ``PipesK8sClient`` delete the pod; a local worker also exits by itself when
the launching process disappears (a killed run worker), so no orphan keeps a GPU busy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import dagster as dg
from pydantic import Field

from nexa_dagster.core import storage
from nexa_dagster.core.evaluation_worker import EvaluationJob
from nexa_dagster.core.tiny_model import COMPLETION_MARKER
from nexa_dagster.core.training import launch_specs
from nexa_dagster.core.training.job import TrainingJob, TrainingResult
from nexa_dagster.core.training.worker import ECHO_ENV, FAILURE_FILE, LAUNCHER_PID_ENV, STDERR_LOG

SLURM_DONE = {"COMPLETED"}
SLURM_FAILED = {"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
                "DEADLINE"}

SLURM_UNKNOWN_GRACE_S = 120.0  # how long a job Slurm does not know is waited for (a controller restart)
BACKENDS = ("local", "slurm", "kubernetes")
ACCELERATORS = ("cpu", "cuda")
STDERR_TAIL_LINES = 40


class GPUClusterResource(dg.ConfigurableResource):
    """Runs training jobs off the Dagster process; configured per deployment (tiny CPU demo vs. GPU cluster)."""

    backend: str = Field(default="local", description="local | slurm | kubernetes")
    num_procs: int = Field(default=1, ge=1, description="ranks per node; more than one launches torchrun")
    accelerator: str = Field(default="cpu", description="cpu | cuda: what the cluster's nodes provide")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables for the worker")
    python_executable: str = Field(default="", description="interpreter for the worker (default: this one)")
    # slurm
    nodes: int = Field(default=1, ge=1, description="slurm: nodes per job (num_procs ranks on each)")
    slurm_partition: str = ""
    slurm_account: str = ""
    slurm_time_limit: str = "24:00:00"
    slurm_stop_warning_s: int = Field(
        default=120, ge=1, description="slurm: SIGTERM reaches the worker this long before the time limit; it saves "
                                       "its resumable state and stops, so a relaunch resumes (one step plus a save "
                                       "must fit; Slurm may signal up to 60 s earlier)")
    slurm_cpus_per_task: int = Field(default=8, ge=1)
    slurm_extra_directives: list[str] = Field(default_factory=list, description='e.g. ["--qos=high"]')
    slurm_setup_commands: list[str] = Field(default_factory=list,
                                            description="shell lines run before the worker (module load, venv)")
    poll_interval_s: float = Field(default=5.0, gt=0, description="slurm: how often the job's state is read")
    # kubernetes
    k8s_image: str = Field(default="", description="kubernetes: image with nexa-dagster installed")
    k8s_namespace: str = "default"
    k8s_data_pvc: str = Field(default="", description="kubernetes: PVC holding data/ and the run's work dir")
    k8s_data_mount: str = "/data"
    k8s_node_selector: dict[str, str] = Field(default_factory=dict)
    k8s_tolerations: list[dict[str, str]] = Field(default_factory=list)
    k8s_cpu: str = "8"
    k8s_memory: str = "64Gi"
    k8s_pod_wait_timeout_s: float = Field(
        default=0, ge=0, description="kubernetes: give up waiting for the training pod after this long (0: wait "
                                     "as long as it runs; a hung worker is ended by its stall watchdog)")

    def worker_command(self, job_file: Path, log_dir: Path) -> list[str]:
        """The local worker's command line: ``python -m ...worker``, under ``torchrun`` for more than one rank."""
        return launch_specs.worker_argv(self.python_executable or sys.executable, str(job_file), str(log_dir),
                                        self.num_procs)

    def sbatch_script(self, job: TrainingJob, job_file: Path, log_dir: Path, env: dict[str, str]) -> str:
        return launch_specs.sbatch_script(
            run_id=job.run_id, python=self.python_executable or sys.executable, job_file=str(job_file),
            log_dir=str(log_dir), procs_per_node=self.num_procs, nodes=self.nodes, gpus=self.accelerator == "cuda",
            env=env, partition=self.slurm_partition, account=self.slurm_account, time_limit=self.slurm_time_limit,
            stop_warning_s=self.slurm_stop_warning_s, cpus_per_task=self.slurm_cpus_per_task,
            extra_directives=self.slurm_extra_directives, setup_commands=self.slurm_setup_commands)

    def pod_spec(self, job: TrainingJob, job_file: Path, log_dir: Path) -> dict[str, Any]:
        return launch_specs.k8s_pod_spec(
            run_id=job.run_id, image=self.k8s_image, job_file=str(job_file), log_dir=str(log_dir),
            procs_per_node=self.num_procs, gpus=self.accelerator == "cuda", data_pvc=self.k8s_data_pvc,
            data_mount=self.k8s_data_mount, node_selector=self.k8s_node_selector, tolerations=self.k8s_tolerations,
            cpu=self.k8s_cpu, memory=self.k8s_memory)

    def run_training(self, context: dg.AssetExecutionContext, job: TrainingJob,
                     work_dir: Path) -> tuple[TrainingResult, dg.PipesClientCompletedInvocation]:
        """Run ``job`` to completion; return the worker's ``TrainingResult`` and the Pipes invocation.

        For the caller: the worker reports its final metrics as this asset's materialization. An asset without
        an output value returns ``invocation.get_materialize_result()`` (metadata included); an asset that returns
        its own value merges ``invocation.get_materialize_result().metadata`` into its ``dg.Output``. The whole
        ``TrainingResult`` is also a custom message (``invocation.get_custom_messages()[-1]``). A step that opened
        a Pipes session must return typed results (``Output``/``MaterializeResult``), not a bare value.

        Raises ``dg.Failure`` (with the worker's stderr tail) if the worker fails, or before launching if an
        input is missing or the backend lacks what it needs.
        """
        self._check_backend()
        self._check_job(job)
        work_dir.mkdir(parents=True, exist_ok=True)
        job_file = work_dir / "job.json"
        job_file.write_text(job.model_dump_json(indent=2), encoding="utf-8")
        for pattern in (STDERR_LOG, FAILURE_FILE):  # a previous attempt's, not this one's
            for old in work_dir.glob(pattern.format(rank="*")):
                old.unlink()
        if self.num_procs != job.settings.num_procs:
            per_rank = job.settings.micro_batch_size * job.settings.gradient_accumulation_steps
            context.log.warning(f"the scale preset trains on {job.settings.num_procs} ranks, this cluster runs "
                                f"{self.num_procs}: each step sees {per_rank * self.num_procs} packed rows instead "
                                f"of the recipe's {per_rank * job.settings.num_procs}")
        env = {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **self.env}
        try:
            if self.backend == "slurm":
                invocation = self._run_slurm(context, job, job_file, work_dir, env)
            elif self.backend == "kubernetes":
                invocation = self._run_kubernetes(context, job, job_file, work_dir, env)
            else:
                command = self.worker_command(job_file, work_dir)
                context.log.info(f"launching {' '.join(command)}")
                invocation = dg.PipesSubprocessClient().run(
                    context=context, command=command,
                    env={**env, LAUNCHER_PID_ENV: str(os.getpid()), ECHO_ENV: "0"},
                    cwd=str(work_dir))
        except dg.Failure:
            raise
        except Exception as e:  # a failed worker (DagsterPipesExecutionError is not public API) or launch;
            raise worker_failure(job, work_dir, str(e)) from e  # a cancelled run (BaseException) passes through
        return read_result(job), invocation

    def run_evaluation(self, context: dg.AssetExecutionContext, job: EvaluationJob, work_dir: Path) -> dict[str, Any]:
        """Score ``job``'s models on the eval set in the evaluation worker, off the Dagster process, on this
        cluster's accelerator; return what the worker wrote (``core.evaluation_worker.run``).

        The local backend only, for now: on ``slurm``/``kubernetes`` this fails at once, before loading anything
        (serve the models with an OpenAI-compatible engine instead, or evaluate on a local GPU node).
        """
        self._check_backend()
        if self.backend != "local":
            raise dg.Failure(f"evaluation {job.run_id}: the evaluation worker runs on the local backend only; "
                             f"this cluster is {self.backend!r}", allow_retries=False)
        if job.accelerator != self.accelerator:
            raise dg.Failure(f"evaluation {job.run_id} asks for accelerator {job.accelerator!r} but this cluster "
                             f"provides {self.accelerator!r}", allow_retries=False)
        work_dir.mkdir(parents=True, exist_ok=True)
        job_file = work_dir / "eval_job.json"
        job_file.write_text(job.model_dump_json(indent=2), encoding="utf-8")
        if storage.exists(job.output_path):  # an earlier attempt's scores are not this attempt's
            storage.remove(job.output_path)
        command = [self.python_executable or sys.executable, "-m", "nexa_dagster.core.evaluation_worker",
                   "--job", str(job_file)]
        context.log.info(f"launching {' '.join(command)}")
        env = {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **self.env,
               LAUNCHER_PID_ENV: str(os.getpid())}
        failure_file = work_dir / FAILURE_FILE.format(rank=0)  # written by the worker as training's are
        failure_file.unlink(missing_ok=True)  # a previous attempt's, not this one's
        try:
            dg.PipesSubprocessClient().run(context=context, command=command, env=env, cwd=str(work_dir))
        except dg.Failure:
            raise
        except Exception as e:  # the worker failed; its traceback is in the step's stderr
            report = json.loads(failure_file.read_text(encoding="utf-8")) if failure_file.exists() else {}
            retryable = report.get("retryable", True)  # died without a word (killed, lost): worth another go
            verdict = "retried if the step's retry policy allows" if retryable else "not retried, it would fail again"
            raise dg.Failure(f"{report.get('message') or f'evaluation {job.run_id} failed in the evaluation worker'}"
                             f" ({e}); {verdict}", metadata={"job_file": dg.MetadataValue.path(str(job_file))},
                             allow_retries=retryable) from e
        if not storage.exists(job.output_path):
            raise dg.Failure(f"evaluation {job.run_id}: the worker exited cleanly but wrote no {job.output_path}")
        return storage.read_json(job.output_path)

    def _run_slurm(self, context: dg.AssetExecutionContext, job: TrainingJob, job_file: Path, work_dir: Path,
                   env: dict[str, str]) -> dg.PipesClientCompletedInvocation:
        """Submit with ``sbatch``, poll until the job ends, ``scancel`` it if this step is interrupted."""
        if shutil.which("sbatch") is None:
            raise dg.Failure("backend 'slurm': sbatch is not on PATH of the Dagster step process",
                             allow_retries=False)
        with dg.open_pipes_session(
            context=context,
            context_injector=dg.PipesFileContextInjector(str(work_dir / "pipes_context.json")),
            message_reader=dg.PipesFileMessageReader(str(work_dir / "pipes_messages.jsonl")),
        ) as session:
            script = work_dir / "train.sbatch"
            script.write_text(self.sbatch_script(job, job_file, work_dir,
                                                 {**env, **session.get_bootstrap_env_vars()}), encoding="utf-8")
            job_id = _run(["sbatch", "--parsable", str(script)]).split(";")[0].strip()
            context.log.info(f"submitted Slurm job {job_id} ({script})")
            try:
                state = wait_for_slurm_job(job_id, self.poll_interval_s, context.log.info)
            except BaseException:
                subprocess.run(["scancel", job_id], check=False)
                context.log.warning(f"cancelled Slurm job {job_id}")
                raise
            if state not in SLURM_DONE:
                out = work_dir / f"slurm-{job_id}.out"
                text = out.read_text(errors="replace")[-4000:] if out.exists() else "(no output file)"
                raise worker_failure(job, work_dir, f"Slurm job {job_id} ended {state}; output ends with:\n{text}")
        return dg.PipesClientCompletedInvocation(session)

    def _run_kubernetes(self, context: dg.AssetExecutionContext, job: TrainingJob, job_file: Path,
                        work_dir: Path, env: dict[str, str]) -> dg.PipesClientCompletedInvocation:
        try:
            from dagster_k8s import PipesK8sClient
        except ImportError:
            raise dg.Failure("backend 'kubernetes' needs the dagster-k8s package (pip install dagster-k8s)",
                             allow_retries=False) from None
        if not self.k8s_image:
            raise dg.Failure("backend 'kubernetes' needs k8s_image", allow_retries=False)
        return PipesK8sClient().run(context=context, **self.k8s_run_arguments(job, job_file, work_dir, env))

    def k8s_run_arguments(self, job: TrainingJob, job_file: Path, work_dir: Path,
                          env: dict[str, str]) -> dict[str, Any]:
        """What ``PipesK8sClient.run`` gets besides the context. ``pod_wait_timeout`` is always passed: its
        default (86,400 s) would end every training longer than a day; 0 means no limit there."""
        spec = self.pod_spec(job, job_file, work_dir)
        return {"image": self.k8s_image, "namespace": self.k8s_namespace, "command": spec["containers"][0]["command"],
                "env": env, "base_pod_spec": spec, "pod_wait_timeout": self.k8s_pod_wait_timeout_s}

    def _check_backend(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"GPUClusterResource.backend must be one of {BACKENDS}, got {self.backend!r}")

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
        try:  # a wrong DeepSpeed field or model preset fails here, in seconds, not after the cluster's queue
            from nexa_dagster.core.tiny_model import build_model_config
            from nexa_dagster.core.training.loop import fill_deepspeed_config

            fill_deepspeed_config(job, self.num_procs * self.nodes)
            build_model_config(job.model_preset, vocab_size=32)
            if job.init_from:  # a wrong architecture or vocabulary fails here, not after the model is loaded
                from transformers import AutoTokenizer

                from nexa_dagster.core.training.init import check_init_checkpoint

                check_init_checkpoint(job.init_from, AutoTokenizer.from_pretrained(job.tokenizer_path),
                                      f"{job.train_path}")
        except (ValueError, TypeError, FileNotFoundError) as e:
            raise dg.Failure(f"training {job.run_id}: invalid configuration: {e}", allow_retries=False) from e
        for name, path in (("train", job.train_path), ("validation", job.validation_path)):
            if not storage.exists(path):
                raise dg.Failure(f"training {job.run_id}: {name} data not found: {path}", allow_retries=False)


def worker_failure(job: TrainingJob, work_dir: Path, what: str) -> dg.Failure:
    """The step's failure, with the worker's stderr tail; retried by the step's retry policy only if no rank
    reported a failure that a relaunch repeats (a non-finite loss, bad data or configuration). A worker that died
    without a word (a lost node, a killed process) or stopped on SIGTERM with its state saved is retried."""
    reports = [json.loads(f.read_text(encoding="utf-8")) for f in sorted(work_dir.glob(FAILURE_FILE.format(rank="*")))]
    permanent = [r for r in reports if not r.get("retryable", True)]
    tail = stderr_tail(work_dir)
    verdict = (f"not retried, it would fail again: {permanent[0]['message']}" if permanent
               else "retried if the step's retry policy allows (a relaunch resumes from the last saved state)")
    return dg.Failure(
        description=f"training {job.run_id} failed ({what}); {verdict}; the worker's stderr ended with:\n{tail}",
        metadata={"job_file": dg.MetadataValue.path(str(work_dir / "job.json")),
                  "stderr_tail": dg.MetadataValue.text(tail), "retryable": not permanent},
        allow_retries=not permanent,
    )


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


def _run(command: list[str]) -> str:
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise dg.Failure(f"{' '.join(command)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout}")
    return proc.stdout


def slurm_job_fields(job_id: str) -> dict[str, str]:
    """``scontrol show job`` as a dict (the controller keeps finished jobs for MinJobAge); empty if unknown."""
    proc = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    if proc.returncode != 0:
        return {}
    return dict(f.split("=", 1) for f in proc.stdout.split() if "=" in f)


def slurm_state(job_id: str) -> str:
    """The job's state from the controller, else from accounting (``sacct``, where the cluster runs slurmdbd)."""
    state = slurm_job_fields(job_id).get("JobState")
    if state:
        return state
    proc = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines() if proc.returncode == 0 else []
    return lines[0].split()[0] if lines else "UNKNOWN"


def wait_for_slurm_job(job_id: str, poll_s: float, log: Any, unknown_grace_s: float = SLURM_UNKNOWN_GRACE_S) -> str:
    """Poll until the job ends; log each change of state, with Slurm's reason while it waits (a job asking for
    more than the partition has waits forever with reason PartitionConfig: the log says so).

    A job neither the controller nor accounting knows (``UNKNOWN``: a wrong id, a job purged after ``MinJobAge``
    on a cluster without ``slurmdbd``, a controller that lost its state) is waited for ``unknown_grace_s`` (a
    controller restarting comes back), then a ``RuntimeError`` says so instead of polling forever."""
    last = ""
    unknown_since: float | None = None
    while True:
        state = slurm_state(job_id)
        if state == "UNKNOWN":
            unknown_since = time.monotonic() if unknown_since is None else unknown_since
            if time.monotonic() - unknown_since > unknown_grace_s:
                raise RuntimeError(f"Slurm job {job_id}: neither the controller (scontrol show job) nor accounting "
                                   f"(sacct) has known it for {unknown_grace_s:.0f} s; its outcome cannot be read")
        else:
            unknown_since = None
        reason = slurm_job_fields(job_id).get("Reason", "None") if state == "PENDING" else "None"
        shown = state if reason == "None" else f"{state} ({reason})"
        if shown != last:
            log(f"Slurm job {job_id}: {shown}")
            last = shown
        if state in SLURM_DONE | SLURM_FAILED:
            return state
        time.sleep(poll_s)
