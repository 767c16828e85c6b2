"""The frozen eval set (core/evaluation/eval_set.py): held-out samples that no training split contains, frozen per version."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from nexa_dagster.core.common import storage
from nexa_dagster.core.data.splits import is_held_out
from nexa_dagster.core.evaluation.eval_set import freeze_eval_set, load_eval_set
from nexa_dagster.core.packaging.formats.packed_split import split_lines
from nexa_dagster.core.packaging.sft_dataset import build_sft_dataset


def _samples(start: int, n: int, day: str) -> pd.DataFrame:
    ids = [f"id{i:03d}" for i in range(start, start + n)]
    return pd.DataFrame(
        {
            "sample_id": ids,
            "day": [day] * n,
            "system_prompt": ["Be brief."] * n,
            "prompt": [f"What is {i} + 1?" for i in range(start, start + n)],
            "response": [f"It is {i + 1}." for i in range(start, start + n)],
        }
    )


def _ids(path: str) -> set[str]:
    return {json.loads(line)["sample_id"].split("#")[0] for line in split_lines(path)}


def test_the_eval_set_never_overlaps_a_training_split_and_stays_frozen(
    tiny_tokenizer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    day1 = _samples(0, 40, "2026-11-20")
    fraction = 0.25
    held = {s for s in day1["sample_id"] if is_held_out(s, fraction)}
    assert 0 < len(held) < 40
    dataset, _ = build_sft_dataset(
        day1,
        tiny_tokenizer,
        str(tiny_model_dir),
        str(tmp_path / "sft"),
        128,
        0.2,
        log=lambda m: None,
        eval_fraction=fraction,
    )
    train, validation = _ids(dataset.train_jsonl_path), _ids(dataset.validation_jsonl_path)
    assert train and validation and not (train & validation)
    assert not (held & (train | validation))  # the held-out side enters no split
    assert train | validation | held == set(day1["sample_id"])  # and nothing else is lost
    assert dataset.held_out_samples == len(held) and dataset.num_samples == 40 - len(held)
    # without the eval set's exclusion, the same data trains on held-out samples (the check above can fail)
    plain, _ = build_sft_dataset(
        day1, tiny_tokenizer, str(tiny_model_dir), str(tmp_path / "sft"), 128, 0.2, log=lambda m: None
    )
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
    dataset2, _ = build_sft_dataset(
        both,
        tiny_tokenizer,
        str(tiny_model_dir),
        str(tmp_path / "sft"),
        128,
        0.2,
        log=lambda m: None,
        eval_fraction=fraction,
    )
    assert not (more_held & (_ids(dataset2.train_jsonl_path) | _ids(dataset2.validation_jsonl_path)))


def test_an_edited_or_missing_eval_set_is_refused(tiny_tokenizer, tmp_path: Path) -> None:
    root = str(tmp_path / "eval_sets")
    with pytest.raises(
        FileNotFoundError, match=r"no eval set v1 in .*eval_sets/v1: materialize the eval_set"
    ):
        load_eval_set(root, 1)
    freeze_eval_set(_samples(0, 40, "2026-11-20"), tiny_tokenizer, root, 1, 0.25, 128, log=lambda m: None)
    assert load_eval_set(root, 1)["examples"] > 0
    examples = Path(root) / "v1" / "samples.jsonl"
    examples.write_bytes(examples.read_bytes().replace(b"It is", b"It's"))
    with pytest.raises(ValueError, match=r"samples.jsonl changed since it was frozen"):
        load_eval_set(root, 1)
    with pytest.raises(ValueError, match="none of the 3 samples hashes to the held-out side"):
        freeze_eval_set(
            _samples(0, 3, "d").assign(sample_id=["a", "b", "c"]),
            tiny_tokenizer,
            root,
            7,
            0.01,
            128,
            log=lambda m: None,
        )  # none of a, b, c hashes below 0.01


def test_frozen_corpus_documents_never_train_a_later_bigger_corpus_and_stay_frozen(
    tiny_tokenizer, tmp_path: Path
) -> None:
    """The eval set freezes the corpus documents on the eval side (real bin/idx); a later, bigger corpus (more
    documents, other shards, another order) trains on none of them, on either of pretraining's sides, and the
    frozen version keeps exactly the documents it froze."""
    import numpy as np
    import torch
    from support.corpus_files import random_documents, write_corpus

    from nexa_dagster.core.training.corpus import document_id, load_corpus

    fraction = 0.25
    vocab, eos = len(tiny_tokenizer), tiny_tokenizer.eos_token_id
    first = random_documents(40, vocab, eos, seed=1)
    corpus1 = write_corpus(tmp_path / "corpus1", first)
    root = str(tmp_path / "eval_sets")
    v1 = freeze_eval_set(
        _samples(0, 40, "2026-11-20"),
        tiny_tokenizer,
        root,
        1,
        0.25,
        128,
        log=lambda m: None,
        corpus=(corpus1, "corpus1hash"),
        corpus_fraction=fraction,
    )
    frozen_rows = pd.read_parquet(load_eval_set(root, 1)["corpus_path"])
    frozen = set(frozen_rows["sample_id"])
    expected = {
        document_id(np.asarray(d)) for d in first if is_held_out(document_id(np.asarray(d)), fraction)
    }
    assert frozen == expected and 0 < len(frozen) < 40
    assert v1["corpus"]["documents"] == len(frozen) and v1["corpus"]["run_hash"] == "corpus1hash"
    assert v1["corpus"]["tokens"] == sum(len(ids) - 1 for ids in frozen_rows["input_ids"])
    by_id = {document_id(np.asarray(d)): d for d in first}
    assert all(
        list(ids) == by_id[i]
        for i, ids in zip(frozen_rows["sample_id"], frozen_rows["input_ids"], strict=True)
    )  # the corpus's own token ids

    # a later corpus: every earlier document and 40 new ones, in three shards, reversed
    bigger = first + random_documents(40, vocab, eos, seed=2)
    corpus2 = write_corpus(tmp_path / "corpus2", bigger[::-1], shards=3)
    train, heldout, split = load_corpus(corpus2, 32, 0.15, 0, eval_fraction=fraction)
    stream = train["input_ids"].reshape(-1)[train["attention_mask"].reshape(-1).bool()]
    assert torch.equal(
        stream, torch.from_numpy(np.concatenate(split.train))
    )  # the rows are the training side
    assert not frozen & {document_id(d) for d in split.train}
    assert not frozen & split.heldout_ids  # on neither side: not even pretraining's own validation
    assert (
        split.eval_set_documents >= len(frozen)
        and len(split.train) + len(split.heldout) + split.eval_set_documents == 80
    )
    # without the exclusion the same corpus trains on frozen documents (the checks above can fail)
    _, _, plain = load_corpus(corpus2, 32, 0.15, 0)
    assert frozen & {document_id(d) for d in plain.train}

    # the version stays as frozen when the eval set is materialized again over the bigger corpus
    again = freeze_eval_set(
        _samples(0, 40, "2026-11-20"),
        tiny_tokenizer,
        root,
        1,
        0.25,
        128,
        log=lambda m: None,
        corpus=(corpus2, "corpus2hash"),
        corpus_fraction=fraction,
    )
    assert again["files"] == v1["files"] and again["corpus"]["run_hash"] == "corpus1hash"
    # a version frozen without a corpus has no documents for base models
    plain_v = freeze_eval_set(
        _samples(0, 40, "d"), tiny_tokenizer, str(tmp_path / "plain"), 1, 0.25, 128, log=lambda m: None
    )
    assert plain_v["corpus"] is None and load_eval_set(str(tmp_path / "plain"), 1)["corpus_path"] is None
    # a corpus with no document on the eval side freezes the samples all the same, and no corpus documents
    none_held = freeze_eval_set(
        _samples(0, 40, "d"),
        tiny_tokenizer,
        str(tmp_path / "none"),
        1,
        0.25,
        128,
        log=lambda m: None,
        corpus=(corpus1, "corpus1hash"),
        corpus_fraction=1e-9,
    )
    assert none_held["corpus"] is None and none_held["examples"] == v1["examples"]
