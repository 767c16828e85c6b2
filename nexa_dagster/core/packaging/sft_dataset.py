"""The packed SFT dataset: blend -> shard plan -> (parallel, resumable, reused) tokenize-and-pack -> Parquet + JSONL.

Layout under ``<out_root>/``::

    inputs/filtered_samples-<sha>.jsonl   one file per day of judged samples (content-addressed, sorted by id)
    store/shards/<key>.{train,validation}.parquet, .jsonl, .quarantine.jsonl
    store/receipts/<key>.json       one per finished shard (outputs with size + SHA-256, counts)
    <run_hash>/plan.json            the shards and the configuration the run hash is made of
    <run_hash>/snapshot.json        the snapshot's manifest: its shards' receipts, in order
    <run_hash>/train.shards.json  validation.shards.json   each split's packed shard files, in order (no copy)
    <run_hash>/train.jsonl.shards.json  ...         the same conversations as {"sample_id", "messages"} (JSONL shards)
    <run_hash>/quarantine.jsonl     bad input rows with file:line and reason (``on_error: quarantine``)
    <run_hash>/dataset.json         the SFTDataset artifact

A shard's key is a hash of its input bytes, its place in its file, and the configuration its output depends on
(tokenizer, chat template, pack size, seed, split fractions, blend source and transform, format version): the store
holds each shard once, whatever snapshot asked for it first. Shards never span two days, so the snapshot after day
N+1 tokenizes and packs only day N+1's rows; its packed splits are manifests that list the store's shard files
(``core/packaging/formats/packed_split.py``), so nothing of days 1..N is read or copied either. It is byte for byte the snapshot a
build from nothing gives. The snapshot folder is named by the run hash (all shard keys), so a checkpoint
keeps pointing at the data it trained on. With ``incremental=False`` the shards live in the snapshot folder
(``<run_hash>/shards``, ``<run_hash>/receipts``) and every new plan packs everything again.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from nexa_dagster.core.common import stat_cache, storage
from nexa_dagster.core.common.artifacts import SFTDataset
from nexa_dagster.core.common.jsonl import (
    OnError,
    dumps,
)
from nexa_dagster.core.data.sample_ids import index_for, keep_earliest_day
from nexa_dagster.core.data.splits import is_held_out, is_validation, split_hash
from nexa_dagster.core.packaging import shards as sh
from nexa_dagster.core.packaging.blend import BlendSource, DataBlend
from nexa_dagster.core.packaging.formats import packed_split
from nexa_dagster.core.packaging.packing import (
    ChatTokenizer,
    PackingStats,
    conversation,
    pack_table,
    tokenizer_fingerprint,
)
from nexa_dagster.core.packaging.shard_rows import source_of, transformed_rows
from nexa_dagster.core.packaging.store_cleanup import clean_store, packaging_in_flight

FORMAT = "packed-sft-parquet/3"  # 3: a labels column (the Hugging Face -100 convention)
SNAPSHOT_FORMAT = "nexa-sft-snapshot/1"
SPLITS = ("train", "validation")
# the blend of a caller that names none: the judged samples alone (the sft_dataset asset passes the configured
# blends/sft.yaml, whose other sources, such as checkable_tasks, it builds and hands over itself)
JUDGED_SAMPLES_BLEND = DataBlend(
    name="sft-judged-samples",
    sources=[BlendSource(name="filtered_samples", path="asset:filtered_samples", transform="openai_chat")],
)
ENCODE_BATCH = 512  # conversations tokenized per call to the Rust tokenizer


@dataclass(frozen=True)
class PackagingSettings:
    """How packaging runs. Only the first four change the bytes of the output (they are in the run hash)."""

    pack_size: int
    validation_fraction: float
    seed: int = 0
    on_error: OnError = "raise"
    rows_per_shard: int = 5000
    workers: int = 1
    write_jsonl: bool = True
    side_overrides: dict[str, str] = field(
        default_factory=dict
    )  # sample id -> split (see packing.side_overrides)
    eval_fraction: float = 0.0  # ids on the eval set's held-out side (core.eval_set) enter no split at all
    incremental: bool = True  # shards in the content-addressed store, reused by later snapshots
    keep_snapshots: int = (
        0  # after a snapshot: keep the newest N and the store shards they list (0: keep all)
    )
    runner: sh.ShardRunner | None = field(
        default=None, compare=False
    )  # None: local processes; else a cluster


@dataclass
class SftRun:
    """What a packaging run produced: paths, the run hash, per-split packing stats and the shard report."""

    run_hash: str
    root: str
    paths: dict[str, str]
    stats: dict[str, PackingStats]
    num_shards: int
    rows_read: int
    quarantined_rows: int
    report: sh.RunReport
    blend: DataBlend
    held_out_rows: int = 0  # on the eval set's side: in no split

    @property
    def packing_efficiency(self) -> float:
        real = sum(s.real_tokens for s in self.stats.values())
        slots = sum(s.slots for s in self.stats.values())
        return real / slots if slots else 0.0


def record_id(source: BlendSource, raw: dict[str, Any], transformed: dict[str, Any]) -> str:
    """The record's own id when it has one, else a hash of its content (stable across files and days)."""
    if source.id_field and isinstance(raw.get(source.id_field), str | int):
        return str(raw[source.id_field])
    return hashlib.sha256(json.dumps(transformed, sort_keys=True).encode()).hexdigest()[:16]


def process_sft_shard(task: sh.ShardTask) -> sh.Receipt:
    """Read, transform, split, tokenize and pack one shard; write its outputs atomically (worker side)."""
    cfg = task.config
    source = source_of(task)
    chat: ChatTokenizer = task.runtime["chat_tokenizer"]
    convs: dict[str, list[list[dict[str, str]]]] = {s: [] for s in SPLITS}
    lines: dict[str, list[bytes]] = {s: [] for s in SPLITS}
    bad: list[bytes] = []
    rows = held_out = 0
    for item, out in transformed_rows(task, bad):
        rows += 1
        sid = record_id(source, item, out)
        if is_held_out(sid, cfg.get("eval_fraction", 0.0)):  # the frozen eval set's side: never trained on
            held_out += 1
            continue
        split = cfg["side_overrides"].get(sid) or (
            "validation" if is_validation(sid, cfg["validation_fraction"], cfg["seed"]) else "train"
        )
        for copy in range(source.copies(sid, cfg["seed"])):
            convs[split].append(out["messages"])
            if task.runtime.get("write_jsonl", True):
                lines[split].append(
                    dumps({"sample_id": sid if copy == 0 else f"{sid}#{copy}", "messages": out["messages"]})
                )
    rows += len(bad)
    outputs: list[str] = []
    stats: dict[str, Any] = {"rows": rows, "quarantined": len(bad), "held_out": held_out}
    for split in SPLITS:
        docs = []
        for i in range(0, len(convs[split]), ENCODE_BATCH):
            docs += chat.encode_conversations(convs[split][i : i + ENCODE_BATCH])
        convs[split] = []
        table, st = pack_table(docs, cfg["pack_size"], chat.pad_id)
        del docs
        rel = f"shards/{task.out_id}.{split}.parquet"
        _write_parquet(table, storage.join(task.root, rel))
        outputs.append(rel)
        stats[split] = st.to_json()
        if task.runtime.get("write_jsonl", True):
            rel = f"shards/{task.out_id}.{split}.jsonl"
            with storage.atomic_writer(storage.join(task.root, rel)) as out_file:
                out_file.write(b"".join(lines[split]))
            outputs.append(rel)
    if bad:
        rel = f"shards/{task.out_id}.quarantine.jsonl"
        with storage.atomic_writer(storage.join(task.root, rel)) as out_file:
            out_file.write(b"".join(bad))
        outputs.append(rel)
    return sh.Receipt(task.out_id, task.key, rows, {o: sh.output_entry(task.root, o) for o in outputs}, stats)


def _write_parquet(table: pa.Table, path: str) -> None:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", write_statistics=False)
    with storage.atomic_writer(path) as f:
        f.write(buf.getvalue())


def plan_config(
    blend: DataBlend, chat: ChatTokenizer, template: str, settings: PackagingSettings
) -> dict[str, Any]:
    """Everything the output bytes depend on besides the input bytes (hashed into the run hash)."""
    return {
        "format": FORMAT,
        **blend.plan_fields(),
        "tokenizer": chat.describe(),
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest(),
        "pack_size": settings.pack_size,
        "validation_fraction": settings.validation_fraction,
        "seed": settings.seed,
        "side_overrides": dict(sorted(settings.side_overrides.items())),
        "eval_fraction": settings.eval_fraction,
        "on_error": settings.on_error,
        "rows_per_shard": settings.rows_per_shard,
        "write_jsonl": settings.write_jsonl,
        "pyarrow": pa.__version__,
    }


def shard_config_for(config: dict[str, Any]) -> sh.ConfigFor | None:
    """Each shard keeps only the split overrides (``side_overrides``) that may concern its own rows.

    The overrides are a property of the whole snapshot (they exist only while a split would otherwise be empty),
    so in the run's configuration they would change every shard's key the day they appear or vanish, and the whole
    history would be repacked. A shard's key carries the overrides whose id occurs in its bytes (a substring test:
    any spelling of the id as JSON may write it; a false match only costs reuse, never correctness, since an id absent
    from the shard cannot change its output).
    """
    overrides: dict[str, str] = config.get("side_overrides") or {}
    base = {**config, "side_overrides": {}}
    if not overrides:
        return lambda shard: base

    def own(shard: sh.Shard) -> dict[str, Any]:
        with storage.open_read(shard.path) as f:
            f.seek(shard.start)
            body = f.read(shard.end - shard.start)
        mine = {
            sid: side
            for sid, side in overrides.items()
            if any(
                form in body
                for form in (
                    sid.encode(),
                    json.dumps(sid)[1:-1].encode(),
                    json.dumps(sid, ensure_ascii=False)[1:-1].encode(),
                )
            )
        }
        return {**base, "side_overrides": mine}

    return own


def package_sft(
    blend: DataBlend,
    tokenizer: Any,
    out_root: str,
    settings: PackagingSettings,
    assets: dict[str, str | list[str]] | None = None,
    log: Callable[[str], None] = print,
) -> SftRun:
    """Plan, run (reusing shards with valid receipts) and finalize a packed SFT dataset.

    The snapshot folder ``<out_root>/<run_hash>/`` is named by the whole plan; the shards' outputs live in the
    content-addressed store ``<out_root>/store/`` (``settings.incremental``, the default), named by their shard key,
    so the next snapshot (one more day) packs only the shards it does not find there. With ``incremental=False``
    each snapshot keeps its shards to itself (the behaviour before the store: every new plan repacks everything).
    """
    inputs = blend.resolve(assets)
    # local inputs' shard ranges are remembered by their stat: a night does not read earlier days' files again
    shards = sh.plan_shards([(s.name, files) for s, files in inputs], settings.rows_per_shard)
    if not shards:
        raise ValueError(f"blend {blend.name!r}: every input file is empty")
    chat = ChatTokenizer.from_hf(
        tokenizer, storage.join(out_root, "tokenizers", f"{tokenizer_fingerprint(tokenizer)}.json")
    )
    config = plan_config(blend, chat, tokenizer.chat_template or "", settings)
    config_for = shard_config_for(config)
    rh = sh.run_hash(shards, config, config_for)
    root = storage.join(out_root, rh)
    store = storage.join(out_root, "store") if settings.incremental else root
    storage.write_json(
        {"run_hash": rh, "config": config, "shards": [vars(s) for s in shards]},
        storage.join(root, "plan.json"),
    )
    sh.clean_temporaries(root)
    if store != root:
        sh.clean_temporaries(store)
    log(
        f"run {rh}: {len(shards)} shards of <= {settings.rows_per_shard} rows from {len(inputs)} sources, "
        f"{settings.workers} workers"
    )
    with packaging_in_flight(out_root):  # no store clean-up removes a shard this run may still pick up
        report = sh.run_shards(
            shards,
            store,
            config,
            process_sft_shard,
            runtime={"chat_tokenizer": chat, "write_jsonl": settings.write_jsonl},
            workers=settings.workers,
            log=log,
            store=settings.incremental,
            config_for=config_for,
            runner=settings.runner,
        )
        run = finalize_sft(root, rh, report, blend, settings, log, store)
    if settings.incremental:
        clean_store(out_root, settings.keep_snapshots, log)
    return run


def finalize_sft(
    root: str,
    rh: str,
    report: sh.RunReport,
    blend: DataBlend,
    settings: PackagingSettings,
    log: Callable[[str], None],
    store: str | None = None,
) -> SftRun:
    """List each split's shard files in plan order, sum the receipts' counts and write the snapshot's manifest.

    The packed splits are not concatenated: ``<split>.shards.json`` names the shard files (``core/packed_split``),
    which every reader goes through, so a night's cost does not grow with the rows of earlier days.

    ``snapshot.json`` lists the snapshot's shards in order with their receipts (key, outputs with size and SHA-256,
    counts): it names the snapshot's content independently of where the store is, so a snapshot built day by day
    and one built from nothing have the same manifest, byte for byte.
    """
    store = store or root
    stats = {s: PackingStats() for s in SPLITS}
    for receipt in report.receipts:
        for split in SPLITS:
            stats[split].add(PackingStats.from_json(receipt.stats[split]))
    paths = _write_split_manifests(root, rh, report.receipts, store, settings.write_jsonl)
    quarantined = sum(int(r.stats["quarantined"]) for r in report.receipts)
    if quarantined:
        paths["quarantine"] = _gather_quarantine(root, store, report.receipts)
        log(f"{quarantined} bad input rows quarantined in {paths['quarantine']}")
    if settings.incremental:
        paths["manifest"] = storage.join(root, "snapshot.json")
        storage.write_json(
            {"format": SNAPSHOT_FORMAT, "run_hash": rh, "shards": [r.to_json() for r in report.receipts]},
            paths["manifest"],
        )
    run = SftRun(
        rh,
        root,
        paths,
        stats,
        len(report.receipts),
        sum(r.rows for r in report.receipts),
        quarantined,
        report,
        blend,
        sum(int(r.stats.get("held_out", 0)) for r in report.receipts),
    )
    log(f"snapshot {rh}: {len(report.processed)} shards packed now, {len(report.skipped)} reused")
    for split, st in stats.items():
        log(
            f"packed {split}: {st.documents} conversations -> {st.sequences} sequences of {settings.pack_size} "
            f"tokens ({st.efficiency:.2%} efficiency, {st.truncated_documents} truncated, {st.dropped_documents} "
            "dropped as longer than a pack with no answer left)"
        )
    return run


def _write_split_manifests(
    root: str, rh: str, receipts: Sequence[sh.Receipt], store: str, write_jsonl: bool
) -> dict[str, str]:
    """Each split's manifest of its packed shard files in plan order (and of its JSONL shards, ``write_jsonl``),
    the files named relative to the SFT root above the snapshot folder ``root``; ``name -> manifest path``."""
    paths: dict[str, str] = {}
    base = root.rsplit("/", 1)[0]  # the SFT root: holds the snapshot folders and the store
    in_base = store[len(base) + 1 :]  # "store", or "<run_hash>" when the snapshot keeps its shards to itself
    for split in SPLITS:
        paths[split] = packed_split.split_manifest_path(root, split)
        files = []
        for r in receipts:
            rel = f"shards/{r.shard_id}.{split}.parquet"
            out = r.outputs[rel]
            files.append(
                (f"{in_base}/{rel}", int(out["bytes"]), str(out["sha256"]), int(r.stats[split]["sequences"]))
            )
        packed_split.write_split_manifest(paths[split], split, rh, base, files)
        if write_jsonl:
            paths[f"{split}_jsonl"] = packed_split.split_manifest_path(root, f"{split}.jsonl")
            lines = []
            for r in receipts:
                rel = f"shards/{r.shard_id}.{split}.jsonl"
                lines.append(
                    (f"{in_base}/{rel}", int(r.outputs[rel]["bytes"]), str(r.outputs[rel]["sha256"]), None)
                )
            packed_split.write_split_manifest(paths[f"{split}_jsonl"], split, rh, base, lines)
    return paths


def _gather_quarantine(root: str, store: str, receipts: Sequence[sh.Receipt]) -> str:
    """The shards' quarantined rows in one ``quarantine.jsonl`` in the snapshot folder ``root``; its path."""
    path = storage.join(root, "quarantine.jsonl")
    sh.concat_files(
        [storage.join(store, o) for r in receipts for o in r.outputs if o.endswith(".quarantine.jsonl")],
        path,
    )
    return path


def samples_to_jsonl(samples: pd.DataFrame, out_root: str) -> str:
    """Judged samples as chat records in a content-addressed JSONL file (sorted by id: order-independent)."""
    samples = samples.sort_values("sample_id", kind="stable").reset_index(drop=True)
    body = b"".join(
        dumps(
            {
                "sample_id": r.sample_id,
                "day": r.day,
                "messages": conversation(r.system_prompt, r.prompt, r.response),
            }
        )
        for r in samples.itertuples()
    )
    return storage.write_content_addressed(storage.join(out_root, "inputs"), "filtered_samples", body)


@dataclass(frozen=True)
class DayInput:
    """One day's judged samples as a content-addressed JSONL file: the unit that shards (and reuse) follow."""

    days: tuple[str, ...]
    path: str
    rows: int


def day_inputs_from_frame(samples: pd.DataFrame, out_root: str) -> list[DayInput]:
    """One JSONL file per day, in day order (each sorted by id), so that a new day adds files and changes none."""
    out = []
    for day, frame in sorted(samples.groupby(samples["day"].astype(str), sort=False), key=lambda kv: kv[0]):
        out.append(DayInput((day,), samples_to_jsonl(frame, out_root), len(frame)))
    return out


def day_inputs_from_partitions(
    partitions: Sequence[tuple[str, str]],
    out_root: str,
    validate: Callable[[pd.DataFrame, str], None] | None = None,
    to_jsonl: Callable[[pd.DataFrame, str], str] | None = None,
) -> list[DayInput]:
    """The partitions' Parquet files as day JSONL files, one partition in memory at a time.

    A partition's JSONL is remembered under ``inputs/by-parquet/<sha256 of the Parquet bytes>.json``, so a night
    converts only the partitions that are new or changed; the others cost one ``stat`` (their checksum is
    remembered by it, ``core/stat_cache``) or, where the stat cannot vouch for the bytes, one streaming hash.
    ``validate(frame, path)`` checks a partition's frame (the table's schema) before it is used; ``to_jsonl``
    writes a frame as its content-addressed JSONL (default: judged samples as chat records; ``pretrain_dataset.
    documents_to_jsonl`` for ``raw_documents``).
    """
    to_jsonl = to_jsonl or samples_to_jsonl
    out = []
    for partition, path in partitions:
        digest = stat_cache.sha256_file(path)
        pointer = storage.join(out_root, "inputs", "by-parquet", f"{digest}.json")
        if storage.exists(pointer):
            known = storage.read_json(pointer)
            jsonl = storage.join(out_root, "inputs", known["file"])
            if storage.exists(jsonl):
                if known["rows"]:
                    out.append(DayInput(tuple(known["days"]), jsonl, int(known["rows"])))
                continue
        frame = storage.read_parquet(path)
        if validate is not None:
            validate(frame, path)
        days = tuple(sorted(frame["day"].astype(str).unique().tolist())) if len(frame) else (partition,)
        jsonl = to_jsonl(frame, out_root)
        storage.write_json(
            {
                "partition": partition,
                "file": jsonl.rsplit("/", 1)[-1],
                "days": list(days),
                "rows": len(frame),
            },
            pointer,
        )
        if len(frame):
            out.append(DayInput(days, jsonl, len(frame)))
        del frame
    return out


def drop_cross_day_duplicates(
    inputs: Sequence[DayInput],
    out_root: str,
    log: Callable[[str], None] = print,
    field: str = "sample_id",
    table: str = "filtered_samples",
) -> tuple[list[DayInput], int]:
    """``inputs`` with every id that an earlier day also holds left out of the later day (``sample_ids.
    keep_earliest_day``), and how many rows were left out: a repeated document never fails a training."""
    kept = keep_earliest_day([(d.path, d.days) for d in inputs], index_for(out_root), field, table)
    if not kept.dropped:
        return list(inputs), 0
    rows = {d.path: d.rows for d in inputs}  # a copy without the repeated rows is counted again
    out = [DayInput(days, path, rows.get(path) or _count_lines(path)) for path, days in kept.files]
    log(
        f"{kept.dropped} {table} row(s) whose {field} an earlier day also holds were left out of the later "
        f"day ({kept.example}); the earliest day keeps each"
    )
    return out, kept.dropped


def _count_lines(path: str) -> int:
    with storage.open_read(path) as f:
        return sum(1 for _ in f)


def streamed_side_overrides(
    inputs: Sequence[DayInput], fraction: float, seed: int, eval_fraction: float
) -> dict[str, str]:
    """``packing.side_overrides`` of every trainable id, reading one day at a time and stopping as soon as both
    sides have a sample (usually within the first day): memory and time do not grow with the history."""
    validation = train = 0
    lowest: tuple[float, str] | None = None
    highest: tuple[float, str] | None = None
    distinct: set[str] = set()
    for day in inputs:
        with storage.open_read(day.path) as f:
            for line in f:
                sid = str(json.loads(line)["sample_id"])
                if is_held_out(sid, eval_fraction):
                    continue
                h = (split_hash(sid, seed), sid)
                lowest = h if lowest is None or h < lowest else lowest
                highest = h if highest is None or h > highest else highest
                if len(distinct) < 2:
                    distinct.add(sid)
                if h[0] < fraction:
                    validation += 1
                else:
                    train += 1
        if validation and train:
            return {}
    if len(distinct) < 2 or lowest is None or highest is None:
        return {}
    return {lowest[1]: "validation"} if validation == 0 else {highest[1]: "train"}


def default_blend() -> DataBlend:
    return JUDGED_SAMPLES_BLEND


def build_sft_dataset(
    samples: pd.DataFrame, tokenizer: Any, tokenizer_path: str, out_root: str, *args: Any, **kwargs: Any
) -> tuple[SFTDataset, dict[str, PackingStats]]:
    """``build_sft_dataset_from_days`` for samples already in memory (tests, small tools): the frame written as one
    JSONL file per day (``day_inputs_from_frame``), every other argument passed on as it is."""
    if samples.empty:
        raise ValueError(
            "no filtered samples to package: every sample was rejected, or no day was materialized"
        )
    return build_sft_dataset_from_days(
        day_inputs_from_frame(samples, out_root), tokenizer, tokenizer_path, out_root, *args, **kwargs
    )


def build_sft_dataset_from_days(
    inputs: Sequence[DayInput],
    tokenizer: Any,
    tokenizer_path: str,
    out_root: str,
    pack_size: int,
    validation_fraction: float,
    seed: int = 0,
    log: Callable[[str], None] = print,
    blend: DataBlend | None = None,
    on_error: OnError = "raise",
    rows_per_shard: int = 5000,
    workers: int = 1,
    eval_fraction: float = 0.0,
    incremental: bool = True,
    runner: sh.ShardRunner | None = None,
    keep_snapshots: int = 0,
    assets: dict[str, list[str]] | None = None,
) -> tuple[SFTDataset, dict[str, PackingStats]]:
    """Package the judged samples (plus whatever else the blend names) and return the ``SFTDataset`` artifact.

    The samples come as one JSONL file per day (``day_inputs_from_partitions``), in day order: shards never span
    two days, so with the shard store a new day adds shards and reuses every earlier one. Records whose id is on
    the eval set's held-out side (``eval_fraction``, see ``core.eval_set``) enter neither split, whatever source
    they come from; the train/validation split is a hash of each id, so both are per row and compose with days.
    ``runner`` runs the shards to pack on a cluster (a Slurm array...) instead of ``workers`` local processes.
    ``assets`` gives the files of the blend's other ``asset:`` sources (``checkable_tasks``)."""
    if not inputs:
        raise ValueError(
            "no filtered samples to package: every sample was rejected, or no day was materialized"
        )
    # the schema is checked a day at a time: an id on two days is found here, by an on-disk index of every day,
    # and kept on the earliest day only (two days processed at once both keep a repeated document upstream)
    inputs, cross_day = drop_cross_day_duplicates(inputs, out_root, log)
    blend = blend or default_blend()
    settings = PackagingSettings(
        pack_size,
        validation_fraction,
        seed,
        on_error,
        rows_per_shard,
        workers,
        side_overrides=_both_splits_overrides(inputs, blend, validation_fraction, seed, eval_fraction),
        eval_fraction=eval_fraction,
        incremental=incremental,
        runner=runner,
        keep_snapshots=keep_snapshots,
    )
    run = package_sft(
        blend,
        tokenizer,
        out_root,
        settings,
        assets={**(assets or {}), "filtered_samples": [d.path for d in inputs]},
        log=log,
    )
    check_both_splits(run, pack_size)
    artifact = sft_artifact(run, inputs, tokenizer_path, pack_size, cross_day)
    storage.write_json(artifact.model_dump(), storage.join(run.root, "dataset.json"))
    return artifact, run.stats


def _both_splits_overrides(
    inputs: Sequence[DayInput], blend: DataBlend, validation_fraction: float, seed: int, eval_fraction: float
) -> dict[str, str]:
    """A small dataset must still get both splits: the sample to move when the hash split left one empty
    (``streamed_side_overrides``). Only where the blend keys the judged samples by ``sample_id``, which is how the
    shards identify them unless the blend says otherwise; else none."""
    keyed_by_sample_id = any(
        s.path == "asset:filtered_samples" and s.id_field == "sample_id" for s in blend.sources
    )
    if not keyed_by_sample_id:
        return {}
    return streamed_side_overrides(inputs, validation_fraction, seed, eval_fraction)


def check_both_splits(run: SftRun, pack_size: int) -> None:
    """A packed dataset has a train and a validation sequence, or the error says why not."""
    for split in SPLITS:
        if run.stats[split].sequences == 0:
            if sum(s.documents for s in run.stats.values()) < 2:
                raise ValueError(
                    f"need at least 2 samples for a train/validation split, got {run.rows_read} rows"
                )
            raise ValueError(
                f"{split}: no packed sequence (no {split} sample, or every conversation is longer "
                f"than pack_size={pack_size} with no answer left); raise pack_size or add data"
            )


def sft_artifact(
    run: SftRun, inputs: Sequence[DayInput], tokenizer_path: str, pack_size: int, cross_day: int
) -> SFTDataset:
    """The ``SFTDataset`` a finished packaging run describes."""
    real = sum(s.real_tokens for s in run.stats.values())
    return SFTDataset(
        run_hash=run.run_hash,
        root=run.root,
        train_path=run.paths["train"],
        validation_path=run.paths["validation"],
        train_jsonl_path=run.paths["train_jsonl"],
        validation_jsonl_path=run.paths["validation_jsonl"],
        num_samples=run.rows_read - run.quarantined_rows - run.held_out_rows,
        held_out_samples=run.held_out_rows,
        num_train_sequences=run.stats["train"].sequences,
        num_validation_sequences=run.stats["validation"].sequences,
        num_real_tokens=real,
        num_loss_tokens=sum(s.loss_tokens for s in run.stats.values()),
        pack_size=pack_size,
        packing_efficiency=run.packing_efficiency,
        days=sorted({day for d in inputs for day in d.days}),
        tokenizer_path=os.fspath(tokenizer_path),
        blend=run.blend.name,
        blend_fingerprint=run.blend.fingerprint(),
        num_shards=run.num_shards,
        shards_reused=len(run.report.skipped),
        quarantined_rows=run.quarantined_rows,
        quarantine_path=run.paths.get("quarantine"),
        cross_day_duplicates_dropped=cross_day,
    )
