"""A small training job on random packed rows, and a training launched from a Dagster process of its own: what the
training, Slurm and pretraining tests start the real worker with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from nexa_dagster.core.common.config import TrainingSettings, load_deepspeed_config
from nexa_dagster.core.packaging.packing import labels_of
from nexa_dagster.core.tiny.model import SPECIAL_TOKENS
from nexa_dagster.core.training.job import TrainingJob

PACK_SIZE = 64


def write_packed(path: Path, rows: int, vocab_size: int, pad_id: int, seed: int = 0) -> str:
    """A packed Parquet file in the packaging stage's format: per row, documents of a prompt (loss 0) and an
    answer (loss 1), position ids restarting at each document, padding (attention 0) at the end, and the
    ``labels`` column the trainer reads."""
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(rows):
        input_ids, loss_mask, position_ids, docs = [], [], [], 0
        while True:
            prompt, answer = int(rng.integers(4, 12)), int(rng.integers(4, 16))
            if len(input_ids) + prompt + answer > PACK_SIZE:
                break
            input_ids += rng.integers(len(SPECIAL_TOKENS), vocab_size, prompt + answer).tolist()
            loss_mask += [0] * prompt + [1] * answer
            position_ids += list(range(prompt + answer))
            docs += 1
        real, pad = len(input_ids), PACK_SIZE - len(input_ids)
        records.append(
            {
                "input_ids": input_ids + [pad_id] * pad,
                "loss_mask": loss_mask + [0] * pad,
                "position_ids": position_ids + [0] * pad,
                "attention_mask": [1] * real + [0] * pad,
                "num_documents": docs,
            }
        )
    frame = pd.DataFrame(records)
    frame["labels"] = [
        labels_of(*(np.asarray(r[c]) for c in ("input_ids", "loss_mask", "attention_mask", "position_ids")))
        for r in records
    ]
    frame["loss_mask"] = frame["loss_mask"].map(lambda v: np.asarray(v, dtype=np.int8))
    frame["attention_mask"] = frame["attention_mask"].map(lambda v: np.asarray(v, dtype=np.int8))
    frame.to_parquet(path)
    return str(path)


def make_job(
    tmp_path: Path,
    teacher_dir: Path,
    steps: int,
    rows: int = 8,
    lr: float = 3e-3,
    log_every: int = 2,
    run_id: str = "test-run",
    num_procs: int = 1,
    **settings: Any,
) -> TrainingJob:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    vocab, pad = len(tokenizer), tokenizer.pad_token_id
    training = TrainingSettings(
        max_steps=steps,
        micro_batch_size=2,
        gradient_accumulation_steps=1,
        learning_rate=lr,
        warmup_steps=1,
        weight_decay=0.0,
        grad_clip=1.0,
        log_every=log_every,
        seed=0,
        num_procs=num_procs,
        **settings,
    )
    return TrainingJob(
        run_id=run_id,
        train_path=write_packed(tmp_path / "train.parquet", rows, vocab, pad, seed=1),
        validation_path=write_packed(tmp_path / "validation.parquet", 2, vocab, pad, seed=2),
        tokenizer_path=str(teacher_dir),
        model_preset="tiny",
        deepspeed_config=load_deepspeed_config("zero1_cpu.json"),
        settings=training,
        output_dir=str(tmp_path / "checkpoints" / run_id),
        dataset_run_hash="abc12345",
        accelerator="cpu",
    )


LAUNCH_SCRIPT = """
import json
import sys
from pathlib import Path

import dagster as dg

from nexa_dagster.core.training.job import TrainingJob
from nexa_dagster.resources.gpu_cluster import GPUClusterResource, gpu_cluster_from_settings

job = TrainingJob.model_validate_json(Path(sys.argv[1]).read_text())
cluster = gpu_cluster_from_settings(json.loads(sys.argv[3]))


@dg.asset
def trained(context: dg.AssetExecutionContext, gpu_cluster: GPUClusterResource) -> dg.MaterializeResult:
    return gpu_cluster.run_training(context, job, Path(sys.argv[2]))[1].get_materialize_result()


result = dg.materialize([trained], resources={"gpu_cluster": cluster}, raise_on_error=False)
print("RUN SUCCESS" if result.success else "RUN FAILED", flush=True)
"""


def launch_training_in_dagster(
    tmp_path: Path,
    teacher_dir: Path,
    cluster: dict[str, object] | None = None,
    timeout_s: float = 120,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], Path]:
    """Materialize a long training asset in a separate Dagster process (``gpu_cluster_from_settings(cluster)``,
    ``env`` added to this process's environment); return the process and its log once the worker reports its
    first step."""
    job = make_job(tmp_path, teacher_dir, steps=100_000, log_every=1)
    (tmp_path / "job.json").write_text(job.model_dump_json())
    (tmp_path / "launch.py").write_text(textwrap.dedent(LAUNCH_SCRIPT))
    log = tmp_path / "launch.log"
    with open(log, "wb") as out:
        launcher = subprocess.Popen(
            [
                sys.executable,
                str(tmp_path / "launch.py"),
                str(tmp_path / "job.json"),
                str(tmp_path / "work"),
                json.dumps(cluster or {}),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
    deadline = time.monotonic() + timeout_s
    while "step 1/" not in log.read_text(errors="replace"):
        assert launcher.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[
            -3000:
        ]
        time.sleep(0.5)
    return launcher, log


def end_process_group() -> None:
    """Destroy this process's torch.distributed group and forget DeepSpeed's cached groups.

    For tests that build a real engine in the test process: DeepSpeed keeps the world and data-parallel groups in
    module globals (``deepspeed.utils.groups``), so a second in-process engine in the same xdist worker would reuse
    a destroyed group ("Group ... is not registered"). A worker process never needs this: it has one group."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    if dist.is_initialized():
        dist.destroy_process_group()
    groups._WORLD_GROUP = None
    groups._DATA_PARALLEL_GROUP = None
    groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
    for cache in (
        groups._EXPERT_PARALLEL_GROUP,
        groups._EXPERT_PARALLEL_GROUP_RANKS,
        groups._EXPERT_DATA_PARALLEL_GROUP,
        groups._EXPERT_DATA_PARALLEL_GROUP_RANKS,
        groups._ALL_TO_ALL_GROUP,
    ):
        cache.clear()
