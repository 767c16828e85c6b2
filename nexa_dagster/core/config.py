"""Loading of the YAML configuration in ``configs/``: scale presets, model presets, filters, prompts.

The configuration directory defaults to ``<repo>/configs`` and can be moved with ``NEXA_CONFIG_DIR``; the scale
preset defaults to ``tiny`` and is chosen with ``NEXA_SCALE`` so that the same code location runs the demo on a
laptop and the full run on a cluster.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

REPO_ROOT = Path(__file__).resolve().parents[2]


def config_dir() -> Path:
    return Path(os.environ.get("NEXA_CONFIG_DIR", REPO_ROOT / "configs"))


def resolve_path(path: str | os.PathLike[str]) -> Path:
    """Resolve a configured path: absolute paths stay, relative ones are relative to the repo root."""
    p = Path(path)
    return p if p.is_absolute() else REPO_ROOT / p


def load_yaml(relative: str) -> Any:
    path = config_dir() / relative
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"configuration file not found: {path}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"invalid YAML in {path}: {e}") from e


def read_text(relative: str) -> str:
    return (config_dir() / relative).read_text(encoding="utf-8")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TeacherSampling(_Strict):
    max_new_tokens: int = Field(gt=0)
    temperature: float = Field(ge=0)
    top_p: float = Field(gt=0, le=1)
    seed: int = 0


class JudgeSettings(_Strict):
    max_new_tokens: int = Field(gt=0)


class TrainingSettings(_Strict):
    max_steps: int = Field(gt=0)
    micro_batch_size: int = Field(gt=0)
    gradient_accumulation_steps: int = Field(gt=0)
    learning_rate: float = Field(gt=0)
    warmup_steps: int = Field(ge=0)
    weight_decay: float = Field(ge=0)
    grad_clip: float = Field(gt=0)
    log_every: int = Field(gt=0)
    seed: int = 0
    num_procs: int = Field(gt=0)
    optimizer: Literal["adamw", "adam"] = "adamw"
    checkpoint_every: int = Field(default=0, ge=0, description="save resumable engine state every N steps (0: off)")
    stall_timeout_s: float = Field(default=900.0, gt=0, description="fail the run when no step ends in this time")
    progress_every_s: float = Field(default=10.0, gt=0, description="log \"training steps: n/N\" this often")
    activation_checkpointing: bool = False
    compile: bool = Field(default=False, description="torch.compile each decoder layer (GPU presets)")
    attention: Literal["auto", "sdpa", "flex", "causal"] = Field(
        default="auto", description="auto: within-document masks (FlexAttention on GPUs); causal: across documents")
    prefetch: int = Field(default=2, ge=0, description="micro-batches prepared ahead by a background thread")


class EvaluationSettings(_Strict):
    num_heldout_prompts: int = Field(gt=0)
    max_new_tokens: int = Field(gt=0)


class ScalePreset(_Strict):
    """A scale factor in the Nemotron sense: the same recipe at tiny, small or full size."""

    name: str
    max_docs_per_day: int | None = Field(default=None, gt=0)
    max_chars_per_doc: int = Field(gt=0)
    generations_per_prompt: int = Field(gt=0)
    teacher: TeacherSampling
    judge: JudgeSettings
    pack_size: int = Field(gt=8)
    validation_fraction: float = Field(gt=0, lt=1)
    model_preset: str
    deepspeed_config: str
    training: TrainingSettings
    evaluation: EvaluationSettings


def scale_name() -> str:
    return os.environ.get("NEXA_SCALE", "tiny")


@lru_cache(maxsize=8)
def load_scale(name: str | None = None) -> ScalePreset:
    name = name or scale_name()
    return ScalePreset.model_validate(load_yaml(f"scales/{name}.yaml"))


def load_model_preset(name: str) -> dict[str, Any]:
    return dict(load_yaml(f"models/{name}.yaml"))


def load_deepspeed_config(name: str) -> dict[str, Any]:
    path = config_dir() / "deepspeed" / name
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_pipeline_config() -> dict[str, Any]:
    return dict(load_yaml("pipeline.yaml"))
