"""The frozen eval set (core/eval_set.py): held-out samples that no training split contains, frozen per version."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from nexa_dagster.core import storage
from nexa_dagster.core.eval_set import freeze_eval_set, is_held_out, load_eval_set
from nexa_dagster.core.sft_dataset import build_sft_dataset


def _samples(start: int, n: int, day: str) -> pd.DataFrame:
    ids = [f"id{i:03d}" for i in range(start, start + n)]
    return pd.DataFrame({"sample_id": ids, "day": [day] * n, "system_prompt": ["Be brief."] * n,
                         "prompt": [f"What is {i} + 1?" for i in range(start, start + n)],
                         "response": [f"It is {i + 1}." for i in range(start, start + n)]})


def _ids(path: str) -> set[str]:
    return {json.loads(line)["sample_id"].split("#")[0] for line in Path(path).read_text().splitlines()}


def test_the_eval_set_never_overlaps_a_training_split_and_stays_frozen(tiny_tokenizer, tiny_model_dir: Path,
                                                                       tmp_path: Path) -> None:
    day1 = _samples(0, 40, "2026-11-20")
    fraction = 0.25
    held = {s for s in day1["sample_id"] if is_held_out(s, fraction)}
    assert 0 < len(held) < 40
    dataset, _ = build_sft_dataset(day1, tiny_tokenizer, str(tiny_model_dir), str(tmp_path / "sft"), 128, 0.2,
                                   log=lambda m: None, eval_fraction=fraction)
    train, validation = _ids(dataset.train_jsonl_path), _ids(dataset.validation_jsonl_path)
    assert train and validation and not (train & validation)
    assert not (held & (train | validation))  # the held-out side enters no split
    assert train | validation | held == set(day1["sample_id"])  # and nothing else is lost
    assert dataset.held_out_samples == len(held) and dataset.num_samples == 40 - len(held)
    # without the eval set's exclusion, the same data trains on held-out samples (the check above can fail)
    plain, _ = build_sft_dataset(day1, tiny_tokenizer, str(tiny_model_dir), str(tmp_path / "sft"), 128, 0.2,
                                 log=lambda m: None)
    assert held & (_ids(plain.train_jsonl_path) | _ids(plain.validation_jsonl_path))

    root = str(tmp_path / "eval_sets")
    v1 = freeze_eval_set(day1, tiny_tokenizer, root, 1, fraction, 128, log=lambda m: None)
    assert _ids(v1_samples := storage.join(root, "v1", "samples.jsonl")) == held
    frozen = Path(v1_samples).read_bytes()
    # a later day adds held-out samples: version 1 stays as it was, version 2 takes them in
    both = pd.concat([day1, _samples(40, 40, "2026-11-21")], ignore_index=True)
    again = freeze_eval_set(both, tiny_tokenizer, root, 1, fraction, 128, log=lambda m: None)
    assert again["files"] == v1["files"] and Path(v1_samples).read_bytes() == frozen
    v2 = freeze_eval_set(both, tiny_tokenizer, root, 2, fraction, 128, log=lambda m: None)
    more_held = {s for s in both["sample_id"] if is_held_out(s, fraction)}
    assert _ids(storage.join(root, "v2", "samples.jsonl")) == more_held and v2["examples"] > v1["examples"]
    assert v2["days"] == ["2026-11-20", "2026-11-21"]
    # and training on both days still never sees any of them
    dataset2, _ = build_sft_dataset(both, tiny_tokenizer, str(tiny_model_dir), str(tmp_path / "sft"), 128, 0.2,
                                    log=lambda m: None, eval_fraction=fraction)
    assert not (more_held & (_ids(dataset2.train_jsonl_path) | _ids(dataset2.validation_jsonl_path)))


def test_an_edited_or_missing_eval_set_is_refused(tiny_tokenizer, tmp_path: Path) -> None:
    root = str(tmp_path / "eval_sets")
    with pytest.raises(FileNotFoundError, match=r"no eval set v1 in .*eval_sets/v1: materialize the eval_set"):
        load_eval_set(root, 1)
    freeze_eval_set(_samples(0, 40, "2026-11-20"), tiny_tokenizer, root, 1, 0.25, 128, log=lambda m: None)
    assert load_eval_set(root, 1)["examples"] > 0
    examples = Path(root) / "v1" / "samples.jsonl"
    examples.write_bytes(examples.read_bytes().replace(b"It is", b"It's"))
    with pytest.raises(ValueError, match=r"samples.jsonl changed since it was frozen"):
        load_eval_set(root, 1)
    with pytest.raises(ValueError, match="none of the 3 samples hashes to the held-out side"):
        freeze_eval_set(_samples(0, 3, "d").assign(sample_id=["a", "b", "c"]), tiny_tokenizer, root, 7, 0.01, 128,
                        log=lambda m: None)  # none of a, b, c hashes below 0.01
