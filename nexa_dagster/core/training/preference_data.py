"""Preference input: packed pairs, their reference log-probabilities, and a deterministic resumable order of pairs.

A preference snapshot (``packed-preference-parquet/1``, written by packaging) holds one row per pair:
``pair_id``, ``prompt_input_ids``, ``chosen_input_ids``, ``rejected_input_ids`` (TRL's split of the chat-templated
prompt and completions: the completion starts where the tokenized prompt and prompt+completion diverge) and
``day``; a split is a manifest of shard files, read like SFT's (``read_packed_frame``).

The reference log-probabilities of every pair (the reference model's summed log-probability of each completion)
live beside the snapshot, ``<snapshot>/ref_logps-<reference id>.parquet`` with a JSON sidecar naming the reference
checkpoint and the dataset: computed once per (pair set, reference checkpoint) by the training worker, read by every
later attempt and run, so training never holds a second model.

Pairs are packed as SFT packs samples: prompt+chosen and prompt+rejected are two documents, placed first-fit into the
rows of a micro-batch of fixed shape (``PairLayout``: ``2 x micro_batch`` rows of one length for the whole run), with
attention kept within each document and the completion log-probabilities summed per document (``segments``), scored
as TRL scores them: token ``t >= 1`` of a document by the logits at ``t - 1``. One shape for every batch: on a GPU
FlexAttention compiles once (per-batch padding made it recompile for every new length, then fall back to its
unfused kernel), and the short pairs of a batch no longer pay for its longest.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch

from nexa_dagster.core.common import storage
from nexa_dagster.core.packaging.formats.packed_split import read_packed_frame
from nexa_dagster.core.packaging.packing import IGNORE_INDEX
from nexa_dagster.core.training.data import HOST_KEYS, Batch, index_stream

FORMAT = "packed-preference-parquet/1"
PAIR_COLUMNS = ("pair_id", "prompt_input_ids", "chosen_input_ids", "rejected_input_ids")
REF_COLUMNS = ("pair_id", "ref_chosen_logps", "ref_rejected_logps")
REF_PREFIX = "ref_logps-"
REAL_TOKENS = "real_tokens"  # a micro-batch's non-padding tokens, counted on the host by collate_packed
PAIR_COUNT = "pairs"  # a micro-batch's pairs, counted on the host by collate_packed
PAIR_HOST_KEYS = frozenset(HOST_KEYS | {REAL_TOKENS, PAIR_COUNT})  # what the loader leaves on the host


@dataclass
class Pairs:
    """The pairs of one split, ragged token ids per pair, and (once known) their reference log-probabilities."""

    path: str
    pair_ids: list[str]
    prompt: list[np.ndarray]
    chosen: list[np.ndarray]
    rejected: list[np.ndarray]
    ref_chosen: torch.Tensor | None = field(default=None, repr=False)  # [pairs] float32
    ref_rejected: torch.Tensor | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.pair_ids)

    def with_reference(self, reference: dict[str, tuple[float, float]]) -> Pairs:
        chosen = [reference[p][0] for p in self.pair_ids]
        rejected = [reference[p][1] for p in self.pair_ids]
        self.ref_chosen = torch.tensor(chosen, dtype=torch.float64).float()
        self.ref_rejected = torch.tensor(rejected, dtype=torch.float64).float()
        return self


def load_pairs(path: str, tokenizer: Any, max_length: int) -> Pairs:
    """Read a preference split and refuse pairs DPO cannot learn from, naming the file, the row and the pair.

    Refused: a missing column, an empty split, a repeated ``pair_id``, an empty prompt, a chosen completion with no
    answer in it (no tokens, or only special tokens and whitespace: an empty answer through the chat template; an
    empty *rejected* answer is kept, it teaches the policy not to stop at once), a rejected completion with no tokens,
    chosen and rejected completions with the same tokens (no preference to learn), a token id outside the
    tokenizer's vocabulary, and a sequence longer than the model's positions (``max_length``).
    """
    frame = read_packed_frame(path)
    missing = [c for c in PAIR_COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(
            f"preference pairs {path} lack columns {missing} (has {list(frame.columns)}); expected the "
            f"{FORMAT} format"
        )
    if frame.empty:
        raise ValueError(f"preference pairs {path} hold no pairs")
    pair_ids = [str(p) for p in frame["pair_id"]]
    seen: dict[str, int] = {}
    for row, pair_id in enumerate(pair_ids):
        if pair_id in seen:
            raise ValueError(
                f"preference pairs {path}: pair_id {pair_id!r} is in rows {seen[pair_id]} and {row}"
            )
        seen[pair_id] = row
    columns = {
        name: [np.asarray(v, dtype=np.int64) for v in frame[f"{name}_input_ids"]]
        for name in ("prompt", "chosen", "rejected")
    }
    vocab, special = len(tokenizer), set(tokenizer.all_special_ids)
    for row in range(len(frame)):
        _check_pair(
            f"preference pairs {path}, row {row} (pair_id {pair_ids[row]!r})",
            *(columns[n][row] for n in ("prompt", "chosen", "rejected")),
            tokenizer,
            vocab,
            special,
            max_length,
        )
    return Pairs(path, pair_ids, columns["prompt"], columns["chosen"], columns["rejected"])


def _check_pair(
    where: str,
    prompt: np.ndarray,
    chosen: np.ndarray,
    rejected: np.ndarray,
    tokenizer: Any,
    vocab: int,
    special: set[int],
    max_length: int,
) -> None:
    """One pair DPO can learn from (``load_pairs`` lists the rules), or a ``ValueError`` naming ``where`` and why."""
    if prompt.size == 0:
        raise ValueError(f"{where}: empty prompt")
    # an empty *rejected* answer is a preference worth learning (a policy that stops at once), so only an
    # empty chosen answer is refused; the rejected one needs at least its end-of-turn token
    content = [int(t) for t in chosen if int(t) not in special]
    if not content or not tokenizer.decode(content).strip():
        raise ValueError(f"{where}: empty chosen answer ({chosen.size} tokens, none of them text)")
    if rejected.size == 0:
        raise ValueError(f"{where}: the rejected completion has no tokens (not even its end-of-turn)")
    if np.array_equal(chosen, rejected):
        raise ValueError(f"{where}: chosen and rejected are the same tokens: there is no preference")
    for name, ids in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(
                f"{where}: {name} has token id {int(ids.max() if ids.max() >= vocab else ids.min())} "
                f"outside the tokenizer's {vocab} ids: tokenized with a different tokenizer"
            )
    longest = prompt.size + max(chosen.size, rejected.size)
    if longest > max_length:
        raise ValueError(
            f"{where}: prompt and completion are {longest} tokens, more than the model's {max_length} positions"
        )


def check_disjoint(train: Pairs, validation: Pairs) -> None:
    """A validation pair that is also trained on would make the held-out reward accuracy meaningless."""
    shared = sorted(set(train.pair_ids) & set(validation.pair_ids))
    if shared:
        raise ValueError(
            f"{len(shared)} pair(s) are both in {train.path} and in {validation.path}, e.g. {shared[:3]}: the "
            "validation pairs must be held out"
        )


# -- batches: pairs packed into fixed-length rows ------------------------------------------------------------------
CHOSEN, REJECTED = 0, 1
Member = tuple[int, int]  # (pair index, CHOSEN or REJECTED): one document of a packed row


@dataclass(frozen=True)
class PairLayout:
    """Every micro-batch of a run is ``rows`` x ``length`` tokens: one input shape for training, reference scoring
    and the held-out rewards, so a compiled attention kernel is built once, never per batch."""

    rows: int
    length: int


def pair_layout(
    splits: Sequence[Pairs], micro_batch: int, pack_length: int = 0, multiple: int = 64
) -> PairLayout:
    """``2 x micro_batch`` rows (a micro-batch holds at least ``micro_batch`` pairs, more when they are short) of
    ``pack_length`` tokens, or of the longest prompt+completion of ``splits`` rounded up to ``multiple``."""
    longest, where = 0, ""
    for pairs in splits:
        for i in range(len(pairs)):
            size = pairs.prompt[i].size + max(pairs.chosen[i].size, pairs.rejected[i].size)
            if size > longest:
                longest, where = size, f"{pairs.path} (pair_id {pairs.pair_ids[i]!r})"
    if pack_length and pack_length < longest:
        raise ValueError(
            f"pack_length {pack_length} is shorter than the {longest} tokens of a prompt and completion in {where}"
        )
    return PairLayout(rows=2 * micro_batch, length=pack_length or -(-longest // multiple) * multiple)


def document_length(pairs: Pairs, member: Member) -> int:
    index, side = member
    return pairs.prompt[index].size + (pairs.chosen if side == CHOSEN else pairs.rejected)[index].size


def pack_pairs(
    pairs: Pairs, order: Iterable[int], layout: PairLayout, lookahead: int = 0
) -> Iterator[list[list[Member]]]:
    """The pairs of ``order`` packed into micro-batches of ``layout.rows`` rows; yields each micro-batch's rows.

    A window of the next ``lookahead`` pairs of the order (default ``2 x layout.rows``) is packed first-fit
    decreasing: the oldest pair of the window first (no pair waits more than ``lookahead`` micro-batches), then the
    others longest first, each pair's two documents (prompt+chosen, prompt+rejected) into the first rows with room;
    the pairs that do not fit wait in the window for the next micro-batch. A pair is never split over two
    micro-batches. A pure function of the order: a resumed run packs the same micro-batches.
    """
    window: list[int] = []
    upcoming = iter(order)
    size = lookahead or 2 * layout.rows
    while True:
        window.extend(itertools.islice(upcoming, size - len(window)))
        if not window:
            return
        rows: list[list[Member]] = [[] for _ in range(layout.rows)]
        free = [layout.length] * layout.rows
        longest_first = sorted(window[1:], key=lambda i: -pair_length(pairs, i))
        placed = set()
        for index in [window[0], *longest_first]:
            documents = [(index, CHOSEN), (index, REJECTED)]
            where = _first_fit(free, [document_length(pairs, d) for d in documents])
            if (
                where is None
            ):  # the oldest always fits: an empty micro-batch has two rows as long as any document
                continue
            for document, row in zip(documents, where, strict=True):
                rows[row].append(document)
                free[row] -= document_length(pairs, document)
            placed.add(index)
        window = [i for i in window if i not in placed]
        yield rows


def pair_length(pairs: Pairs, index: int) -> int:
    return document_length(pairs, (index, CHOSEN)) + document_length(pairs, (index, REJECTED))


def _first_fit(free: list[int], sizes: list[int]) -> list[int] | None:
    """The row of each of ``sizes`` (in turn, first fit), or None when one does not fit; ``free`` is unchanged."""
    left, where = list(free), []
    for size in sizes:
        row = next((r for r, f in enumerate(left) if f >= size), None)
        if row is None:
            return None
        left[row] -= size
        where.append(row)
    return where


def collate_packed(pairs: Pairs, rows: Sequence[Sequence[Member]], layout: PairLayout, pad_id: int) -> Batch:
    """One micro-batch of packed pairs, ``layout.rows x layout.length`` whatever the pairs' lengths.

    Each document is laid out as SFT's packer lays out a sample: ``position_ids`` restart at 0 (the model keeps
    attention within documents), ``attention_mask`` marks real tokens, padding at a row's end counts from 0 too.
    ``labels`` hold the completion tokens (-100 on prompts and padding). ``segments`` give each token its document's
    slot: ``j`` for the chosen document of the batch's ``j``-th pair, ``P + j`` for its rejected one, ``2P`` for
    padding (``P`` pairs, listed in ``pair_index``): the sums of the token log-probabilities per slot are the pairs'
    sequence log-probabilities. ``completion_tokens`` (``2P``, chosen then rejected) feed the length-normalised
    loss; ``ref_chosen``/``ref_rejected`` are the pairs' reference values when known.
    """
    order = list(dict.fromkeys(index for row in rows for index, _ in row))
    slot = {index: j for j, index in enumerate(order)}
    n = len(order)
    shape = (layout.rows, layout.length)
    input_ids = np.full(shape, pad_id, dtype=np.int64)
    labels = np.full(shape, IGNORE_INDEX, dtype=np.int64)
    position_ids = np.zeros(shape, dtype=np.int64)
    attention = np.zeros(shape, dtype=np.int64)
    segments = np.full(shape, 2 * n, dtype=np.int64)
    ramp = np.arange(layout.length, dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for index, side in row:
            prompt = pairs.prompt[index]
            completion = (pairs.chosen if side == CHOSEN else pairs.rejected)[index]
            k = prompt.size + completion.size
            input_ids[r, at : at + prompt.size] = prompt
            input_ids[r, at + prompt.size : at + k] = completion
            labels[r, at + prompt.size : at + k] = completion
            position_ids[r, at : at + k] = ramp[:k]
            attention[r, at : at + k] = 1
            segments[r, at : at + k] = slot[index] + side * n
            at += k
        position_ids[r, at:] = ramp[: layout.length - at]
    completion_tokens = [pairs.chosen[i].size for i in order] + [pairs.rejected[i].size for i in order]
    batch: Batch = {
        "input_ids": torch.from_numpy(input_ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(position_ids),
        "attention_mask": torch.from_numpy(attention),
        "segments": torch.from_numpy(segments),
        "completion_tokens": torch.tensor(completion_tokens, dtype=torch.float32),
        "pair_index": torch.tensor(order, dtype=torch.int64),
    }
    if pairs.ref_chosen is not None and pairs.ref_rejected is not None:
        mine = batch["pair_index"]
        batch["ref_chosen"], batch["ref_rejected"] = pairs.ref_chosen[mine], pairs.ref_rejected[mine]
    batch[REAL_TOKENS] = torch.tensor(int(attention.sum()))  # counted on the host, read without a sync
    batch[PAIR_COUNT] = torch.tensor(n)
    return batch


def pair_batches(
    pairs: Pairs, layout: PairLayout, seed: int, rank: int, world_size: int, pad_id: int, start: int = 0
) -> Iterator[Batch]:
    """This rank's packed micro-batches, from global micro-batch number ``start`` on (resume).

    The pairs come in ``index_stream``'s order (one seeded permutation per epoch, a pure function of seed and
    position) and are packed in that order; global micro-batch ``g`` goes to rank ``g % world_size``. Packing is
    cheap host work, so a resumed run packs the stream again from its beginning and skips what was trained: it gets
    exactly the micro-batches an uninterrupted run would have seen next.
    """
    packed = pack_pairs(pairs, index_stream(len(pairs), seed), layout)
    for rows in itertools.islice(packed, start * world_size + rank, None, world_size):
        yield collate_packed(pairs, rows, layout, pad_id)


def scoring_batches(
    pairs: Pairs, layout: PairLayout, pad_id: int, rank: int, world_size: int
) -> Iterator[tuple[Batch, bool]]:
    """Every pair once, packed first-fit decreasing over all of them (the order is free here: the fullest rows):
    this rank's share of the micro-batches, and whether each is its own.

    Every rank runs as many batches as the others (a rank whose share has run out gets a filler, flagged False:
    its caller drops the result): under ZeRO-3 a forward gathers parameters from every rank.
    """
    packed = list(pack_pairs(pairs, range(len(pairs)), layout, lookahead=len(pairs)))
    for first in range(0, len(packed), world_size):
        mine = first + rank < len(packed)
        yield collate_packed(pairs, packed[first + rank] if mine else packed[0], layout, pad_id), mine


# -- the reference log-probabilities file ----------------------------------------------------------------------
def reference_logps_file(train_path: str, reference_id: str) -> str:
    """``<snapshot>/ref_logps-<reference id>.parquet``: beside the training split (its manifest's folder, or the
    folder of a single Parquet file); the id's ``sha256:`` becomes ``sha256-`` (no colon in a file name)."""
    folder = str(train_path).rstrip("/").rpartition("/")[0] or "."
    return storage.join(folder, f"{REF_PREFIX}{reference_id.replace(':', '-')}.parquet")


def sidecar_of(path: str) -> str:
    return (path[: -len(".parquet")] if path.endswith(".parquet") else path) + ".json"


def read_reference_logps(
    path: str, reference_id: str, dataset_run_hash: str, pair_ids: Sequence[str]
) -> dict[str, tuple[float, float]] | None:
    """The stored reference log-probabilities of ``pair_ids``, or None when there is no complete file yet.

    The sidecar is written last, so a file without one is an attempt that died while writing: computed again.
    A file for another reference checkpoint or another dataset, one that lacks some of the pairs or holds a
    non-finite value is an error naming the file: training on it would pull towards the wrong model.
    """
    sidecar = sidecar_of(path)
    if not storage.exists(sidecar) or not storage.exists(path):
        return None
    try:
        meta = storage.read_json(sidecar)
    except ValueError as e:
        raise ValueError(f"reference log-probabilities {sidecar} is not valid JSON: {e}") from e
    if meta.get("reference_id") != reference_id:
        raise ValueError(
            f"reference log-probabilities {path} were computed with checkpoint {meta.get('reference_id')!r} "
            f"({meta.get('reference_path')}), not with this run's reference {reference_id!r}: delete the file "
            "or point reference_logps_path elsewhere"
        )
    if meta.get("dataset_run_hash") != dataset_run_hash:
        raise ValueError(
            f"reference log-probabilities {path} belong to dataset {meta.get('dataset_run_hash')!r}, not to "
            f"{dataset_run_hash!r}"
        )
    frame = storage.read_parquet(path)
    missing_columns = [c for c in REF_COLUMNS if c not in frame.columns]
    if missing_columns:
        raise ValueError(f"reference log-probabilities {path} lack columns {missing_columns}")
    values = {
        str(p): (float(c), float(r))
        for p, c, r in zip(
            frame["pair_id"], frame["ref_chosen_logps"], frame["ref_rejected_logps"], strict=True
        )
    }
    missing = [p for p in pair_ids if p not in values]
    if missing:
        raise ValueError(
            f"reference log-probabilities {path} lack {len(missing)} of the {len(pair_ids)} pairs, e.g. "
            f"{missing[:3]}: they were computed for other pairs"
        )
    bad = [p for p in pair_ids if not all(math.isfinite(v) for v in values[p])]
    if bad:
        raise ValueError(f"reference log-probabilities {path}: non-finite values for pairs {bad[:3]}")
    return values


def write_reference_logps(
    path: str,
    reference_id: str,
    reference_path: str,
    dataset_run_hash: str,
    pair_ids: Sequence[str],
    chosen: Sequence[float],
    rejected: Sequence[float],
) -> None:
    """Write the values (atomically), then the sidecar (atomically): the sidecar's presence marks a whole file."""
    frame = pd.DataFrame(
        {
            "pair_id": list(pair_ids),
            "ref_chosen_logps": np.asarray(chosen, dtype=np.float64),
            "ref_rejected_logps": np.asarray(rejected, dtype=np.float64),
        }
    )
    storage.write_parquet(frame, path)
    storage.write_json(
        {
            "reference_id": reference_id,
            "reference_path": reference_path,
            "dataset_run_hash": dataset_run_hash,
            "pairs": len(pair_ids),
        },
        sidecar_of(path),
    )
