"""Packed preference data: pairs tokenized with the student's chat template, split by pair id, stored day by day.

Each pair is tokenized as TRL's ``DPOTrainer`` tokenizes a conversational row, and a shard keeps TRL's
``prompt``/``chosen``/``rejected`` columns beside the ids, so it loads in ``DPOTrainer`` as it is
(``datasets.Dataset.from_parquet``) and TRL's tokenization gives exactly the stored ids (tested):
``P`` = the prompt with the generation prompt, ``PC``/``PR`` = prompt + chosen / rejected (no special token
added beyond the template's), ``n`` = the longer common prefix both share with ``P``; ``prompt_input_ids`` = P[:n],
``chosen_input_ids`` = PC[n:], ``rejected_input_ids`` = PR[n:] (the answer and its end-of-turn, which is all that
is learned). A day's pairs are one content-addressed JSONL (``day_inputs_from_partitions``, checked for
contamination like every training input); its tokenized rows are one shard per split in the store
``<root>/store/<day file>-<tokenizer>.<split>.parquet``, so a night tokenizes only its day, and the same input
gives the same bytes. A snapshot ``<root>/<run_hash>/`` lists the store's shards in day order per split
(``<split>.shards.json``, ``core/packaging/formats/packed_split.py``).

Bad input fails before anything is written, naming the file, line and pair: an empty chosen answer, chosen equal to
rejected, a prompt on the eval set's held-out side, and (``ModelLimits``: the model the pairs will train) a token id
outside its vocabulary or a prompt + completion longer than its positions.

A pair on two days (a document that landed on both, answered by the same model: the same ``pair_id``) is kept once,
from the earlier day: the later day's shard is used without it (a derived shard in the store, named by what it
leaves out), so a training never sees a pair twice nor fails on a repeated id.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from nexa_dagster.core.common import storage
from nexa_dagster.core.common.jsonl import dumps
from nexa_dagster.core.data.splits import is_held_out, is_validation
from nexa_dagster.core.packaging.formats.packed_split import (
    read_packed_frame,
    split_manifest_path,
    write_split_manifest,
)
from nexa_dagster.core.packaging.packing import tokenizer_fingerprint
from nexa_dagster.core.packaging.store_cleanup import SplitManifestStore, clean_store, packaging_in_flight

FORMAT = "packed-preference-parquet/1"
SPLITS = ("train", "validation")
MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
SCHEMA = pa.schema(
    [
        ("pair_id", pa.string()),
        ("day", pa.string()),
        ("prompt_input_ids", pa.list_(pa.int32())),
        ("chosen_input_ids", pa.list_(pa.int32())),
        ("rejected_input_ids", pa.list_(pa.int32())),
        # TRL's conversational columns, so a shard loads in DPOTrainer as it is (which tokenizes them to the ids)
        ("prompt", MESSAGES),
        ("chosen", MESSAGES),
        ("rejected", MESSAGES),
    ]
)


class PreferenceDataError(ValueError):
    """A pair that no training should see; the message names the file and line."""


def pairs_to_jsonl(pairs: pd.DataFrame, out_root: str) -> str:
    """A day's ``preference_pairs`` as a content-addressed JSONL (sorted by pair id: order-independent)."""
    pairs = pairs.sort_values("pair_id", kind="stable")

    def plain(messages: Any) -> list[dict[str, str]]:  # Parquet gives numpy arrays of dicts back
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]

    body = b"".join(
        dumps(
            {
                "pair_id": r.pair_id,
                "sample_id": r.sample_id,
                "day": r.day,
                "prompt": plain(r.prompt),
                "chosen": plain(r.chosen),
                "rejected": plain(r.rejected),
            }
        )
        for r in pairs.itertuples()
    )
    return storage.write_content_addressed(storage.join(out_root, "inputs"), "preference_pairs", body)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def tokenize_pair(tokenizer: Any, record: dict[str, Any]) -> dict[str, Any]:
    """One pair as TRL's DPOTrainer tokenizes a conversational row (see the module's docstring)."""

    def ids(messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
        out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    p = ids(record["prompt"], True)
    pc = ids(record["prompt"] + record["chosen"], False)
    pr = ids(record["prompt"] + record["rejected"], False)
    n = min(_common_prefix(p, pc), _common_prefix(p, pr))
    return {
        "pair_id": record["pair_id"],
        "day": record["day"],
        "prompt_input_ids": p[:n],
        "chosen_input_ids": pc[n:],
        "rejected_input_ids": pr[n:],
        "prompt": record["prompt"],
        "chosen": record["chosen"],
        "rejected": record["rejected"],
    }


def check_pair(record: dict[str, Any], where: str, eval_fraction: float) -> None:
    """The pair is one a training may see, or a ``PreferenceDataError`` naming ``where`` and what is wrong."""
    chosen = "".join(m["content"] for m in record["chosen"]).strip()
    rejected = "".join(m["content"] for m in record["rejected"]).strip()
    if not chosen:
        raise PreferenceDataError(f"{where}: pair {record['pair_id']}: the chosen answer is empty")
    if chosen == rejected:
        raise PreferenceDataError(
            f"{where}: pair {record['pair_id']}: chosen and rejected are the same answer"
        )
    if is_held_out(str(record["sample_id"]), eval_fraction):
        raise PreferenceDataError(
            f"{where}: pair {record['pair_id']}: its prompt (sample {record['sample_id']}) is on the eval set's "
            "held-out side, which no training may see"
        )


@dataclass(frozen=True)
class ModelLimits:
    """What the model the pairs will train can take: token ids below ``vocab_size``, sequences of at most
    ``max_length`` tokens (its positions)."""

    vocab_size: int
    max_length: int


def check_limits(row: dict[str, Any], where: str, limits: ModelLimits | None) -> None:
    """A tokenized pair the model can train on, or a ``PreferenceDataError`` naming ``where`` and the pair."""
    if limits is None:
        return
    for name in ("prompt", "chosen", "rejected"):
        ids = row[f"{name}_input_ids"]
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise PreferenceDataError(
                f"{where}: pair {row['pair_id']}: {name} has token id {bad[0]} outside the model's "
                f"{limits.vocab_size} ids (tokenized with a different tokenizer)"
            )
    longest = len(row["prompt_input_ids"]) + max(len(row["chosen_input_ids"]), len(row["rejected_input_ids"]))
    if longest > limits.max_length:
        raise PreferenceDataError(
            f"{where}: pair {row['pair_id']}: prompt and completion are {longest} tokens, more than the model's "
            f"{limits.max_length} positions"
        )


@dataclass(frozen=True)
class PreferenceSnapshot:
    run_hash: str
    root: str
    train_path: str
    validation_path: str
    pairs: dict[str, int]  # split -> pairs
    shards_reused: int
    tokenizer_path: str
    cross_day_duplicates_dropped: int = 0  # pairs on an earlier day too, kept from there


def build_preference_dataset(
    days: Sequence[Any],
    tokenizer: Any,
    tokenizer_path: str,
    out_root: str,
    validation_fraction: float,
    eval_fraction: float,
    seed: int = 0,
    log: Callable[[str], None] = print,
    limits: ModelLimits | None = None,
    keep_snapshots: int = 0,
) -> PreferenceSnapshot:
    """The snapshot of ``days`` (``DayInput``-like: ``path``, in day order): each day tokenized once into the store,
    then split manifests over the store's shards in day order, a pair already on an earlier day left out.
    ``limits``: refuse pairs the model to train cannot take (checked on reused shards too). ``keep_snapshots``: then
    keep the newest that many snapshots and the store files they list, removing the rest (0: keep all), as
    ``sft_dataset`` does (``store_cleanup``; never while another packaging run is in flight)."""
    with packaging_in_flight(out_root):  # no clean-up removes a shard this run may still pick up
        fingerprint = tokenizer_fingerprint(tokenizer)
        store = storage.join(out_root, "store")
        day_paths, reused = _stored_days(
            days, tokenizer, store, fingerprint, validation_fraction, eval_fraction, seed, limits
        )
        shards, dropped = _shards_without_repeats(day_paths, log)
        config = {
            "format": FORMAT,
            "tokenizer": fingerprint,
            "validation_fraction": validation_fraction,
            "eval_fraction": eval_fraction,
            "seed": seed,
            "shards": [s[2] for split in SPLITS for s in shards[split]],
        }
        run_hash = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
        root = storage.join(out_root, run_hash)
        counts = {split: sum(s[3] for s in shards[split]) for split in SPLITS}
        if not counts["train"] or not counts["validation"]:
            raise PreferenceDataError(
                f"preference dataset {run_hash}: {counts['train']} training and {counts['validation']} validation pairs; "
                "both sides need at least one (more pairs, or another validation_fraction)"
            )
        _write_manifests(root, run_hash, out_root, shards)
        storage.write_json(
            {**config, "run_hash": run_hash, "pairs": counts, "tokenizer_path": tokenizer_path},
            storage.join(root, "snapshot.json"),
        )
        log(
            f"preference dataset {run_hash}: {counts['train']} training and {counts['validation']} validation pairs "
            f"from {len(days)} days ({reused} days' shards reused)"
        )
    clean_store(out_root, keep_snapshots, log, SplitManifestStore())
    return PreferenceSnapshot(
        run_hash,
        root,
        split_manifest_path(root, "train"),
        split_manifest_path(root, "validation"),
        counts,
        reused,
        tokenizer_path,
        dropped,
    )


ShardEntry = tuple[str, int, str, int]  # a split's shard in a manifest: path, bytes, SHA-256, pairs


def _stored_days(
    days: Sequence[Any],
    tokenizer: Any,
    store: str,
    fingerprint: str,
    validation_fraction: float,
    eval_fraction: float,
    seed: int,
    limits: ModelLimits | None,
) -> tuple[list[dict[str, str]], int]:
    """Each day's shard per split in the store (``split -> path``, in day order) and how many days were reused.

    A day whose shards are all there is reused (its rows checked against ``limits``, which may be new); any other
    is tokenized now. Every day is tokenized and checked before any manifest is written."""
    day_paths = []
    reused = 0
    for day in days:
        name = day.path.rsplit("/", 1)[-1].removesuffix(".jsonl")
        paths = {s: storage.join(store, f"{name}-{fingerprint}.{s}.parquet") for s in SPLITS}
        if all(storage.exists(p) for p in paths.values()):
            reused += 1
            for path in paths.values() if limits is not None else ():
                for row in _read_rows(path):
                    check_limits(row, path.rsplit("/", 1)[-1], limits)
        else:
            _tokenize_day(day.path, tokenizer, paths, validation_fraction, eval_fraction, seed, limits)
        day_paths.append(paths)
    return day_paths, reused


def _shards_without_repeats(
    day_paths: list[dict[str, str]], log: Callable[[str], None]
) -> tuple[dict[str, list[ShardEntry]], int]:
    """Each split's shards in day order, a shard replaced by its derived copy where an earlier day already holds
    some of its pairs (``_without_earlier_pairs``), and how many pairs were left out so."""
    shards: dict[str, list[ShardEntry]] = {s: [] for s in SPLITS}
    seen: dict[str, str] = {}  # pair_id -> the shard (earlier day) it is kept from
    dropped = 0
    for paths in day_paths:
        for split, path in list(paths.items()):
            paths[split], repeated = _without_earlier_pairs(path, seen, log)
            dropped += repeated
        for split, path in paths.items():
            with storage.open_read(path) as f:
                rows = pq.ParquetFile(f).metadata.num_rows
            shards[split].append((path, storage.size(path), storage.sha256_file(path), rows))
    return shards, dropped


def _write_manifests(root: str, run_hash: str, out_root: str, shards: dict[str, list[ShardEntry]]) -> None:
    """Each split's manifest in the snapshot folder ``root``, naming its shards relative to ``out_root``."""
    for split in SPLITS:
        write_split_manifest(
            split_manifest_path(root, split),
            split,
            run_hash,
            out_root,
            [
                (p.removeprefix(out_root.rstrip("/") + "/"), size, digest, rows)
                for p, size, digest, rows in shards[split]
            ],
        )


def _tokenize_day(
    path: str,
    tokenizer: Any,
    outputs: dict[str, str],
    validation_fraction: float,
    eval_fraction: float,
    seed: int,
    limits: ModelLimits | None = None,
) -> None:
    rows: dict[str, list[dict[str, Any]]] = {s: [] for s in SPLITS}
    label = path.rsplit("/", 1)[-1]
    with storage.open_read(path) as f:
        for line_no, line in enumerate(f, start=1):
            record = json.loads(line)
            check_pair(record, f"{label}:{line_no}", eval_fraction)
            side = "validation" if is_validation(record["pair_id"], validation_fraction, seed) else "train"
            row = tokenize_pair(tokenizer, record)
            check_limits(row, f"{label}:{line_no}", limits)
            rows[side].append(row)
    for split, out in outputs.items():
        _write_rows(rows[split], out)


def _write_rows(rows: list[dict[str, Any]], out: str) -> None:
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    with storage.atomic_writer(out) as f:
        f.write(buffer.getvalue())


def _read_rows(path: str) -> list[dict[str, Any]]:
    with storage.open_read(path) as f:
        return pq.read_table(f).to_pylist()


def _without_earlier_pairs(path: str, seen: dict[str, str], log: Callable[[str], None]) -> tuple[str, int]:
    """(``path`` or a derived shard without the pairs an earlier day's shard already holds, how many it leaves out);
    ``seen`` records this shard's own pairs. The derived shard is named by what it leaves out: a rebuild reuses it."""
    with storage.open_read(path) as f:
        ids = [str(p) for p in pq.read_table(f, columns=["pair_id"]).column("pair_id").to_pylist()]
    repeated = sorted({p for p in ids if p in seen})
    for pair in ids:
        seen.setdefault(pair, path)
    if not repeated:
        return path, 0
    digest = hashlib.sha256("\n".join(repeated).encode()).hexdigest()[:12]
    derived = path.removesuffix(".parquet").rsplit(".", 1)
    out = f"{derived[0]}-without-{digest}.{derived[1]}.parquet"
    if not storage.exists(out):
        _write_rows([r for r in _read_rows(path) if r["pair_id"] not in set(repeated)], out)
    log(
        f"{len(repeated)} pair(s) of {path.rsplit('/', 1)[-1]} are on an earlier day too, kept from there "
        f"(e.g. {repeated[0]} from {seen[repeated[0]].rsplit('/', 1)[-1]})"
    )
    return out, len(repeated)


def snapshot_problems(train_path: str, validation_path: str, expected: dict[str, int]) -> list[str]:
    """What is wrong with a snapshot re-read from storage (the ``preference_dataset`` asset check): a split whose
    pair count is not the one recorded, a pair in both splits or twice in one, a missing column, an empty prompt or
    completion, chosen and rejected with the same tokens. Empty: none."""
    problems: list[str] = []
    seen: dict[str, str] = {}
    for split, manifest in (("train", train_path), ("validation", validation_path)):
        try:
            frame = read_packed_frame(manifest)
        except (
            OSError,
            ValueError,
        ) as e:  # a shard gone from the store or replaced: DPO could not read it either
            problems.append(f"{split} ({manifest}) cannot be read: {type(e).__name__}: {str(e)[:300]}")
            continue
        missing = [
            c
            for c in ("pair_id", "prompt_input_ids", "chosen_input_ids", "rejected_input_ids")
            if c not in frame
        ]
        if missing:
            problems.append(f"{split} ({manifest}): columns {missing} missing")
            continue
        if len(frame) != expected.get(split):
            problems.append(f"{split}: {len(frame)} pairs, the snapshot records {expected.get(split)}")
        for row in frame.itertuples(index=False):
            where = f"{split}: pair {row.pair_id}"
            if row.pair_id in seen:
                problems.append(f"{where} is also in {seen[row.pair_id]}")
            seen[str(row.pair_id)] = split
            sizes = (len(row.prompt_input_ids), len(row.chosen_input_ids), len(row.rejected_input_ids))
            if 0 in sizes:
                problems.append(f"{where}: an empty prompt or completion (tokens {sizes})")
            if list(row.chosen_input_ids) == list(row.rejected_input_ids):
                problems.append(f"{where}: chosen and rejected are the same tokens")
    return problems


def pair_texts(prompt_segments: Callable[[str], list[str]]) -> Callable[[dict[str, Any]], list[str]]:
    """The texts of a pair checked for contamination: the user turn without its template's words, both answers."""

    def texts(record: dict[str, Any]) -> list[str]:
        out: list[str] = []
        for message in record["prompt"]:
            if message["role"] == "user":
                out += prompt_segments(message["content"])
        return out + [m["content"] for m in (*record["chosen"], *record["rejected"])]

    return texts
