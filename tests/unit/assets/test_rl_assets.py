"""The RL stage's Dagster side: one launch-and-record path for every trained checkpoint, the run config a person
changes in the Launchpad (validated as the preset is), and the figures an RL checkpoint's materialization carries."""

from __future__ import annotations

import ast
from pathlib import Path

import dagster as dg
import pytest

from nexa_dagster.assets.rl import RLRunConfig, grpo_figures, reward_spec
from nexa_dagster.core.common.config import RLSettings
from nexa_dagster.core.common.python_source import parse_python
from nexa_dagster.core.training.job import TrainingResult

ASSETS = Path(__file__).resolve().parents[3] / "nexa_dagster" / "assets"


def callers_of(name: str, folder: Path) -> set[str]:
    """The modules of ``folder`` that call ``<anything>.name(...)`` or ``name(...)``."""
    found = set()
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(parse_python(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                if called == name:
                    found.add(path.name)
    return found


def test_every_trained_checkpoint_is_launched_and_recorded_by_one_function() -> None:
    """No stage repeats the launch/record sequence: only checkpoint_launch launches a training and writes its
    record; the four training assets call it."""
    for step in ("run_training", "log_training_run", "write_checkpoint_record", "publish_checkpoint"):
        assert callers_of(step, ASSETS) == {"checkpoint_launch.py"}, step
    assert callers_of("launch_and_record", ASSETS) == {
        "pretraining.py",
        "training.py",
        "preference.py",
        "rl.py",
    }


def test_the_sequence_check_finds_a_second_copy(tmp_path: Path) -> None:
    (tmp_path / "checkpoint_launch.py").write_text("gpu_cluster.run_training(context, job, d)\n")
    (tmp_path / "copy.py").write_text("result, invocation = gpu_cluster.run_training(context, job, d)\n")
    assert callers_of("run_training", tmp_path) == {"checkpoint_launch.py", "copy.py"}


def test_the_run_config_overrides_the_preset_and_refuses_what_the_preset_would() -> None:
    preset = RLSettings()
    settings = RLRunConfig(max_steps=3, rewards=["exact_answer:-1", "reference_f1"]).settings(preset)
    assert settings.max_steps == 3 and settings.num_generations == preset.num_generations
    assert [(r.name, r.weight) for r in settings.rewards] == [("exact_answer", -1.0), ("reference_f1", 1.0)]
    assert RLRunConfig().settings(preset) == preset
    with pytest.raises(dg.Failure, match="rl_checkpoint run config"):
        RLRunConfig(loss_type="ppo").settings(preset)
    with pytest.raises(dg.Failure, match="weight is not a number"):
        reward_spec("exact_answer:lots")


def test_an_rl_checkpoint_carries_its_reward_figures() -> None:
    result = TrainingResult(
        run_id="rl-1",
        checkpoint_dir="/nowhere",
        steps=4,
        first_loss=0.1,
        final_loss=0.05,
        validation_loss=None,
        tokens_seen=100,
        tokens_per_s=10.0,
        wall_s=3.0,
        loss_curve=[(1, 0.1), (4, 0.05)],
        parameters_total=10,
        parameters_active=5,
        data_kind="rl_prompts",
        reward_first=0.1,
        reward_final=0.6,
        reward_curve=[(1, 0.1), (2, 0.3), (4, 0.6)],
        held_out_reward=0.5,
        held_out_rewards=[1.0, 0.0],
        held_out_prompts=2,
        rollout_s=1.5,
        update_s=0.5,
        rollout_tokens=64,
    )
    figures = grpo_figures(result)
    assert figures.record["rl_metrics"] == {
        "reward_first": 0.1,
        "reward_final": 0.6,
        "held_out_reward": 0.5,
        "held_out_prompts": 2.0,
        "rollout_s": 1.5,
        "update_s": 0.5,
        "rollout_tokens": 64.0,
    }
    assert figures.metadata["held_out_reward"] == 0.5 and "reward_curve" in figures.metadata
    assert figures.final_metrics["reward_final"] == 0.6
