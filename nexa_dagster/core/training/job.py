"""What a training run needs (``TrainingJob``) and what it reports back (``TrainingResult``), both JSON.

The job is written to a file and handed to the worker process, which may run on this machine, a Slurm node or a
Kubernetes pod; the result is written beside the checkpoint, so the checkpoint explains itself.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nexa_dagster.core.config import TrainingSettings


class TrainingJob(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run_id: str = Field(min_length=1)
    train_path: str
    validation_path: str
    tokenizer_path: str
    model_preset: str
    deepspeed_config: dict[str, Any]
    settings: TrainingSettings
    output_dir: str
    dataset_run_hash: str = ""
    accelerator: Literal["cpu", "cuda"] = "cpu"


class TrainingResult(BaseModel):
    run_id: str
    checkpoint_dir: str
    steps: int
    final_loss: float
    first_loss: float
    validation_loss: float
    tokens_seen: int
    tokens_per_s: float
    wall_s: float
    loss_curve: list[tuple[int, float]]
    parameters_total: int
    parameters_active: int
    world_size: int = 1
