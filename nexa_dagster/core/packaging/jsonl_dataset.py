"""JSONL datasets (SFT/RL records): blend -> shard plan -> transformed JSONL per shard -> one JSONL, resumable.

No tokenization: each source's transform (``sft``, ``openai_chat``, ``sharegpt``, ``passthrough``, ``select``,
``rename`` or a chain of them) turns its rows into the output records, which is what RL trainers and SFT trainers
that tokenize themselves consume.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from nexa_dagster.core.common import storage
from nexa_dagster.core.common.artifacts import Artifact
from nexa_dagster.core.common.jsonl import (
    OnError,
    dumps,
)
from nexa_dagster.core.data.splits import held_out_mask
from nexa_dagster.core.packaging import shards as sh
from nexa_dagster.core.packaging.blend import DataBlend
from nexa_dagster.core.packaging.shard_rows import source_of, transformed_rows

FORMAT = "jsonl/1"


@dataclass
class JsonlRun:
    run_hash: str
    root: str
    path: str
    records: int
    quarantined_rows: int
    quarantine_path: str | None
    report: sh.RunReport


class JsonlDataset(Artifact):
    """A JSONL dataset (one record per line) and the blend it came from."""

    run_hash: str
    path: str
    records: int
    blend: str
    blend_fingerprint: str
    quarantined_rows: int = 0
    quarantine_path: str | None = None


def process_jsonl_shard(task: sh.ShardTask) -> sh.Receipt:
    """Transform one shard's rows into ``shards/<id>.jsonl`` (worker side)."""
    shard, cfg = task.shard, task.config
    source = source_of(task)
    good: list[bytes] = []
    bad: list[bytes] = []
    rows = 0
    for item, out in transformed_rows(task, bad):
        rows += 1
        rid = str(item.get(source.id_field or "", "")) or hashlib.sha256(dumps(out)).hexdigest()
        good.extend([dumps(out)] * source.copies(rid, cfg["seed"]))
    rows += len(bad)
    outputs = [f"shards/{shard.shard_id}.jsonl"]
    with storage.atomic_writer(storage.join(task.root, outputs[0])) as o:
        o.write(b"".join(good))
    if bad:
        outputs.append(f"shards/{shard.shard_id}.quarantine.jsonl")
        with storage.atomic_writer(storage.join(task.root, outputs[1])) as q:
            q.write(b"".join(bad))
    return sh.Receipt(
        shard.shard_id,
        task.key,
        rows,
        {p: sh.output_entry(task.root, p) for p in outputs},
        {"records": len(good), "quarantined": len(bad)},
    )


def package_jsonl(
    blend: DataBlend,
    out_root: str,
    name: str,
    assets: dict[str, str | list[str]] | None = None,
    on_error: OnError = "raise",
    rows_per_shard: int = 20000,
    workers: int = 1,
    seed: int = 0,
    log: Callable[[str], None] = print,
    runner: sh.ShardRunner | None = None,
) -> JsonlRun:
    """Write ``<out_root>/<run_hash>/<name>.jsonl`` from the blend's sources through their transforms (the shards
    on ``runner``, a cluster, when given)."""
    inputs = blend.resolve(assets)
    shards = sh.plan_shards([(s.name, files) for s, files in inputs], rows_per_shard)
    config: dict[str, Any] = {
        "format": FORMAT,
        "blend": blend.name,
        "blend_fingerprint": blend.fingerprint(),
        "sources": {s.name: s.model_dump() for s in blend.sources},
        "on_error": on_error,
        "rows_per_shard": rows_per_shard,
        "seed": seed,
        "name": name,
    }
    rh = sh.run_hash(shards, config)
    root = storage.join(out_root, rh)
    storage.write_json(
        {"run_hash": rh, "config": config, "shards": [vars(s) for s in shards]},
        storage.join(root, "plan.json"),
    )
    sh.clean_temporaries(root)
    report = sh.run_shards(shards, root, config, process_jsonl_shard, workers=workers, log=log, runner=runner)
    path = storage.join(root, f"{name}.jsonl")
    sh.concat_files([storage.join(root, f"shards/{r.shard_id}.jsonl") for r in report.receipts], path)
    quarantined = sum(int(r.stats["quarantined"]) for r in report.receipts)
    qpath = None
    if quarantined:
        qpath = storage.join(root, "quarantine.jsonl")
        sh.concat_files(
            [
                storage.join(root, o)
                for r in report.receipts
                for o in r.outputs
                if o.endswith(".quarantine.jsonl")
            ],
            qpath,
        )
    records = sum(int(r.stats["records"]) for r in report.receipts)
    log(
        f"{name}: {records} records from {sum(r.rows for r in report.receipts)} rows ({quarantined} quarantined)"
    )
    return JsonlRun(rh, root, path, records, quarantined, qpath, report)


def partitions_to_flat_jsonl(
    partitions: Sequence[tuple[str, str]],
    out_root: str,
    eval_fraction: float,
    validate: Callable[[pd.DataFrame, str], None] | None = None,
) -> list[str]:
    """One flat JSONL file per partition (day order), reading one partition's Parquet at a time, without the ids
    on the frozen eval set's side (never trained on): memory holds a day, not the history."""
    files = []
    for _, path in partitions:
        frame = storage.read_parquet(path)
        if validate is not None:
            validate(frame, path)
        frame = frame[[not h for h in held_out_mask(frame["sample_id"].astype(str).tolist(), eval_fraction)]]
        if len(frame):
            files.append(samples_to_flat_jsonl(frame, out_root))
        del frame
    return files


def samples_to_flat_jsonl(samples: pd.DataFrame, out_root: str) -> str:
    """Judged samples as flat records (sample_id, day, system_prompt, prompt, response, judge_score)."""
    cols = [
        c for c in ("sample_id", "day", "system_prompt", "prompt", "response", "judge_score") if c in samples
    ]
    samples = samples.sort_values("sample_id", kind="stable")[cols]
    body = b"".join(dumps({c: getattr(r, c) for c in cols}) for r in samples.itertuples())
    return storage.write_content_addressed(storage.join(out_root, "inputs"), "filtered_samples_flat", body)
