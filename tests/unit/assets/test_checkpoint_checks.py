"""The checks of every trained checkpoint (``moe_checkpoint``, ``preference_checkpoint``, ``rl_checkpoint``) on a
real saved model: the session's tiny Mixtral, written by ``save_pretrained`` as the training worker writes a
checkpoint, passes; the same folder with its weights file cut short (a copy or a write that stopped part way) fails
each check, naming the error, instead of erroring the check."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from nexa_dagster.core.common.artifacts import Checkpoint
from nexa_dagster.core.training.job import TrainingResult


def _summary(directory: Path, data_kind: str) -> None:
    """The run's training_summary.json as the worker writes it (a TrainingResult), with every figure the stage's
    check reads measured and finite: what decides is the weights file."""
    result = TrainingResult(
        run_id=directory.name,
        checkpoint_dir=str(directory),
        steps=2,
        first_loss=0.69,
        final_loss=0.6,
        validation_loss=0.65 if data_kind == "preference" else None,
        tokens_seen=100,
        tokens_per_s=10.0,
        wall_s=1.0,
        loss_curve=[(1, 0.69), (2, 0.6)],
        parameters_total=1,
        parameters_active=1,
        data_kind=data_kind,
        reward_accuracy=0.75,
        reward_margin=0.1,
        validation_pairs=4,
        reward_first=0.1,
        reward_final=0.3,
        held_out_reward=0.2,
        held_out_prompts=8,
    )
    (directory / "training_summary.json").write_text(result.model_dump_json())


def _check(stage: str):
    from nexa_dagster.assets.preference import preference_checkpoint_loads_and_was_scored
    from nexa_dagster.assets.rl import rl_checkpoint_loads_and_was_rewarded
    from nexa_dagster.assets.training import checkpoint_loads_with_transformers

    return {
        "sft": checkpoint_loads_with_transformers,
        "preference": preference_checkpoint_loads_and_was_scored,
        "rl": rl_checkpoint_loads_and_was_rewarded,
    }[stage]


@pytest.mark.parametrize(
    ("stage", "data_kind"), [("sft", "packed_sft"), ("preference", "preference"), ("rl", "rl_prompts")]
)
def test_a_checkpoint_with_a_truncated_weights_file_fails_its_check(
    tiny_model_dir: Path, tmp_path: Path, stage: str, data_kind: str
) -> None:
    directory = tmp_path / f"{stage}-1"
    shutil.copytree(tiny_model_dir, directory)
    _summary(directory, data_kind)
    checkpoint = Checkpoint(checkpoint_id=directory.name, path=str(directory), num_steps=2, stage=stage)
    whole = _check(stage)(checkpoint)
    assert whole.passed and whole.metadata["loads"].value is True

    weights = directory / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    cut = _check(stage)(checkpoint)
    assert not cut.passed and cut.metadata["loads"].value is False
    assert f"{directory} does not load with transformers" in (cut.description or "")
