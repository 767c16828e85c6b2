"""Pretraining input: a Megatron bin/idx corpus as packed rows of the SFT format, with a held-out side.

The pretraining stage reuses the SFT training path unchanged (same loop, loader, resume and attention masks): the
corpus's documents are concatenated into rows of exactly ``pack_size`` tokens, ``position_ids`` restart at every
document start (and where a document carried over from the previous row continues), so the model's
within-document attention and ``labels_for`` (which never predicts a document's first token from the previous
document) apply exactly as to packed conversations. ``loss_mask`` is 1 on every real token: pretraining learns
every token.

Which documents are held out is a hash of the document's id, and a bin/idx corpus has no ids: a document's id
here is the SHA-256 of its tokens (as int64), which is stable whatever the shard, position or dtype, so a
document stays on its side whatever else arrives in later corpora. The held-out documents never enter a
training row; their perplexity is the base model's own validation loss.

Before that split, the documents on the frozen eval set's side (``core.data.splits.is_held_out`` of the document id
below ``eval_set.corpus_fraction``: the eval set's salt, independent of the training seed and of
``heldout_fraction``) are taken out of the corpus altogether, as packaging takes held-out samples out of both SFT
splits: whatever corpus a base model trains on, later and bigger ones included, it never trains on a document
that an eval-set version froze (``core.eval_set.freeze_eval_set``), so base models are compared on those.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from nexa_dagster.core.common import storage
from nexa_dagster.core.data.splits import is_held_out, is_validation, side_overrides
from nexa_dagster.core.packaging.formats.indexed_dataset import corpus_prefixes, document_id, read_documents

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class CorpusSplit:
    train: list[np.ndarray]
    heldout: list[np.ndarray]
    heldout_ids: frozenset[str]
    eval_set_documents: int = 0  # kept out of both sides: the frozen eval set's side


def without_eval_set_documents(documents: list[np.ndarray], eval_fraction: float) -> list[np.ndarray]:
    """The documents not on the frozen eval set's side (``core.data.splits.is_held_out`` of their id)."""

    return [d for d in documents if not is_held_out(document_id(d), eval_fraction)]


def split_documents(documents: list[np.ndarray], heldout_fraction: float, seed: int = 0) -> CorpusSplit:
    """The held-out side: documents whose id hashes below ``heldout_fraction`` (the SFT split's rule), moved so
    that, with two or more distinct documents, neither side is empty. Duplicated documents share a side."""
    ids = [document_id(d) for d in documents]
    overrides = side_overrides(ids, heldout_fraction, seed)

    def held(doc_id: str) -> bool:
        side = overrides.get(doc_id)
        return side == "validation" if side else is_validation(doc_id, heldout_fraction, seed)

    sides = [held(i) for i in ids]
    return CorpusSplit(
        train=[d for d, h in zip(documents, sides, strict=True) if not h],
        heldout=[d for d, h in zip(documents, sides, strict=True) if h],
        heldout_ids=frozenset(i for i, h in zip(ids, sides, strict=True) if h),
    )


def pack_stream(documents: list[np.ndarray], pack_size: int, pad_id: int) -> Batch:
    """Documents back to back in rows of ``pack_size`` tokens; positions restart at each document (and at a row
    start); the last row is padded (attention 0, loss 0). Loss on every real token."""
    if not documents:
        raise ValueError("no documents to pack")
    stream = np.concatenate(documents)
    starts = np.zeros(len(stream), dtype=bool)
    starts[np.cumsum([0] + [len(d) for d in documents[:-1]])] = True
    rows = -(-len(stream) // pack_size)
    slots = rows * pack_size
    input_ids = np.full(slots, pad_id, dtype=np.int64)
    input_ids[: len(stream)] = stream
    attention = np.zeros(slots, dtype=np.int64)
    attention[: len(stream)] = 1
    restart = np.zeros(slots, dtype=bool)
    restart[: len(stream)] = starts
    restart[::pack_size] = True  # a carried-over document starts again at position 0 in its new row
    if len(stream) < slots:
        restart[len(stream)] = True  # padding counts from 0 too; attention_mask hides it
    index = np.arange(slots)
    last_start = np.maximum.accumulate(np.where(restart, index, 0))
    positions = index - last_start
    shape = (rows, pack_size)
    return {
        "input_ids": torch.from_numpy(input_ids.reshape(shape)),
        "loss_mask": torch.from_numpy(attention.reshape(shape).copy()),
        "position_ids": torch.from_numpy(positions.reshape(shape)),
        "attention_mask": torch.from_numpy(attention.reshape(shape)),
    }


def load_corpus(
    path: str,
    pack_size: int,
    heldout_fraction: float,
    pad_id: int,
    seed: int = 0,
    eval_fraction: float = 0.0,
    exclude: frozenset[str] = frozenset(),
) -> tuple[Batch, Batch, CorpusSplit]:
    """(training rows, held-out rows, the split) of a bin/idx corpus, ready for the training loop; the documents
    on the eval set's side (``eval_fraction``, 0: none) and those whose id is in ``exclude`` (contaminated) are in
    neither."""
    everything = read_documents(corpus_prefixes(path))
    documents = [
        d for d in without_eval_set_documents(everything, eval_fraction) if document_id(d) not in exclude
    ]
    if len(documents) < 2:
        kept_out = (
            f" once the {len(everything) - len(documents)} on the eval set's side (eval_set.corpus_fraction="
            f"{eval_fraction}) are kept out"
            if len(everything) != len(documents)
            else ""
        )
        raise ValueError(
            f"pretraining corpus {path} has {len(documents)} document(s){kept_out}; a training side "
            "and a held-out side need at least two"
        )
    split = split_documents(documents, heldout_fraction, seed)
    split = CorpusSplit(split.train, split.heldout, split.heldout_ids, len(everything) - len(documents))
    if not split.train or not split.heldout:
        raise ValueError(f"pretraining corpus {path}: every document is identical, nothing left to hold out")
    return pack_stream(split.train, pack_size, pad_id), pack_stream(split.heldout, pack_size, pad_id), split


def served_path(output_dir: str) -> str:
    """Where the worker records what its loader serves: beside the checkpoint directory, not in it (the
    checkpoint is written under a temporary name and renamed into place at the end)."""
    return f"{output_dir.rstrip('/')}.served.json"


def rows_sha256(rows: Batch) -> str:
    """SHA-256 of the training rows' token ids (int64), as the loader serves them."""
    return hashlib.sha256(rows["input_ids"].numpy().astype(np.int64).tobytes()).hexdigest()


def record_served(output_dir: str, split: CorpusSplit, train: Batch) -> None:
    """The ids of the documents packed into the training rows, in order, and the rows' hash: a reader re-packs
    those documents (``pack_stream``) and compares hashes to know they are exactly what was served, whatever the
    job asked to exclude (a contamination check reads what was trained on, not what was meant to be)."""
    storage.write_json(
        {"document_ids": [document_id(d) for d in split.train], "rows_sha256": rows_sha256(train)},
        served_path(output_dir),
    )
