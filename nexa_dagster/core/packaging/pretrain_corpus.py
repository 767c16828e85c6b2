"""Pretraining data: blend -> shard plan -> tokenized Megatron ``.bin``/``.idx`` per shard, resumable.

Each shard becomes one indexed-dataset prefix (``shards/<id>``; one document = one sequence, ending with the EOS
token so that documents stay apart when Megatron concatenates them into samples). ``megatron_blend.json`` lists
the prefixes with their token counts as weights, the ``--data-path`` form Megatron's ``BlendedMegatronDataset``
takes, so the whole corpus trains in its natural proportions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import pyarrow

from nexa_dagster.core.common import storage
from nexa_dagster.core.common.artifacts import Artifact
from nexa_dagster.core.common.jsonl import (
    OnError,
    RecordError,
    dumps,
)
from nexa_dagster.core.data.splits import is_held_out
from nexa_dagster.core.packaging import shards as sh
from nexa_dagster.core.packaging.blend import DataBlend
from nexa_dagster.core.packaging.decontaminate import DecontaminationReport, document_texts, rows_of
from nexa_dagster.core.packaging.formats.indexed_dataset import (
    IndexedDatasetWriter,
    best_fitting_dtype,
    document_id,
)
from nexa_dagster.core.packaging.packing import ChatTokenizer, tokenizer_fingerprint
from nexa_dagster.core.packaging.shard_rows import source_of, transformed_rows

FORMAT = "megatron-bin-idx/1"
ENCODE_BATCH = 1024


@dataclass(frozen=True)
class PretrainSettings:
    text_field: str = "text"
    append_eos: bool = True
    on_error: OnError = "raise"
    rows_per_shard: int = 20000
    workers: int = 1
    runner: sh.ShardRunner | None = field(
        default=None, compare=False
    )  # None: local processes; else a cluster
    incremental: bool = (
        True  # shards in the content-addressed store <out_root>/store, reused by later corpora
    )


@dataclass
class PretrainRun:
    run_hash: str
    root: str
    prefixes: list[str]
    blend_path: str
    num_documents: int
    num_tokens: int
    quarantined_rows: int
    report: sh.RunReport


class PretrainCorpus(Artifact):
    """A tokenized pretraining corpus: Megatron bin/idx prefixes and the ``--data-path`` blend that lists them."""

    run_hash: str
    root: str
    megatron_blend_path: str
    prefixes: list[str]
    num_documents: int
    num_tokens: int
    blend: str
    blend_fingerprint: str
    quarantined_rows: int = 0
    cross_day_duplicates_dropped: int = (
        0  # documents an earlier day also holds: kept on the earliest day only
    )


def process_pretrain_shard(task: sh.ShardTask) -> sh.Receipt:
    """Tokenize one shard's texts into ``shards/<id>.bin``/``.idx`` (worker side)."""
    cfg = task.config
    source = source_of(task)
    chat: ChatTokenizer = task.runtime["chat_tokenizer"]
    field = cfg["text_field"]
    eos = [chat.eos_id] if cfg["append_eos"] and chat.eos_id is not None else []
    prefix_rel = f"shards/{task.out_id}"
    bad: list[bytes] = []
    rows = 0
    batch: list[str] = []

    def has_text(out: dict[str, Any]) -> None:
        if not isinstance(out.get(field), str):
            raise RecordError("missing or not a string" if field in out else "missing", field=field)

    with IndexedDatasetWriter(
        storage.join(task.root, prefix_rel), best_fitting_dtype(chat.vocab_size)
    ) as writer:

        def flush() -> None:
            for ids in chat.encode_texts(batch):
                writer.add_document(np.asarray(ids + eos, dtype=writer.dtype))
            batch.clear()

        for item, out in transformed_rows(task, bad, validate=has_text):
            rows += 1
            sid = str(item.get(source.id_field or "", "")) or hashlib.sha256(out[field].encode()).hexdigest()
            batch.extend([out[field]] * source.copies(sid, cfg["seed"]))
            if len(batch) >= ENCODE_BATCH:
                flush()
        flush()
    rows += len(bad)
    outputs = [f"{prefix_rel}.bin", f"{prefix_rel}.idx"]
    if bad:
        with storage.atomic_writer(storage.join(task.root, f"{prefix_rel}.quarantine.jsonl")) as q:
            q.write(b"".join(bad))
        outputs.append(f"{prefix_rel}.quarantine.jsonl")
    return sh.Receipt(
        task.out_id,
        task.key,
        rows,
        {o: sh.output_entry(task.root, o) for o in outputs},
        {"documents": writer.num_documents, "tokens": writer.num_tokens, "quarantined": len(bad)},
    )


def package_pretrain(
    blend: DataBlend,
    tokenizer: Any,
    out_root: str,
    settings: PretrainSettings,
    assets: dict[str, str | list[str]] | None = None,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> PretrainRun:
    """Plan, run (resuming) and finalize a bin/idx corpus under ``<out_root>/<run_hash>/``.

    With ``settings.incremental`` (the default) the shards live in the content-addressed store
    ``<out_root>/store/shards/<shard key>.{bin,idx}`` like ``sft_dataset``'s: given one documents file per day
    (``day_inputs_from_partitions``), shards never span two days and the corpus after day N+1 tokenizes only day
    N+1; ``megatron_blend.json`` lists the store's prefixes in plan order, the same list a build from nothing gives.
    """
    inputs = blend.resolve(assets)
    shards = sh.plan_shards([(s.name, files) for s, files in inputs], settings.rows_per_shard)
    if not shards:
        raise ValueError(f"blend {blend.name!r}: every input file is empty")
    fp = tokenizer_fingerprint(tokenizer)
    chat = ChatTokenizer.from_hf(tokenizer, storage.join(out_root, "tokenizers", f"{fp}.json"))
    config = _plan_config(blend, fp, chat, settings, seed)
    rh = sh.run_hash(shards, config)
    root = storage.join(out_root, rh)
    storage.write_json(
        {"run_hash": rh, "config": config, "shards": [vars(s) for s in shards]},
        storage.join(root, "plan.json"),
    )
    store = storage.join(out_root, "store") if settings.incremental else root
    sh.clean_temporaries(root)
    if store != root:
        sh.clean_temporaries(store)
    report = sh.run_shards(
        shards,
        store,
        config,
        process_pretrain_shard,
        runtime={"chat_tokenizer": chat},
        workers=settings.workers,
        log=log,
        runner=settings.runner,
        store=settings.incremental,
    )
    prefixes = [storage.join(store, f"shards/{r.shard_id}") for r in report.receipts]
    tokens = [int(r.stats["tokens"]) for r in report.receipts]
    blend_path = _write_megatron_blend(root, rh, blend.name, prefixes, tokens)
    documents = sum(int(r.stats["documents"]) for r in report.receipts)
    quarantined = sum(int(r.stats["quarantined"]) for r in report.receipts)
    log(
        f"pretraining corpus {rh}: {documents} documents, "
        f"{sum(tokens)} tokens in {len(prefixes)} bin/idx shards ({len(report.processed)} tokenized now, "
        f"{len(report.skipped)} reused; {quarantined} rows quarantined)"
    )
    return PretrainRun(rh, root, prefixes, blend_path, documents, sum(tokens), quarantined, report)


def _plan_config(
    blend: DataBlend, fingerprint: str, chat: ChatTokenizer, settings: PretrainSettings, seed: int
) -> dict[str, Any]:
    """Everything the corpus's bytes depend on besides the input bytes (hashed into the run hash)."""
    return {
        "format": FORMAT,
        **blend.plan_fields(),
        "tokenizer": fingerprint,
        "eos_id": chat.eos_id,
        "text_field": settings.text_field,
        "append_eos": settings.append_eos,
        "on_error": settings.on_error,
        "rows_per_shard": settings.rows_per_shard,
        "seed": seed,
        "numpy": np.__version__,
        "pyarrow": pyarrow.__version__,
    }


def _write_megatron_blend(root: str, rh: str, blend: str, prefixes: list[str], tokens: list[int]) -> str:
    """``megatron_blend.json``: Megatron's ``--data-path`` list, each non-empty prefix weighted by its tokens; its
    path."""
    data_paths: list[Any] = []
    for n, prefix in zip(tokens, prefixes, strict=True):
        if n:
            data_paths += [n, prefix]
    blend_path = storage.join(root, "megatron_blend.json")
    storage.write_json({"data_paths": data_paths, "run_hash": rh, "blend": blend}, blend_path)
    return blend_path


def documents_to_jsonl(documents: pd.DataFrame, out_root: str) -> str:
    """Ingested documents as ``{doc_id, day, title, text}`` JSONL, content-addressed and in doc-id order (one day's
    partition per file for an incremental corpus: ``sft_dataset.day_inputs_from_partitions(to_jsonl=...)``)."""
    documents = documents.sort_values("doc_id", kind="stable").drop_duplicates("doc_id")
    body = b"".join(
        dumps({"doc_id": r.doc_id, "day": r.day, "title": r.title, "text": r.text})
        for r in documents.itertuples()
    )
    return storage.write_content_addressed(storage.join(out_root, "inputs"), "raw_documents", body)


def corpus_document_ids(
    texts: Sequence[str], tokenizer: Any, out_root: str, append_eos: bool = True
) -> list[str]:
    """The ids a corpus gives these texts (``document_id`` of their tokens, as ``process_pretrain_shard`` writes
    them): how training finds, by content, the documents it must leave out."""
    fp = tokenizer_fingerprint(tokenizer)
    chat = ChatTokenizer.from_hf(tokenizer, storage.join(out_root, "tokenizers", f"{fp}.json"))
    eos = [chat.eos_id] if append_eos and chat.eos_id is not None else []
    return [document_id(np.asarray(ids + eos, dtype=np.int64)) for ids in chat.encode_texts(list(texts))]


def documents_holding_protected_text(
    report: DecontaminationReport, tokenizer: Any, out_root: str
) -> dict[str, set[int]]:
    """The corpus documents a ``report``-mode check found holding protected text, by the id a corpus gives them (how
    a training leaves them out, ``corpus_document_ids``), each with the protected items it holds."""
    found: dict[str, set[int]] = {}
    for path, by_row in report.items_by_row.items():
        rows = sorted(by_row)
        texts = [document_texts(record)[0] for record in rows_of(path, rows)]
        for row, doc in zip(rows, corpus_document_ids(texts, tokenizer, out_root), strict=True):
            found.setdefault(doc, set()).update(by_row[row])
    return found


def items_trained_on(
    report: DecontaminationReport,
    tokenizer: Any,
    out_root: str,
    left_out: frozenset[str],
    eval_fraction: float,
) -> set[int]:
    """The protected items held by the corpus documents a base model trained on: those a ``report``-mode check
    found, less the documents the base never saw (``left_out``: the contaminated ones it excluded, and those on the
    frozen eval set's side, ``eval_fraction``). A base trained before an eval set was frozen holds its text; one
    trained after, with ``on_overlap: remove``, holds none."""
    found = documents_holding_protected_text(report, tokenizer, out_root)
    return {
        item
        for doc, items in found.items()
        if doc not in left_out and not is_held_out(doc, eval_fraction)
        for item in items
    }
