"""The frozen eval set (core/evaluation/eval_set.py): held-out samples that no training split contains, frozen per version."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from nexa_dagster.core.common import storage
from nexa_dagster.core.data.splits import is_held_out
from nexa_dagster.core.evaluation.eval_set import eval_slices, freeze_eval_set, load_eval_set
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


def _frozen_v1(tiny_tokenizer, root: str, with_corpus: Path | None = None) -> dict:
    return freeze_eval_set(
        _samples(0, 40, "2026-11-20"),
        tiny_tokenizer,
        root,
        1,
        0.25,
        128,
        log=lambda m: None,
        corpus=(str(with_corpus), "corpus1hash") if with_corpus else None,
        corpus_fraction=0.25 if with_corpus else 0.0,
    )


@pytest.mark.parametrize(
    "lost", ["manifest.json", "examples.parquet", "samples.jsonl", "corpus.parquet", "v1/"]
)
def test_a_frozen_version_missing_a_file_is_never_frozen_again(
    tiny_tokenizer, tmp_path: Path, lost: str
) -> None:
    """Once v1 exists (any of its files), materializing it again never rewrites it, even with more data and a file
    gone: the error names the version, the file and what to do; the files that are left stay byte for byte."""
    import shutil

    from support.corpus_files import random_documents, write_corpus

    corpus = write_corpus(tmp_path / "corpus", random_documents(40, len(tiny_tokenizer), 2, seed=1))
    root = str(tmp_path / "eval_sets")
    v1 = _frozen_v1(tiny_tokenizer, root, Path(corpus))
    assert v1["corpus"] is not None  # every file of a version is there to lose
    directory = Path(root) / "v1"
    if lost == "v1/":
        shutil.rmtree(directory)
    else:
        (directory / lost).unlink()
    left = {p.name: p.read_bytes() for p in directory.glob("*")} if directory.exists() else {}
    more = pd.concat([_samples(0, 40, "2026-11-20"), _samples(40, 40, "2026-11-21")], ignore_index=True)
    what = "manifest.json" if lost == "v1/" else lost
    for attempt in (
        lambda: freeze_eval_set(more, tiny_tokenizer, root, 1, 0.25, 128, log=lambda m: None),
        lambda: load_eval_set(root, 1),
    ):
        with pytest.raises(ValueError) as error:
            attempt()
        message = str(error.value)
        assert "eval set v1" in message and what in message and "missing" in message, message
        assert "restore" in message and "eval_set.version" in message, message
        assert "materialize the eval_set" not in message, message
    assert ({p.name: p.read_bytes() for p in directory.glob("*")} if directory.exists() else {}) == left
    # a new version is the way forward, and it is frozen from the data known now
    v2 = freeze_eval_set(more, tiny_tokenizer, root, 2, 0.25, 128, log=lambda m: None)
    assert (
        v2["examples"] > v1["examples"] and load_eval_set(root, 2)["content_sha256"] == v2["content_sha256"]
    )


def test_a_truncated_manifest_is_an_error_naming_it(tiny_tokenizer, tmp_path: Path) -> None:
    root = str(tmp_path / "eval_sets")
    _frozen_v1(tiny_tokenizer, root)
    manifest = Path(root) / "v1" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[: len(manifest.read_bytes()) // 2])
    for attempt in (
        lambda: load_eval_set(root, 1),
        lambda: _frozen_v1(tiny_tokenizer, root),
    ):
        with pytest.raises(
            ValueError, match=rf"eval set v1: its manifest {manifest} is unreadable .*restore"
        ):
            attempt()


def test_an_evaluation_whose_examples_file_was_deleted_says_it_is_missing(
    tiny_tokenizer, tmp_path: Path
) -> None:
    """The evaluation's own message (eval_report), not "none has been frozen ... materialize it first"."""
    import dagster as dg

    from nexa_dagster.assets.evaluation import frozen_eval_set
    from nexa_dagster.resources.storage import StorageResource

    storage = StorageResource(data_root=str(tmp_path / "data"), results_root=str(tmp_path / "results"))
    _frozen_v1(tiny_tokenizer, storage.path("eval_sets"))
    (Path(storage.path("eval_sets")) / "v1" / "examples.parquet").unlink()
    with pytest.raises(dg.Failure) as failure:
        frozen_eval_set(storage, 1, "ckpt-1")
    message = str(failure.value)
    assert f"{storage.path('eval_sets', 'v1', 'examples.parquet')} is missing" in message, message
    assert "Materialize it first" not in message and "has been frozen" not in message, message


def test_the_versions_content_hash_is_the_same_for_the_same_data_only(tiny_tokenizer, tmp_path: Path) -> None:
    """Two reports that say v1 measured the same data exactly when their content hashes agree: the same samples
    frozen in another data root give the same hash, other samples another one."""
    a = _frozen_v1(tiny_tokenizer, str(tmp_path / "a"))
    b = _frozen_v1(tiny_tokenizer, str(tmp_path / "b"))
    assert len(a["content_sha256"]) == 64 and a["content_sha256"] == b["content_sha256"]
    assert load_eval_set(str(tmp_path / "a"), 1)["content_sha256"] == a["content_sha256"]
    other = freeze_eval_set(
        _samples(40, 40, "2026-11-21"), tiny_tokenizer, str(tmp_path / "c"), 1, 0.25, 128, log=lambda m: None
    )
    assert other["content_sha256"] != a["content_sha256"]
    manifest = json.loads((tmp_path / "a" / "v1" / "manifest.json").read_text())
    assert manifest["content_sha256"] == a["content_sha256"]


def test_the_slices_are_each_examples_field_in_the_examples_order(tiny_tokenizer, tmp_path: Path) -> None:
    """The guards' slices (promotion.yaml guards.slice_by): one label per scored example, in examples.parquet's
    order; a field the rows do not carry is an error naming the file, the row and the setting."""
    samples = pd.concat([_samples(0, 40, "2026-11-20"), _samples(40, 40, "2026-11-21")])
    manifest = freeze_eval_set(samples, tiny_tokenizer, str(tmp_path), 1, 0.25, 128, log=lambda m: None)
    days = eval_slices(manifest, "day")
    ids = pd.read_parquet(manifest["path"])["sample_id"].tolist()
    by_id = dict(zip(samples["sample_id"], samples["day"], strict=True))
    assert days == [by_id[i] for i in ids] and set(days) == {"2026-11-20", "2026-11-21"}
    assert eval_slices(manifest, None) is None
    with pytest.raises(ValueError, match=r"samples.jsonl row 1 has no field 'source'.*guards.slice_by"):
        eval_slices(manifest, "source")
