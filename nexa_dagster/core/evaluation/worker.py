"""The evaluation process: ``python -m nexa_dagster.core.evaluation.worker --job eval_job.json``.

Launched by the GPU-cluster resource (``run_evaluation``) where training runs, in the ``gpu`` pool, never inside the
Dagster run worker: it loads each model in turn (the candidate, then production), scores every eval-set example
and answers the held-out prompts, runs the configured lm-evaluation-harness tasks on it (``core.benchmarks``), and writes ``ModelScores`` per model to ``output_path``. The judge and the
statistics stay in the Dagster process (the judge is an endpoint; the statistics are cheap). Under Dagster Pipes
the progress lines go to the run's log; run by hand they are printed.

Exit codes: 0 done, 1 evaluation failed, 2 unusable job file, 130 interrupted. A failure that running the job
again repeats (a bad task name, a missing file, a wrong value) is also reported beside the job file, as the
training worker reports it (``training.worker.write_failure``), so that the launching step fails at once instead of retrying it.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nexa_dagster import settings
from nexa_dagster.core.common import storage, threads
from nexa_dagster.core.common.config import BenchmarkSettings
from nexa_dagster.core.common.workers import exit_with_launcher, is_permanent, write_failure
from nexa_dagster.core.evaluation.benchmarks import resolve_tasks, run_benchmarks
from nexa_dagster.core.evaluation.scoring import AnswerSampling, score_model


class EvaluationJob(BaseModel):
    """What the worker scores: models by role, on one eval-set version's examples, answering the prompts."""

    model_config = ConfigDict(extra="forbid")

    run_id: str = Field(min_length=1)
    models: dict[str, str] = Field(min_length=1, description="role (candidate, production) -> HF directory")
    examples_path: str
    eval_set_version: int = Field(ge=1)
    prompts: list[str]
    max_new_tokens: int = Field(gt=0)
    accelerator: Literal["cpu", "cuda"] = "cpu"
    batch_size: int = Field(default=8, gt=0)
    output_path: str
    benchmarks: BenchmarkSettings | None = Field(
        default=None,
        description=("lm-evaluation-harness tasks run after the eval-set scores (None or no tasks: none)"),
    )
    answer_samples: int = Field(
        default=0, ge=0, description="k answers sampled per prompt beside the greedy one (0: greedy only)"
    )
    answer_temperature: float = Field(default=1.0, gt=0, description="the sampled answers' temperature")
    answer_top_p: float = Field(default=1.0, gt=0, le=1, description="the sampled answers' nucleus")
    answer_seed: int = Field(default=0, description="the sampled answers' seed, the same for every model")
    answer_engine: Literal["transformers", "vllm"] = Field(
        default="transformers",
        description="what samples the k answers: transformers (the scoring's own model) or a vLLM engine",
    )
    benchmark_roles: list[str] = Field(
        default=["candidate"],
        description=(
            "the models the benchmarks run on: production too only when the promotion gate compares a benchmark"
        ),
    )


def run(job: EvaluationJob, log: Any = print) -> dict[str, Any]:
    device = "cuda" if job.accelerator == "cuda" else "cpu"
    tasks = None
    if job.benchmarks is not None and job.benchmarks.tasks:
        tasks = resolve_tasks(
            job.benchmarks, log
        )  # an unknown task or missing file fails before any model loads
    out: dict[str, Any] = {"run_id": job.run_id, "eval_set_version": job.eval_set_version, "scores": {}}
    for role, path in job.models.items():
        log(f"{job.run_id}: scoring {role} ({path}) on eval set v{job.eval_set_version} ({device})")
        scores = score_model(
            path,
            job.examples_path,
            job.prompts,
            job.max_new_tokens,
            device=device,
            batch_size=job.batch_size,
            log=log,
            label=f"{job.run_id} {role}",
            sampling=AnswerSampling(
                job.answer_samples,
                job.answer_temperature,
                job.answer_top_p,
                job.answer_seed,
                engine=job.answer_engine,
                log_dir=str(Path(job.output_path).parent),
            )
            if job.answer_samples
            else None,
        )
        if tasks is not None and job.benchmarks is not None and role in job.benchmark_roles:
            scores.benchmarks = run_benchmarks(
                path, job.benchmarks, tasks, device, log, f"{job.run_id} {role}"
            )
        out["scores"][role] = scores.to_json()
        if device == "cuda":
            import torch  # loaded by the scoring by now; the code location loads this module without it

            torch.cuda.empty_cache()
    storage.write_json(out, job.output_path)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Score models on a frozen eval set (one EvaluationJob).")
    parser.add_argument("--job", required=True, help="path of the EvaluationJob JSON")
    args = parser.parse_args(argv)
    try:
        job = EvaluationJob.model_validate_json(Path(args.job).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        print(f"unusable evaluation job {args.job}: {e}", file=sys.stderr, flush=True)
        return 2
    exit_with_launcher()
    threads.use(settings.thread_policy("evaluation"))  # this machine's share (its launcher's may be another)
    pipes: Any = None
    if settings.PIPES_CONTEXT.is_set():
        # only under a Pipes launch: a worker run by hand has none
        from dagster_pipes import open_dagster_pipes

        pipes = open_dagster_pipes()

    def log(message: str) -> None:
        print(message, flush=True)
        if pipes is not None:
            pipes.log.info(message)

    try:
        out = run(job, log)
        if pipes is not None:
            pipes.report_custom_message({"output_path": job.output_path, "roles": sorted(out["scores"])})
        return 0
    except KeyboardInterrupt:
        print(f"evaluation {job.run_id} interrupted", file=sys.stderr, flush=True)
        return 130
    except Exception as e:
        traceback.print_exc()
        message = f"evaluation {job.run_id} failed: {type(e).__name__}: {e}"
        print(message, file=sys.stderr, flush=True)
        write_failure(str(Path(args.job).parent), 0, e, message, retryable=not is_permanent(e))
        if pipes is not None:
            pipes.__exit__(type(e), e, e.__traceback__)
            pipes = None
        return 1
    finally:
        if pipes is not None:
            pipes.__exit__(None, None, None)


if __name__ == "__main__":
    sys.exit(main())
