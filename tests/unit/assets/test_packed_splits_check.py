"""``packed_splits_are_well_formed`` (``sft_dataset``'s check) on a snapshot the packaging really stored: the core
``build_sft_dataset_from_days`` (what the asset calls) packs the small landing days with the shipped SFT blend (the
judged samples, the teacher template around each landed document, and the ``checkable_tasks`` source built by
``build_tasks`` from the same documents) at the tiny preset's pack size. The check passes that snapshot, then fails,
naming the split and the shard, once a shard file is gone from the store (a cleanup that kept the manifest) or cut
short (a copy that stopped part way): what training would fail to read. It used to error the check instead."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
from support.landing_documents import landing_documents, landing_tasks
from support.packaging_inputs import quiet, teacher_rows

from nexa_dagster.assets.packaging import packed_splits_are_well_formed
from nexa_dagster.core.common.artifacts import SFTDataset
from nexa_dagster.core.packaging.blend import DataBlend
from nexa_dagster.core.packaging.formats.packed_split import split_files
from nexa_dagster.core.packaging.sft_dataset import build_sft_dataset_from_days, day_inputs_from_frame
from nexa_dagster.core.rl.tasks import write_task_rows
from nexa_dagster.resources.scale import ScaleResource


def _packed_snapshot(root: Path, tokenizer) -> SFTDataset:  # noqa: ANN001 (a transformers tokenizer)
    """The SFT snapshot of the landing days, several shards a split (rows_per_shard 10), as sft_dataset packs it."""
    docs = landing_documents()
    samples = pd.concat(
        teacher_rows(
            [(d["doc_id"], k) for k, d in enumerate(docs) if d["day"] == day], day, lambda k: docs[k]["text"]
        )
        for day in sorted({d["day"] for d in docs})
    )
    _, tasks_path, _ = write_task_rows(landing_tasks(), str(root / "rl" / "tasks"))
    scale = ScaleResource(name="tiny").load()
    dataset, _ = build_sft_dataset_from_days(
        day_inputs_from_frame(samples, str(root / "sft")),
        tokenizer,
        "tiny-teacher",
        str(root / "sft"),
        scale.pack_size,
        scale.validation_fraction,
        log=quiet,
        blend=DataBlend.load("blends/sft.yaml"),
        rows_per_shard=10,
        assets={"checkable_tasks": [tasks_path]},
    )
    return dataset


def _remove(shard: Path) -> None:
    shard.unlink()


def _cut_short(shard: Path) -> None:
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(
    ("damage", "error"), [(_remove, "FileNotFoundError: .* is missing"), (_cut_short, "ValueError: .* bytes")]
)
def test_a_stored_snapshot_passes_and_fails_once_a_shard_is_damaged(
    tmp_path: Path, tiny_tokenizer, damage: Callable[[Path], None], error: str
) -> None:
    dataset = _packed_snapshot(tmp_path, tiny_tokenizer)
    shards = split_files(dataset.train_path)
    assert len(shards) > 1 and dataset.num_samples > len(landing_documents())  # both sources packed
    whole = packed_splits_are_well_formed(dataset)
    assert whole.passed, whole.metadata["problems"].value

    damage(Path(shards[1]))
    result = packed_splits_are_well_formed(dataset)
    [problem] = result.metadata["problems"].value
    assert not result.passed and problem.startswith(f"train ({dataset.train_path}) cannot be read: ")
    assert shards[1] in problem
    assert re.search(error, problem), problem  # one problem: the validation split still reads well
