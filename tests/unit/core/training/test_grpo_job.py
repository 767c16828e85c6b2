"""The GRPO job's typed section and the scale preset's rl settings: what is refused before any model is built."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from nexa_dagster.core.common.config import RLSettings, TrainingSettings, load_deepspeed_config
from nexa_dagster.core.training.grpo import check_batch_shape
from nexa_dagster.core.training.job import TrainingJob

SETTINGS = {
    "max_steps": 4,
    "micro_batch_size": 8,
    "gradient_accumulation_steps": 2,
    "learning_rate": 1e-3,
    "warmup_steps": 0,
    "weight_decay": 0.0,
    "grad_clip": 1.0,
    "log_every": 1,
    "num_procs": 1,
}


def job(**fields: Any) -> TrainingJob:
    base: dict[str, Any] = {
        "run_id": "rl",
        "tokenizer_path": "tok",
        "model_preset": "tiny",
        "deepspeed_config": load_deepspeed_config("zero1_cpu.json"),
        "settings": TrainingSettings(**SETTINGS),
        "output_dir": "out",
        "data_kind": "rl_prompts",
        "init_from": "production",
        "objective": {
            "kind": "grpo",
            "prompts_path": "p.jsonl",
            "rewards": [{"name": "exact_answer"}],
            "prompts_per_step": 2,
        },
    }
    return TrainingJob(**{**base, **fields})


def test_a_grpo_job_is_typed_and_its_defaults_are_trls() -> None:
    objective = job().objective
    assert objective.kind == "grpo" and objective.num_generations == 8 and objective.beta == 0.0
    assert (objective.epsilon, objective.temperature, objective.top_p, objective.scale_rewards) == (
        0.2,
        1.0,
        1.0,
        "group",
    )
    with pytest.raises(ValidationError, match="a rl_prompts .GRPO. job needs init_from"):
        job(init_from="")
    with pytest.raises(
        ValidationError, match="data_kind rl_prompts is trained with the grpo objective, not language_model"
    ):
        job(objective={"kind": "language_model"})
    with pytest.raises(ValidationError, match="num_generations"):
        job(objective={"kind": "grpo", "prompts_path": "p", "rewards": [{"name": "x"}], "num_generations": 1})
    with pytest.raises(ValidationError, match="train_path and validation_path are required"):
        job(data_kind="packed_sft", objective=None, init_from="")


def test_the_batch_shape_is_one_group_per_micro_batch_and_b_prompts_per_step() -> None:
    check_batch_shape(job(), job().objective, world_size=1)
    with pytest.raises(ValueError, match=r"micro_batch_size \(4\) must equal num_generations \(8\)"):
        wrong = job(settings=TrainingSettings(**{**SETTINGS, "micro_batch_size": 4}))
        check_batch_shape(wrong, wrong.objective, world_size=1)
    with pytest.raises(
        ValueError, match=r"gradient_accumulation_steps \(2\) x ranks \(2\) must equal prompts_per_step \(2\)"
    ):
        check_batch_shape(job(), job().objective, world_size=2)


def test_the_presets_rl_settings_give_that_shape() -> None:
    training = TrainingSettings(**{**SETTINGS, "num_procs": 2, "learning_rate": 3e-3})
    settings = RLSettings(num_generations=4, prompts_per_step=6, max_steps=7).settings(training)
    assert (settings.micro_batch_size, settings.gradient_accumulation_steps, settings.max_steps) == (4, 3, 7)
    assert settings.learning_rate == pytest.approx(3e-4)
    with pytest.raises(ValueError, match="prompts_per_step 5 is not a multiple of training.num_procs 2"):
        RLSettings(prompts_per_step=5).settings(training)
