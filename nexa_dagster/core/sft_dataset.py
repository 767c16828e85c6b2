"""Build the packaged SFT dataset from judged samples: split, tokenize, pack, write Parquet and JSONL."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pandas as pd

from nexa_dagster.core import storage
from nexa_dagster.core.artifacts import SFTDataset
from nexa_dagster.core.packing import (
    PackingStats,
    TokenizedConversation,
    conversation,
    pack,
    run_hash,
    split_train_validation,
    tokenize_conversation,
    tokenizer_fingerprint,
)
from nexa_dagster.core.schemas import PackedSequences


def _chat_rows(samples: pd.DataFrame) -> list[dict[str, Any]]:
    return [{"sample_id": r.sample_id,
             "messages": conversation(r.system_prompt, r.prompt, r.response)} for r in samples.itertuples()]


def build_sft_dataset(samples: pd.DataFrame, tokenizer: Any, tokenizer_path: str, out_root: str, pack_size: int,
                      validation_fraction: float, seed: int = 0,
                      log: Callable[[str], None] = print) -> tuple[SFTDataset, dict[str, PackingStats]]:
    """Write ``<out_root>/<run_hash>/{train,validation}.{parquet,jsonl}`` and return the artifact.

    The output folder is named by the run hash, so re-packaging the same inputs is a no-op rewrite of identical
    bytes and a changed input never overwrites an earlier dataset that a checkpoint may still point at.
    """
    if samples.empty:
        raise ValueError("no filtered samples to package: every sample was rejected, or no day was materialized")
    samples = samples.sort_values("sample_id").reset_index(drop=True)
    rh = run_hash(samples["sample_id"].tolist(), tokenizer_fingerprint(tokenizer), tokenizer.chat_template or "",
                  pack_size, seed)
    root = storage.join(out_root, rh)
    train_idx, val_idx = split_train_validation(samples["sample_id"].tolist(), validation_fraction, seed)
    if not train_idx or not val_idx:
        raise ValueError(f"need at least 2 filtered samples for a train/validation split, got {len(samples)}")
    stats: dict[str, PackingStats] = {}
    paths: dict[str, str] = {}
    for split, idx in (("train", train_idx), ("validation", val_idx)):
        part = samples.iloc[idx]
        tokenized = []
        for row in part.itertuples():
            ids, mask = tokenize_conversation(tokenizer, conversation(row.system_prompt, row.prompt, row.response))
            tokenized.append(TokenizedConversation(row.sample_id, ids, mask))
        packed, st = pack(tokenized, pack_size, tokenizer.pad_token_id)
        PackedSequences.validate(packed)
        stats[split] = st
        paths[split] = storage.join(root, f"{split}.parquet")
        paths[f"{split}_jsonl"] = storage.join(root, f"{split}.jsonl")
        storage.write_parquet(packed, paths[split])
        storage.write_jsonl(_chat_rows(part), paths[f"{split}_jsonl"])
        log(f"packed {split}: {st.documents} conversations -> {st.sequences} sequences of {pack_size} tokens "
            f"({st.efficiency:.1%} efficiency, {st.truncated_documents} truncated, {st.dropped_documents} dropped "
            "as longer than a pack with no answer left)")
        if st.sequences == 0:
            raise ValueError(f"{split}: every conversation is longer than pack_size={pack_size}; raise pack_size")
    real = sum(s.real_tokens for s in stats.values())
    slots = sum(s.slots for s in stats.values())
    artifact = SFTDataset(
        run_hash=rh, root=root, train_path=paths["train"], validation_path=paths["validation"],
        train_jsonl_path=paths["train_jsonl"], validation_jsonl_path=paths["validation_jsonl"],
        num_samples=len(samples), num_train_sequences=stats["train"].sequences,
        num_validation_sequences=stats["validation"].sequences, num_real_tokens=real,
        num_loss_tokens=sum(s.loss_tokens for s in stats.values()), pack_size=pack_size,
        packing_efficiency=real / slots, days=sorted(samples["day"].unique().tolist()),
        tokenizer_path=os.fspath(tokenizer_path),
    )
    storage.write_json(artifact.model_dump(), storage.join(root, "dataset.json"))
    return artifact, stats
