"""A small GRPO job on the project's pretrained tiny model, on a task the tiny model can learn: what the GRPO tests
run through the real worker.

The task: every prompt (a standard-library docstring question in the words of ``configs/benchmarks/nexa_stdlib``)
has the checkable answer ``5``. The shipped tiny model (pretrained as a 1-5 judge) first answers "1" about half the
time and "5" about a third, so K samples of a prompt usually disagree (a learning signal in most groups) and the
reward can visibly rise in a few steps; nothing else about the task is easy for it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from nexa_dagster.core.common.config import TrainingSettings, load_deepspeed_config
from nexa_dagster.core.training.job import GRPOObjective, TrainingJob
from support.worker_launch import LaunchedWorker, start_worker_process

MODULES = [
    "json",
    "pickle",
    "csv",
    "shelve",
    "marshal",
    "re",
    "os",
    "sys",
    "math",
    "heapq",
    "bisect",
    "string",
]


def write_prompts(path: Path, count: int, offset: int = 0, answer: str = "5") -> str:
    """``count`` prompts in rl_prompts' format (a string prompt, a system prompt) with ``answer`` and ``task``."""
    rows = []
    for i in range(offset, offset + count):
        module = MODULES[i % len(MODULES)]
        rows.append(
            {
                "sample_id": f"p{i:04d}",
                "system_prompt": "You are a careful assistant.",
                "prompt": f"Rate from 1 to 5 how well the {module} module documents item {i}.",
                "answer": answer,
                "task": "rating",
                "reference_answer": answer,
            }
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def grpo_job(
    tmp_path: Path,
    init_from: Path,
    prompts_path: str,
    held_out_path: str = "",
    steps: int = 6,
    run_id: str = "grpo-run",
    num_generations: int = 8,
    prompts_per_step: int = 2,
    lr: float = 2e-3,
    **overrides: Any,
) -> TrainingJob:
    """A GRPO job from ``init_from`` (also its tokenizer) with the exact_answer reward."""
    objective = {
        "prompts_path": prompts_path,
        "held_out_path": held_out_path,
        "rewards": [{"name": "exact_answer", "weight": 1.0}],
        "num_generations": num_generations,
        "prompts_per_step": prompts_per_step,
        "max_completion_tokens": 6,
        **{k: overrides.pop(k) for k in list(overrides) if k in GRPOObjective.model_fields},
    }
    settings = {
        "max_steps": steps,
        "micro_batch_size": num_generations,
        "gradient_accumulation_steps": prompts_per_step,
        "learning_rate": lr,
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "grad_clip": 1.0,
        "log_every": 1,
        "seed": 0,
        "num_procs": 1,
        **overrides,
    }
    return TrainingJob(
        run_id=run_id,
        tokenizer_path=str(init_from),
        model_preset="tiny",
        deepspeed_config=load_deepspeed_config("zero1_cpu.json"),
        settings=TrainingSettings(**settings),
        output_dir=str(tmp_path / "checkpoints" / run_id),
        dataset_run_hash="rlprompts0001",
        accelerator="cpu",
        data_kind="rl_prompts",
        init_from=str(init_from),
        parent="production:test",
        objective=GRPOObjective(**objective),
    )


def start_worker(job: TrainingJob, tmp_path: Path, env: dict[str, str] | None = None) -> LaunchedWorker:
    """The training worker on ``job`` as a process of its own session (a test kills its group), forked from the
    warm Python where it can be (``support.worker_launch``), its stdout and stderr together."""
    job_file = tmp_path / f"{job.run_id}.json"
    job_file.write_text(job.model_dump_json())
    return start_worker_process(
        [sys.executable, "-m", "nexa_dagster.core.training.worker", "--job", str(job_file)],
        env=env,
        own_session=True,
    )


def rollouts(job: TrainingJob) -> list[tuple[int, int, str, float]]:
    """Every rollout of a run: (step, prompt index, completion, reward), from its rollouts file."""
    lines = Path(job.output_dir + ".rollouts.jsonl").read_text().splitlines()
    return [(r["step"], r["prompt"], r["completion"], r["reward"]) for r in map(json.loads, lines)]
