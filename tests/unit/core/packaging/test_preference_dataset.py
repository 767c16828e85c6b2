"""The preference dataset: tokenized exactly as TRL's DPOTrainer tokenizes the same pairs, built incrementally (a
new day tokenizes only itself, an old day's shards are reused byte for byte), and bad pairs refused with the file
and line."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
from support.preference_pairs import judged_pairs

from nexa_dagster.core.data.splits import is_held_out
from nexa_dagster.core.packaging.formats.packed_split import split_files
from nexa_dagster.core.packaging.preference_dataset import (
    PreferenceDataError,
    build_preference_dataset,
    pairs_to_jsonl,
)
from nexa_dagster.core.packaging.sft_dataset import DayInput

EVAL_FRACTION = 0.2


def pairs_frame(day: str, n: int, start: int = 0) -> pd.DataFrame:
    """``n`` pairs of ``day`` whose prompts are all on the training side of the eval split."""
    return judged_pairs(day, n, EVAL_FRACTION, start)


def day_input(frame: pd.DataFrame, root: Path) -> DayInput:
    return DayInput((str(frame["day"].iloc[0]),), pairs_to_jsonl(frame, str(root)), len(frame))


def rows_of(manifest: str) -> list[dict]:
    return [r for shard in split_files(manifest) for r in pq.read_table(shard).to_pylist()]


def test_a_shard_loads_in_trls_dpo_trainer_as_it_is_and_gives_the_stored_ids(
    tiny_model_dir: Path, tiny_tokenizer, tmp_path: Path
) -> None:
    """The packed shards handed to TRL's DPOTrainer as they are: TRL tokenizes their conversational columns to exactly
    the prompt/chosen/rejected ids we stored (which our trainer reads)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    root = tmp_path / "preference"
    snapshot = build_preference_dataset(
        [day_input(pairs_frame("2026-01-01", 8), root)], tiny_tokenizer, "tok", str(root), 0.25, EVAL_FRACTION
    )
    shards = split_files(snapshot.train_path)
    ours = rows_of(snapshot.train_path)
    trainer = DPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        args=DPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to="none"),
        train_dataset=Dataset.from_parquet(shards),
        processing_class=tiny_tokenizer,
    )
    theirs = list(trainer.train_dataset)
    assert len(theirs) == len(ours) > 0
    for a, b in zip(ours, theirs, strict=True):
        assert a["prompt_input_ids"] == b["prompt_ids"]
        assert a["chosen_input_ids"] == b["chosen_ids"]
        assert a["rejected_input_ids"] == b["rejected_ids"]
    answer = tiny_tokenizer.decode(ours[0]["chosen_input_ids"])
    assert (
        ours[0]["chosen"][0]["content"] in answer and "Question" not in answer
    )  # the answer alone is learned


def test_a_new_day_tokenizes_only_itself(tiny_tokenizer, tmp_path: Path) -> None:
    day1, day2 = pairs_frame("2026-01-01", 12), pairs_frame("2026-01-02", 12, start=100)
    root, logs = tmp_path / "preference", []
    first = build_preference_dataset(
        [day_input(day1, root)], tiny_tokenizer, "tok", str(root), 0.25, EVAL_FRACTION, log=logs.append
    )
    store = root / "store"
    day1_shards = {p.name: p.read_bytes() for p in store.iterdir()}
    second = build_preference_dataset(
        [day_input(day1, root), day_input(day2, root)],
        tiny_tokenizer,
        "tok",
        str(root),
        0.25,
        EVAL_FRACTION,
        log=logs.append,
    )
    assert first.shards_reused == 0 and second.shards_reused == 1
    assert {p.name: p.read_bytes() for p in store.iterdir() if p.name in day1_shards} == day1_shards
    assert sum(first.pairs.values()) == 12 and sum(second.pairs.values()) == 24
    assert first.run_hash != second.run_hash
    train = rows_of(second.train_path)
    validation = rows_of(second.validation_path)
    assert len(train) + len(validation) == 24
    assert not {r["pair_id"] for r in train} & {r["pair_id"] for r in validation}
    assert [r["day"] for r in train] == sorted(r["day"] for r in train)  # day order
    # a pair stays on its side when later days arrive
    first_sides = {r["pair_id"] for r in rows_of(first.validation_path)}
    assert first_sides <= {r["pair_id"] for r in validation}
    again = build_preference_dataset(
        [day_input(day1, root), day_input(day2, root)], tiny_tokenizer, "tok", str(root), 0.25, EVAL_FRACTION
    )
    assert again.run_hash == second.run_hash and again.shards_reused == 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.update(chosen=[{"role": "assistant", "content": "  "}]), "the chosen answer is empty"),
        (lambda r: r.update(rejected=r["chosen"]), "chosen and rejected are the same answer"),
        (lambda r: r.update(sample_id=HELD_OUT), "held-out side"),
    ],
)
def test_bad_pairs_are_refused_naming_file_and_line(
    tiny_tokenizer, tmp_path: Path, change, message: str
) -> None:
    frame = pairs_frame("2026-01-01", 5)
    records = frame.to_dict("records")
    change(records[3])
    root = tmp_path / "preference"
    path = root / "bad.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in sorted(records, key=lambda r: r["pair_id"])))
    line = 1 + sorted(r["pair_id"] for r in records).index(records[3]["pair_id"])
    with pytest.raises(PreferenceDataError, match=f"bad.jsonl:{line}: .*{message}"):
        build_preference_dataset(
            [DayInput(("2026-01-01",), str(path), 5)], tiny_tokenizer, "tok", str(root), 0.25, EVAL_FRACTION
        )
    assert not list((root / "store").glob("*.parquet"))  # nothing half-written


HELD_OUT = next(f"held-{i}" for i in range(1000) if is_held_out(f"held-{i}", EVAL_FRACTION))


def test_a_pair_on_two_days_is_kept_once_from_the_earlier_day_and_training_reads_the_snapshot(
    tiny_tokenizer, tmp_path: Path
) -> None:
    """Three of day 1's pairs land on day 2 too (a document on both days, answered by the same model: the same
    pair_id); the later day's copy is changed (its day) so it can be told apart. The snapshot holds each pair once,
    from day 1; the training's reader (``load_pairs``, which refuses a repeated pair_id) reads both splits; a
    rebuild gives the same snapshot, reusing the derived shard."""
    from nexa_dagster.core.training.preference_data import load_pairs

    day1 = pairs_frame("2026-01-01", 12)
    day2 = pd.concat(
        [pairs_frame("2026-01-02", 12, start=100), day1.iloc[[2, 5, 7]].assign(day="2026-01-02")]
    )
    root, logs = tmp_path / "preference", []
    days = [day_input(day1, root), day_input(day2.reset_index(drop=True), root)]
    snapshot = build_preference_dataset(
        days, tiny_tokenizer, "tok", str(root), 0.25, EVAL_FRACTION, log=logs.append
    )
    rows = rows_of(snapshot.train_path) + rows_of(snapshot.validation_path)
    assert (
        len(rows) == 24 and sum(snapshot.pairs.values()) == 24 and snapshot.cross_day_duplicates_dropped == 3
    )
    assert len({r["pair_id"] for r in rows}) == 24
    repeated = set(day1["pair_id"].iloc[[2, 5, 7]])
    assert {r["day"] for r in rows if r["pair_id"] in repeated} == {"2026-01-01"}
    assert sum(int(line.split(" pair(s) of ")[0]) for line in logs if "kept from there" in line) == 3
    for manifest in (snapshot.train_path, snapshot.validation_path):
        load_pairs(manifest, tiny_tokenizer, max_length=4096)
    again = build_preference_dataset(days, tiny_tokenizer, "tok", str(root), 0.25, EVAL_FRACTION)
    assert again.run_hash == snapshot.run_hash and again.shards_reused == 2


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ("vocab", r"pair [0-9a-f]+: (prompt|chosen|rejected) has token id \d+ outside the model's \d+ ids"),
        (
            "length",
            r"pair [0-9a-f]+: prompt and completion are \d+ tokens, more than the model's \d+ positions",
        ),
    ],
)
def test_pairs_the_model_cannot_take_are_refused_at_packaging_naming_the_pair(
    tiny_tokenizer, tmp_path: Path, limits: str, message: str
) -> None:
    """A token id at or above the model's vocabulary (a model with fewer ids than the tokenizer), and a pair longer
    than the model's positions: refused while packaging, naming the file, line and pair, before anything is written;
    within the limits the same day packs."""
    from nexa_dagster.core.packaging.preference_dataset import ModelLimits

    frame = pairs_frame("2026-01-01", 5)
    root = tmp_path / "preference"
    fits = ModelLimits(len(tiny_tokenizer), 4096)
    bad = ModelLimits(8, 4096) if limits == "vocab" else ModelLimits(len(tiny_tokenizer), 20)
    with pytest.raises(PreferenceDataError, match=r"\.jsonl:1: " + message):
        build_preference_dataset(
            [day_input(frame, root)], tiny_tokenizer, "tok", str(root), 0.25, EVAL_FRACTION, limits=bad
        )
    assert not list((root / "store").glob("*.parquet"))  # nothing written
    snapshot = build_preference_dataset(
        [day_input(frame, root)], tiny_tokenizer, "tok", str(root), 0.25, EVAL_FRACTION, limits=fits
    )
    assert sum(snapshot.pairs.values()) == 5
    with pytest.raises(PreferenceDataError, match=message):  # a reused day's shards are checked too
        build_preference_dataset(
            [day_input(frame, root)], tiny_tokenizer, "tok", str(root), 0.25, EVAL_FRACTION, limits=bad
        )


def test_old_snapshots_and_the_day_files_only_they_list_are_removed_as_sft_dataset_does(
    tiny_tokenizer, tmp_path: Path
) -> None:
    """keep_snapshots 1 over three nights whose days are replaced (a day repacked after a fix gives a new day file):
    the newest snapshot and every store file it lists stay (its training reads them), the older snapshots and the
    files only they listed go; keep_snapshots 0 removes nothing."""
    root, quiet = tmp_path / "preference", (lambda message: None)
    store = root / "store"
    nights = [[pairs_frame("2026-01-01", 8, start=100 * k)] for k in range(3)]
    snapshots = []
    for k, frames in enumerate(nights):
        days = [day_input(f, root) for f in frames]
        snapshots.append(
            build_preference_dataset(
                days,
                tiny_tokenizer,
                "tok",
                str(root),
                0.25,
                EVAL_FRACTION,
                log=quiet,
                keep_snapshots=0 if k < 2 else 1,
            )
        )
        if k < 2:
            assert len(list(root.glob("*/snapshot.json"))) == k + 1, "keep_snapshots 0: nothing removed"
    assert len(list(root.glob("*/snapshot.json"))) == 1, "keep_snapshots 1: the newest snapshot only"
    newest = snapshots[-1]
    listed = {
        Path(p).name
        for manifest in (newest.train_path, newest.validation_path)
        for p in split_files(manifest)
    }
    assert {p.name for p in store.glob("*.parquet")} == listed
    assert len(rows_of(newest.train_path)) + len(rows_of(newest.validation_path)) == 8  # still readable
