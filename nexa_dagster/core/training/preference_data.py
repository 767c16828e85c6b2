"""Preference input: packed pairs, their reference log-probabilities, and a deterministic resumable order of pairs.

A preference snapshot (``packed-preference-parquet/1``, written by packaging) holds one row per pair:
``pair_id``, ``prompt_input_ids``, ``chosen_input_ids``, ``rejected_input_ids`` (TRL's split of the chat-templated
prompt and completions: the completion starts where the tokenized prompt and prompt+completion diverge) and
``day``; a split is a manifest of shard files, read like SFT's (``read_packed_frame``).

The reference log-probabilities of every pair (the reference model's summed log-probability of each completion)
live beside the snapshot, ``<snapshot>/ref_logps-<reference id>.parquet`` with a JSON sidecar naming the reference
checkpoint and the dataset: computed once per (pair set, reference checkpoint) by the training worker, read by every
later attempt and run, so training never holds a second model.

A micro-batch of ``b`` pairs is ``2b`` rows, the ``b`` prompt+chosen rows then the ``b`` prompt+rejected rows,
right-padded; ``labels`` hold the completion tokens (-100 elsewhere), scored as TRL scores them: token ``t >= 1`` by
the logits at ``t - 1``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from nexa_dagster.core.common import storage
from nexa_dagster.core.packaging.formats.packed_split import read_packed_frame
from nexa_dagster.core.packaging.packing import IGNORE_INDEX
from nexa_dagster.core.training.data import HOST_KEYS, Batch, index_stream

FORMAT = "packed-preference-parquet/1"
PAIR_COLUMNS = ("pair_id", "prompt_input_ids", "chosen_input_ids", "rejected_input_ids")
REF_COLUMNS = ("pair_id", "ref_chosen_logps", "ref_rejected_logps")
REF_PREFIX = "ref_logps-"
REAL_TOKENS = "real_tokens"  # a micro-batch's non-padding tokens, counted on the host by collate_pairs
PAIR_HOST_KEYS = frozenset(HOST_KEYS | {REAL_TOKENS})  # what the loader leaves on the host (Prefetcher)


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

    def where(row: int) -> str:
        return f"preference pairs {path}, row {row} (pair_id {pair_ids[row]!r})"

    for row in range(len(frame)):
        prompt, chosen, rejected = (columns[n][row] for n in ("prompt", "chosen", "rejected"))
        if prompt.size == 0:
            raise ValueError(f"{where(row)}: empty prompt")
        # an empty *rejected* answer is a preference worth learning (a policy that stops at once), so only an
        # empty chosen answer is refused; the rejected one needs at least its end-of-turn token
        content = [int(t) for t in chosen if int(t) not in special]
        if not content or not tokenizer.decode(content).strip():
            raise ValueError(f"{where(row)}: empty chosen answer ({chosen.size} tokens, none of them text)")
        if rejected.size == 0:
            raise ValueError(
                f"{where(row)}: the rejected completion has no tokens (not even its end-of-turn)"
            )
        if np.array_equal(chosen, rejected):
            raise ValueError(f"{where(row)}: chosen and rejected are the same tokens: there is no preference")
        for name, ids in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
            if ids.min() < 0 or ids.max() >= vocab:
                raise ValueError(
                    f"{where(row)}: {name} has token id {int(ids.max() if ids.max() >= vocab else ids.min())} "
                    f"outside the tokenizer's {vocab} ids: tokenized with a different tokenizer"
                )
        longest = prompt.size + max(chosen.size, rejected.size)
        if longest > max_length:
            raise ValueError(
                f"{where(row)}: prompt and completion are {longest} tokens, more than the model's {max_length} "
                "positions"
            )
    return Pairs(path, pair_ids, columns["prompt"], columns["chosen"], columns["rejected"])


def check_disjoint(train: Pairs, validation: Pairs) -> None:
    """A validation pair that is also trained on would make the held-out reward accuracy meaningless."""
    shared = sorted(set(train.pair_ids) & set(validation.pair_ids))
    if shared:
        raise ValueError(
            f"{len(shared)} pair(s) are both in {train.path} and in {validation.path}, e.g. {shared[:3]}: the "
            "validation pairs must be held out"
        )


# -- batches ----------------------------------------------------------------------------------------------------
def collate_pairs(pairs: Pairs, indices: Sequence[int], pad_id: int) -> Batch:
    """``2b`` right-padded rows (prompt+chosen for each pair, then prompt+rejected), TRL's layout.

    ``labels`` are the completion tokens (-100 on prompt and padding), ``attention_mask`` marks real tokens,
    ``completion_tokens`` counts each row's completion (the length-normalised loss divides by it), and
    ``ref_chosen``/``ref_rejected`` are the pairs' reference log-probabilities when known. Position ids are the
    model's default ``0..T-1``: under causal attention the padding at a row's end reaches no real token.
    """
    rows = [np.concatenate([pairs.prompt[i], pairs.chosen[i]]) for i in indices] + [
        np.concatenate([pairs.prompt[i], pairs.rejected[i]]) for i in indices
    ]
    prompts = [pairs.prompt[i].size for i in indices] * 2
    width = max(r.size for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.int64)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.int64)
    attention = torch.zeros((len(rows), width), dtype=torch.int64)
    for k, (row, start) in enumerate(zip(rows, prompts, strict=True)):
        tokens = torch.from_numpy(row)
        input_ids[k, : row.size] = tokens
        labels[k, start : row.size] = tokens[start:]
        attention[k, : row.size] = 1
    batch: Batch = {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": attention,
        "completion_tokens": torch.tensor([r.size - p for r, p in zip(rows, prompts, strict=True)]).float(),
    }
    if pairs.ref_chosen is not None and pairs.ref_rejected is not None:
        mine = torch.as_tensor(list(indices), dtype=torch.int64)
        batch["ref_chosen"], batch["ref_rejected"] = pairs.ref_chosen[mine], pairs.ref_rejected[mine]
    batch[REAL_TOKENS] = torch.tensor(sum(r.size for r in rows))  # counted on the host, read without a sync
    return batch


def pair_batches(
    pairs: Pairs, micro_batch: int, seed: int, rank: int, world_size: int, pad_id: int, start: int = 0
) -> Iterator[Batch]:
    """This rank's micro-batch of every global batch of pairs, from global batch number ``start`` on (resume).

    The order is ``index_stream``'s (one seeded permutation per epoch, a pure function of seed and position), so a
    resumed run gets exactly the pairs an uninterrupted one would have seen next.
    """
    stream = index_stream(len(pairs), seed)
    if start:
        next(itertools.islice(stream, start * micro_batch * world_size - 1, None))
    while True:
        global_batch = list(itertools.islice(stream, micro_batch * world_size))
        yield collate_pairs(pairs, global_batch[rank * micro_batch : (rank + 1) * micro_batch], pad_id)


def rank_rounds(n: int, micro_batch: int, rank: int, world_size: int) -> Iterator[list[int]]:
    """This rank's share of ``range(n)``, ``micro_batch`` at a time, in as many rounds as every other rank has.

    A rank whose share has run out gets an empty list (its caller runs a filler batch and drops the result):
    under ZeRO-3 a forward gathers parameters from every rank, so all ranks must run the same number.
    """
    rounds = math.ceil(n / (micro_batch * world_size))
    for r in range(rounds):
        first = r * micro_batch * world_size + rank * micro_batch
        yield list(range(first, min(first + micro_batch, n)))


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
    import pandas as pd

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
