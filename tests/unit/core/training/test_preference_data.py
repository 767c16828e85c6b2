"""The preference input's pure parts: pairs packed into fixed-shape micro-batches in a resumable order shared out
over ranks, SFT's document layout, a job's typed DPO section, and the reference values file refusing values that
belong to other pairs or another dataset."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from nexa_dagster.core.training.data import index_stream
from nexa_dagster.core.training.preference_data import (
    PairLayout,
    Pairs,
    collate_packed,
    pack_pairs,
    pair_batches,
    pair_layout,
    read_reference_logps,
    scoring_batches,
    write_reference_logps,
)


def toy_pairs(n: int, longest: int = 9) -> Pairs:
    rng = np.random.default_rng(0)
    ids = [rng.integers(6, 100, k) for k in rng.integers(2, longest, 3 * n)]
    return Pairs("toy", [f"p{i}" for i in range(n)], ids[:n], ids[n : 2 * n], ids[2 * n :])


def pairs_of(batch: dict[str, torch.Tensor]) -> list[int]:
    return batch["pair_index"].tolist()


def test_a_resumed_order_continues_exactly_and_ranks_take_turns_at_the_packed_micro_batches() -> None:
    """The packed stream is a pure function of (seed, position): a run resumed at global micro-batch 5 gets what an
    uninterrupted one gets from there, rank r takes every other micro-batch of one stream, and the packer's lookahead
    only reorders the seeded order locally: an epoch trains every pair, none twice."""
    pairs = toy_pairs(40)
    layout = PairLayout(rows=4, length=24)
    stream = [pairs_of(b) for b in itertools.islice(pair_batches(pairs, layout, 3, 0, 1, pad_id=0), 40)]

    def ids(rank: int, start: int, count: int) -> list[list[int]]:
        batches = pair_batches(pairs, layout, 3, rank, 2, pad_id=0, start=start)
        return [pairs_of(b) for b in itertools.islice(batches, count)]

    assert ids(0, 0, 8) == stream[0:16:2] and ids(1, 0, 8) == stream[1:16:2]
    assert ids(0, 5, 3) == stream[10:16:2] and ids(1, 5, 3) == stream[11:17:2]
    flat = [i for batch in stream for i in batch]
    window = 2 * layout.rows  # the packer's lookahead, in pairs
    assert len(set(flat[: 40 - window])) == 40 - window, "within an epoch no pair comes twice"
    assert set(flat[: 40 + window]) == set(range(40)), "every pair of an epoch is trained on within it"
    order, taken = list(itertools.islice(index_stream(40, 3), len(flat) + window)), 0
    for batch in stream:  # each micro-batch comes from the next stretch of the seeded order
        assert set(batch) <= set(order[: taken + window + len(batch)])
        taken += len(batch)
    assert max(len(b) for b in stream) > layout.rows // 2, (
        "short pairs share rows: more pairs than half the rows"
    )
    assert stream != [pairs_of(b) for b in itertools.islice(pair_batches(pairs, layout, 4, 0, 1, 0), 40)]


def test_a_packed_batch_lays_each_document_out_like_sft_with_labels_on_its_completion() -> None:
    pairs = toy_pairs(6)
    layout = PairLayout(rows=3, length=30)
    rows = next(pack_pairs(pairs, [4, 1, 5, 0, 2, 3], layout))
    batch = collate_packed(pairs, rows, layout, pad_id=1)
    assert batch["input_ids"].shape == (3, 30)
    n = batch["pair_index"].shape[0]
    assert sorted(batch["pair_index"].tolist()) == sorted({i for row in rows for i, _ in row})
    for j, i in enumerate(batch["pair_index"].tolist()):
        for slot, completion in ((j, pairs.chosen[i]), (n + j, pairs.rejected[i])):
            where = batch["segments"] == slot
            assert int(where.any(1).sum()) == 1, "a document lies in one row"
            document = np.concatenate([pairs.prompt[i], completion])
            assert batch["input_ids"][where].tolist() == document.tolist()
            assert batch["position_ids"][where].tolist() == list(range(document.size))
            assert batch["labels"][where].tolist() == [-100] * pairs.prompt[i].size + completion.tolist()
            assert batch["attention_mask"][where].eq(1).all()
        assert batch["completion_tokens"][j] == pairs.chosen[i].size
        assert batch["completion_tokens"][n + j] == pairs.rejected[i].size
    padding = batch["segments"] == 2 * n
    assert batch["attention_mask"][padding].eq(0).all() and batch["labels"][padding].eq(-100).all()
    assert batch["input_ids"][padding].eq(1).all()
    assert int(batch["real_tokens"]) == int(batch["attention_mask"].sum()) and int(batch["pairs"]) == n


def test_scoring_batches_give_every_rank_as_many_batches_and_each_pair_once() -> None:
    pairs = toy_pairs(30)
    layout = PairLayout(rows=2, length=20)
    shares = [list(scoring_batches(pairs, layout, 0, r, 3)) for r in range(3)]
    assert len({len(s) for s in shares}) == 1
    scored = [i for s in shares for batch, mine in s if mine for i in pairs_of(batch)]
    assert sorted(scored) == list(range(30))
    assert not shares[2][-1][1] or len(list(pack_pairs(pairs, range(30), layout))) % 3 == 0


def test_the_layout_fits_the_longest_pair_and_refuses_a_pack_length_too_short() -> None:
    pairs = toy_pairs(10, longest=40)
    longest = max(pairs.prompt[i].size + max(pairs.chosen[i].size, pairs.rejected[i].size) for i in range(10))
    layout = pair_layout([pairs], 4)
    assert layout.rows == 8 and layout.length % 64 == 0 and layout.length - 64 < longest <= layout.length
    assert pair_layout([pairs], 4, pack_length=longest).length == longest
    with pytest.raises(
        ValueError, match=r"pack_length 10 is shorter than the \d+ tokens .* in toy \(pair_id"
    ):
        pair_layout([pairs], 4, pack_length=10)


def test_the_reference_file_is_refused_for_other_pairs_or_another_dataset(tmp_path: Path) -> None:
    path = str(tmp_path / "ref_logps-sha256-ab.parquet")
    assert read_reference_logps(path, "sha256:ab", "run1", ["a"]) is None  # nothing yet: compute
    write_reference_logps(path, "sha256:ab", "/models/sft", "run1", ["a", "b"], [-1.0, -2.0], [-3.0, -4.0])
    assert read_reference_logps(path, "sha256:ab", "run1", ["b", "a"]) == {
        "a": (-1.0, -3.0),
        "b": (-2.0, -4.0),
    }
    with pytest.raises(ValueError, match=r"ref_logps-sha256-ab.parquet lack 1 of the 3 pairs, e.g. \['c'\]"):
        read_reference_logps(path, "sha256:ab", "run1", ["a", "b", "c"])
    with pytest.raises(ValueError, match="belong to dataset 'run1', not to 'run2'"):
        read_reference_logps(path, "sha256:ab", "run2", ["a"])
    with pytest.raises(ValueError, match="computed with checkpoint 'sha256:ab' .*/models/sft.*sha256:cd"):
        read_reference_logps(path, "sha256:cd", "run1", ["a"])
    (tmp_path / "ref_logps-sha256-ab.json").unlink()  # a writer killed before its sidecar: computed again
    assert read_reference_logps(path, "sha256:ab", "run1", ["a"]) is None


def test_a_preference_job_needs_the_checkpoint_it_starts_from() -> None:
    """DPO starts from an SFT checkpoint, which is also its default reference: a job without one is refused."""
    from pydantic import ValidationError

    from nexa_dagster.core.common.config import TrainingSettings
    from nexa_dagster.core.training.job import DPOObjective, LanguageModelObjective, TrainingJob

    fields = {
        "run_id": "dpo",
        "train_path": "t",
        "validation_path": "v",
        "tokenizer_path": "tok",
        "model_preset": "tiny",
        "deepspeed_config": {},
        "settings": TrainingSettings(
            max_steps=1,
            micro_batch_size=1,
            gradient_accumulation_steps=1,
            learning_rate=1e-3,
            warmup_steps=0,
            weight_decay=0.0,
            grad_clip=1.0,
            log_every=1,
            num_procs=1,
        ),
        "output_dir": "out",
        "data_kind": "preference",
    }
    with pytest.raises(ValidationError, match="a preference .DPO. job needs init_from"):
        TrainingJob(**fields)
    job = TrainingJob(**fields, init_from="/models/sft")
    assert job.objective == DPOObjective()  # the data kind's objective, with DPO's defaults
    assert (job.objective.beta, job.objective.loss, job.objective.reference_path) == (0.1, "sigmoid", "")
    with pytest.raises(ValidationError):
        TrainingJob(**fields, init_from="/models/sft", objective={"kind": "dpo", "loss": "ipo"})
    with pytest.raises(ValidationError, match="data_kind preference is trained with the dpo objective"):
        TrainingJob(**fields, init_from="/models/sft", objective={"kind": "language_model"})
    sft = TrainingJob(**{**fields, "data_kind": "packed_sft"})
    assert sft.objective == LanguageModelObjective()
    with pytest.raises(
        ValidationError, match="data_kind packed_sft is trained with the language_model objective"
    ):
        TrainingJob(**{**fields, "data_kind": "packed_sft"}, objective={"kind": "dpo"})
