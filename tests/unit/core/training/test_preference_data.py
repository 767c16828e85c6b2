"""The preference input's pure parts: a resumable order of pairs shared out over ranks, TRL's batch layout, and the
reference values file refusing values that belong to other pairs or another dataset."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from nexa_dagster.core.training.data import index_stream
from nexa_dagster.core.training.preference_data import (
    Pairs,
    collate_pairs,
    pair_batches,
    rank_rounds,
    read_reference_logps,
    write_reference_logps,
)


def toy_pairs(n: int) -> Pairs:
    rng = np.random.default_rng(0)
    ids = [rng.integers(6, 100, k) for k in rng.integers(2, 9, 3 * n)]
    return Pairs("toy", [f"p{i}" for i in range(n)], ids[:n], ids[n : 2 * n], ids[2 * n :])


def pair_ids_of(batch: dict[str, torch.Tensor], pairs: Pairs) -> list[int]:
    """Which pairs a batch holds, recovered from its chosen rows."""
    half = batch["input_ids"].shape[0] // 2
    found = []
    for row in batch["input_ids"][:half]:
        found.append(
            next(
                i
                for i in range(len(pairs))
                if torch.equal(row[: pairs.prompt[i].size + pairs.chosen[i].size], _chosen_row(pairs, i))
            )
        )
    return found


def _chosen_row(pairs: Pairs, i: int) -> torch.Tensor:
    return torch.from_numpy(np.concatenate([pairs.prompt[i], pairs.chosen[i]]))


def test_a_resumed_order_continues_exactly_and_ranks_share_each_global_batch() -> None:
    """The order is a pure function of (seed, position): a run resumed at global batch 5 gets batches 5, 6, 7 of an
    uninterrupted run, and the two ranks' micro-batches of a global batch are its two halves."""
    pairs = toy_pairs(7)
    stream = list(itertools.islice(index_stream(7, 3), 32))
    expected = [stream[4 * k : 4 * k + 4] for k in range(8)]  # global batches: 2 ranks x 2 pairs

    def ids(rank: int, start: int, count: int) -> list[list[int]]:
        batches = pair_batches(pairs, 2, 3, rank, 2, pad_id=0, start=start)
        return [pair_ids_of(b, pairs) for b in itertools.islice(batches, count)]

    assert ids(0, 0, 8) == [g[:2] for g in expected] and ids(1, 0, 8) == [g[2:] for g in expected]
    assert ids(0, 5, 3) == [g[:2] for g in expected[5:]] and ids(1, 5, 3) == [g[2:] for g in expected[5:]]
    assert ids(0, 0, 8) != [
        pair_ids_of(b, pairs) for b in itertools.islice(pair_batches(pairs, 2, 4, 0, 2, 0), 8)
    ]


def test_a_batch_is_chosen_rows_then_rejected_rows_right_padded_with_labels_on_completions() -> None:
    pairs = toy_pairs(3)
    batch = collate_pairs(pairs, [2, 0], pad_id=1)
    assert batch["input_ids"].shape[0] == 4
    for row, (i, completion) in enumerate(
        [(2, pairs.chosen[2]), (0, pairs.chosen[0]), (2, pairs.rejected[2]), (0, pairs.rejected[0])]
    ):
        n, p = pairs.prompt[i].size + completion.size, pairs.prompt[i].size
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (batch["input_ids"].shape[1] - n)
        assert batch["input_ids"][row, n:].eq(1).all()
        assert batch["labels"][row, :p].eq(-100).all() and batch["labels"][row, n:].eq(-100).all()
        assert batch["labels"][row, p:n].tolist() == completion.tolist()
        assert batch["completion_tokens"][row] == completion.size
    assert int(batch["real_tokens"]) == int(batch["attention_mask"].sum())


def test_rank_rounds_give_every_rank_as_many_rounds_and_cover_each_item_once() -> None:
    shares = [list(rank_rounds(7, 2, r, 3)) for r in range(3)]
    assert {len(s) for s in shares} == {2}
    assert sorted(i for s in shares for part in s for i in part) == list(range(7))
    assert shares[2][1] == [], "a rank without items left still runs the round"


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
    from nexa_dagster.core.training.job import TrainingJob

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
    assert (job.dpo_beta, job.dpo_loss, job.reference_path) == (0.1, "sigmoid", "")
    with pytest.raises(ValidationError):
        TrainingJob(**fields, init_from="/models/sft", dpo_loss="ipo")
