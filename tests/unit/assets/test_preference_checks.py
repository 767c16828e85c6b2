"""The preference stage's asset checks, each on good input and on the input it exists to catch: a day's pairs, a
snapshot re-read from storage, a trained checkpoint and its held-out rewards."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest
from support.preference_pairs import judged_pairs

from nexa_dagster.core.data.splits import is_held_out
from nexa_dagster.core.distill.pairs import pair_problems
from nexa_dagster.core.packaging.preference_dataset import (
    build_preference_dataset,
    pairs_to_jsonl,
    snapshot_problems,
)
from nexa_dagster.core.packaging.sft_dataset import DayInput

EVAL_FRACTION = 0.2


def day_pairs(n: int) -> pd.DataFrame:
    return judged_pairs("2026-01-01", n, EVAL_FRACTION)


HELD_OUT = next(f"h{i}" for i in range(1000) if is_held_out(f"h{i}", EVAL_FRACTION))


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (
            lambda f: f.assign(pair_id=f["pair_id"].where(f.index != 3, f.loc[2, "pair_id"])),
            "pair_id repeated",
        ),
        (lambda f: f.assign(score_gap=f["score_gap"].where(f.index != 1, 0.2)), "score gap 0.2"),
        (
            lambda f: f.assign(chosen_score=f["chosen_score"].where(f.index != 1, 9.5)),
            "score gap 6.0 .chosen 9.5",
        ),
        (lambda f: f.assign(rejected=f["rejected"].where(f.index != 4, f["chosen"])), "same text"),
        (lambda f: f.assign(sample_id=f["sample_id"].where(f.index != 0, HELD_OUT)), "held-out side"),
    ],
)
def test_the_pairs_check_passes_a_good_day_and_names_each_kind_of_bad_pair(tamper, message: str) -> None:
    good = day_pairs(6)
    assert pair_problems(good, min_score_gap=1.0, eval_fraction=EVAL_FRACTION) == []
    problems = pair_problems(tamper(good.copy()), min_score_gap=1.0, eval_fraction=EVAL_FRACTION)
    assert any(re.search(message, p) for p in problems), problems


def test_the_snapshot_check_passes_a_built_snapshot_and_catches_a_repeated_or_missing_pair(
    tiny_tokenizer, tmp_path: Path
) -> None:
    root = tmp_path / "preference"
    frame = day_pairs(12)
    snapshot = build_preference_dataset(
        [DayInput(("2026-01-01",), pairs_to_jsonl(frame, str(root)), 12)],
        tiny_tokenizer,
        "tok",
        str(root),
        0.25,
        EVAL_FRACTION,
    )
    assert snapshot_problems(snapshot.train_path, snapshot.validation_path, snapshot.pairs) == []
    assert snapshot_problems(
        snapshot.train_path, snapshot.validation_path, {**snapshot.pairs, "train": 99}
    ) == [f"train: {snapshot.pairs['train']} pairs, the snapshot records 99"]
    # an artifact whose validation path names the training split (a wrong path): every pair is in both
    n = snapshot.pairs["train"]
    problems = snapshot_problems(snapshot.train_path, snapshot.train_path, {"train": n, "validation": n})
    assert len(problems) == n and all(
        re.fullmatch(r"validation: pair \w+ is also in train", p) for p in problems
    )


def test_the_splits_check_fails_a_stored_snapshot_whose_shard_is_gone(tiny_tokenizer, tmp_path: Path) -> None:
    """The check as preference_dataset's materialization meets it, on a snapshot build_preference_dataset stored:
    it passes, then fails naming the split once a shard file the snapshot lists is gone from the store (a cleanup
    or a copy that left it out), where the DPO run would fail to read it."""
    from nexa_dagster.assets.preference import preference_splits_are_well_formed
    from nexa_dagster.core.common.artifacts import PreferenceDataset
    from nexa_dagster.core.packaging.formats.packed_split import split_files

    root = tmp_path / "preference"
    frame = day_pairs(12)
    snapshot = build_preference_dataset(
        [DayInput(("2026-01-01",), pairs_to_jsonl(frame, str(root)), 12)],
        tiny_tokenizer,
        "tok",
        str(root),
        0.25,
        EVAL_FRACTION,
    )
    dataset = PreferenceDataset(
        run_hash=snapshot.run_hash,
        root=snapshot.root,
        train_path=snapshot.train_path,
        validation_path=snapshot.validation_path,
        train_pairs=snapshot.pairs["train"],
        validation_pairs=snapshot.pairs["validation"],
        days=["2026-01-01"],
        tokenizer_path="tok",
    )
    assert preference_splits_are_well_formed(dataset).passed
    Path(split_files(snapshot.train_path)[0]).unlink()
    result = preference_splits_are_well_formed(dataset)
    [problem] = result.metadata["problems"].value
    assert not result.passed and problem.startswith(f"train ({snapshot.train_path}) cannot be read")


@pytest.mark.parametrize(("accuracy", "passed"), [(0.75, True), (math.nan, False), (None, False)])
def test_the_checkpoint_check_needs_a_loadable_model_and_measured_held_out_rewards(
    tiny_model_dir: Path, tmp_path: Path, accuracy: float | None, passed: bool
) -> None:
    from nexa_dagster.assets.preference import preference_checkpoint_loads_and_was_scored
    from nexa_dagster.core.common.artifacts import Checkpoint

    directory = tmp_path / "pref-1"
    shutil.copytree(tiny_model_dir, directory)
    summary = {
        "run_id": "pref-1",
        "checkpoint_dir": str(directory),
        "steps": 2,
        "first_loss": 0.69,
        "final_loss": 0.6,
        "validation_loss": 0.65,
        "tokens_seen": 100,
        "tokens_per_s": 10.0,
        "wall_s": 1.0,
        "loss_curve": [[1, 0.69], [2, 0.6]],
        "parameters_total": 1,
        "parameters_active": 1,
        "data_kind": "preference",
        "reward_accuracy": accuracy,
        "reward_margin": 0.1,
        "validation_pairs": 4,
    }
    (directory / "training_summary.json").write_text(json.dumps(summary))
    checkpoint = Checkpoint(checkpoint_id="pref-1", path=str(directory), num_steps=2, stage="preference")
    result = preference_checkpoint_loads_and_was_scored(checkpoint)
    assert result.passed is passed
    assert result.metadata["logits_finite"].value is True


def test_the_run_config_overrides_the_presets_dpo_settings_and_refuses_an_unknown_loss() -> None:
    """What a person sets in the Launchpad for one DPO training replaces the preset's value; unset, the preset holds;
    a loss DPO does not have fails before anything launches, naming the field."""
    import dagster as dg

    from nexa_dagster.assets.preference import PreferenceRunConfig
    from nexa_dagster.core.common.config import PreferenceSettings

    preset = PreferenceSettings(beta=0.1, loss="sigmoid", max_steps=24)
    assert PreferenceRunConfig().settings(preset) == preset
    changed = PreferenceRunConfig(max_steps=5, beta=0.3, loss="sigmoid_norm").settings(preset)
    assert (changed.max_steps, changed.beta, changed.loss, changed.learning_rate) == (
        5,
        0.3,
        "sigmoid_norm",
        None,
    )
    with pytest.raises(dg.Failure, match="(?s)preference_checkpoint run config: .*loss.*sigmoid_norm"):
        PreferenceRunConfig(loss="ipo").settings(preset)
