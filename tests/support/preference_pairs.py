"""Preference pairs in the packaging stage's format (``packed-preference-parquet/1``) and DPO training jobs on them:
what the preference training tests and ``bench/preference.py`` train with.

Conversational pairs are tokenized as TRL's ``DPOTrainer`` does: the prompt with the generation prompt, prompt +
chosen and prompt + rejected without it, the completion starting where the tokenized prompt stops being a prefix
of both (the oracle test checks the result against TRL's own tokenization).
"""

from __future__ import annotations

import random
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from nexa_dagster.core.common import storage
from nexa_dagster.core.common.config import TrainingSettings, load_deepspeed_config
from nexa_dagster.core.packaging.formats.packed_split import split_manifest_path, write_split_manifest
from nexa_dagster.core.training.job import TrainingJob

PAIRS_SCHEMA = pa.schema(
    [
        ("pair_id", pa.string()),
        ("prompt_input_ids", pa.list_(pa.int32())),
        ("chosen_input_ids", pa.list_(pa.int32())),
        ("rejected_input_ids", pa.list_(pa.int32())),
        ("day", pa.string()),
    ]
)


def conversational_pairs(n: int, seed: int = 0, offset: int = 0) -> list[dict[str, Any]]:
    """``n`` TRL conversational pairs from the CPython docs: a question, a coherent chosen answer (a passage of the
    docs) and a rejected one with the same words shuffled (so chosen is systematically better); some prompts have
    a system turn, answer lengths vary. ``offset`` picks other passages (held-out pairs)."""
    rng = random.Random(seed)
    passages = [
        p.split()
        for key in sorted(topics)
        for p in topics[key].split("\n\n")
        if len(p.split()) >= 14 and p.isascii()
    ]
    rows = []
    for i in range(n):
        words = passages[(offset + i) % len(passages)]
        answer = words[: 6 + (i % 5) * 2]
        shuffled = answer[:]
        while shuffled == answer:
            rng.shuffle(shuffled)
        prompt = [{"role": "user", "content": f"Continue: {' '.join(words[-(3 + i % 4) :])}"}]
        if i % 3 == 1:
            prompt = [{"role": "system", "content": "Answer briefly."}, *prompt]
        rows.append(
            {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": " ".join(answer)}],
                "rejected": [{"role": "assistant", "content": " ".join(shuffled)}],
            }
        )
    return rows


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def tokenize_pair(tokenizer: Any, row: dict[str, Any]) -> dict[str, list[int]]:
    """TRL 1.16's split of a conversational pair into prompt, chosen and rejected token ids."""

    def ids(messages: list[dict[str, str]], generation: bool) -> list[int]:
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, add_generation_prompt=generation
        )
        return list(out["input_ids"])

    prompt = ids(row["prompt"], True)
    chosen = ids(row["prompt"] + row["chosen"], False)
    rejected = ids(row["prompt"] + row["rejected"], False)
    n = min(_common_prefix(prompt, chosen), _common_prefix(prompt, rejected))
    return {
        "prompt_input_ids": prompt[:n],
        "chosen_input_ids": chosen[n:],
        "rejected_input_ids": rejected[n:],
    }


def pair_records(
    tokenizer: Any, rows: list[dict[str, Any]], prefix: str, day: str = "2025-01-01"
) -> list[dict[str, Any]]:
    return [
        {"pair_id": f"{prefix}-{i:04d}", **tokenize_pair(tokenizer, r), "day": day}
        for i, r in enumerate(rows)
    ]


def write_split(root: Path, run_hash: str, split: str, records: list[dict[str, Any]], shards: int = 2) -> str:
    """``records`` as ``shards`` Parquet shard files under ``root/store`` listed by ``root/<run_hash>/<split>.shards.json``
    (the layout of a packaging snapshot); returns the manifest's path."""
    table = pa.Table.from_pylist(records, schema=PAIRS_SCHEMA)
    files, start = [], 0
    per = -(-len(records) // shards)
    for k in range(shards):
        part = table.slice(start, per)
        start += per
        if part.num_rows == 0:
            continue
        shard = root / "store" / "shards" / f"{run_hash}-{k}.{split}.parquet"
        shard.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(part, shard)
        rel = f"store/shards/{shard.name}"
        files.append((rel, shard.stat().st_size, storage.sha256_file(str(shard)), part.num_rows))
    manifest = split_manifest_path(str(root / run_hash), split)
    write_split_manifest(manifest, split, run_hash, str(root), files)
    return manifest


def write_snapshot(
    root: Path,
    train: list[dict[str, Any]],
    validation: list[dict[str, Any]],
    run_hash: str = "prefs0001",
) -> tuple[str, str]:
    """A preference snapshot (train and validation manifests) of token records; returns both manifest paths."""
    return write_split(root, run_hash, "train", train), write_split(
        root, run_hash, "validation", validation, 1
    )


def preference_job(
    tmp_path: Path,
    init_from: Path,
    train_path: str,
    validation_path: str,
    steps: int,
    micro_batch: int = 2,
    lr: float = 1e-3,
    log_every: int = 1,
    run_id: str = "dpo-run",
    num_procs: int = 1,
    dataset_run_hash: str = "prefs0001",
    **overrides: Any,
) -> TrainingJob:
    """A DPO job on the tiny model ``init_from`` (also its tokenizer and, by default, its reference)."""
    settings = {
        "max_steps": steps,
        "micro_batch_size": micro_batch,
        "gradient_accumulation_steps": 1,
        "learning_rate": lr,
        "warmup_steps": 1,
        "weight_decay": 0.0,
        "grad_clip": 1.0,
        "log_every": log_every,
        "seed": 0,
        "num_procs": num_procs,
    }
    job_fields = {k: overrides.pop(k) for k in list(overrides) if k in TrainingJob.model_fields}
    return TrainingJob(
        run_id=run_id,
        train_path=train_path,
        validation_path=validation_path,
        tokenizer_path=str(init_from),
        model_preset="tiny",
        deepspeed_config=load_deepspeed_config("zero1_cpu.json"),
        settings=TrainingSettings(**{**settings, **overrides}),
        output_dir=str(tmp_path / "checkpoints" / run_id),
        dataset_run_hash=dataset_run_hash,
        accelerator="cpu",
        data_kind="preference",
        init_from=str(init_from),
        parent=f"path:{init_from}",
        **job_fields,
    )


def judged_pairs(day: str, n: int, eval_fraction: float, start: int = 0) -> Any:
    """``n`` pairs of ``day`` as ``preference_pairs`` writes them (``core.distill.pairs.PAIR_COLUMNS``), their
    prompts all on the training side of the eval split at ``eval_fraction``."""
    import pandas as pd

    from nexa_dagster.core.data.splits import is_held_out
    from nexa_dagster.core.distill.pairs import PAIR_COLUMNS, pair_id

    rows, i = [], start
    while len(rows) < n:
        sample_id = f"{day}-s{i}"
        i += 1
        if is_held_out(sample_id, eval_fraction):
            continue
        chosen = f"A list keeps its items in order; answer {i} appends with list.append(x)."
        rejected = f"no idea {i}"
        rows.append(
            {
                "pair_id": pair_id(sample_id, chosen, rejected),
                "sample_id": sample_id,
                "day": day,
                "prompt": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": f"Question {i}?"},
                ],
                "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": rejected}],
                "chosen_score": 8.0,
                "rejected_score": 2.0,
                "score_gap": 6.0,
                "chosen_source": "teacher",
                "rejected_source": "policy:0",
                "chosen_length": len(chosen),
                "rejected_length": len(rejected),
                "judge_model": "judge",
                "policy_model": "policy",
            }
        )
    return pd.DataFrame(rows, columns=PAIR_COLUMNS)
