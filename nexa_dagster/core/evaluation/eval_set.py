"""The frozen evaluation set: held-out samples that no training split ever contains, versioned on disk.

A sample is on the *eval side* when its id hashes below ``fraction`` (``is_held_out``: a salt of its own, independent
of the training seed and of the version, so a sample once held out is held out forever and packaging can exclude it
without knowing which version exists). ``freeze_eval_set`` writes version ``v<N>`` once, from the held-out samples
known at that time, under ``<root>/v<N>/``::

    samples.jsonl      {"sample_id", "day", "messages"} per example, sorted by sample_id
    examples.parquet   sample_id, input_ids, loss_mask (the student's chat template, assistant-only mask)
    corpus.parquet     the base models' eval set: the pretraining corpus's documents on the eval side
                       (``sample_id`` is the document id, ``core.packaging.formats.indexed_dataset.document_id``), their token ids
                       as ``pretrain_corpus`` holds them, loss on every token, sorted by id
    manifest.json      version, counts, tokenizer fingerprint, SHA-256 of every file

and never rewrites it: later materializations of the same version return it unchanged (a new version is made only
when the configuration asks for one), and ``load_eval_set`` checks the files' hashes, so every checkpoint scored
against ``v<N>`` is scored on exactly the same tokens. A corpus document is on the eval side by the same rule
(``is_held_out`` of its id below ``corpus_fraction``), and pretraining drops those documents before it splits a
corpus (``core.training.corpus.load_corpus``): no base model, whatever corpus it trains on, trains on them.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

import pandas as pd
import pyarrow as pa

from nexa_dagster.core.common import storage
from nexa_dagster.core.common.jsonl import dumps
from nexa_dagster.core.data.splits import held_out_mask, is_held_out
from nexa_dagster.core.packaging.formats.indexed_dataset import corpus_prefixes, document_id, read_documents
from nexa_dagster.core.packaging.packing import ChatTokenizer, conversation, tokenizer_fingerprint

FORMAT = "nexa-eval-set/1"


def version_dir(root: str, version: int) -> str:
    return storage.join(root, f"v{version}")


def corpus_documents(corpus_root: str, fraction: float, max_tokens: int) -> tuple[pd.DataFrame, int]:
    """(the corpus's documents on the eval side as sample_id/input_ids/loss_mask rows sorted by id, how many were
    cut to ``max_tokens``): one row per distinct document, every token scored but the first."""
    held: dict[str, list[int]] = {}
    for tokens in read_documents(corpus_prefixes(corpus_root)):
        doc_id = document_id(tokens)
        if is_held_out(doc_id, fraction) and len(tokens) > 1:
            held[doc_id] = tokens.tolist()
    ids = sorted(held)
    cut = sum(len(held[i]) > max_tokens for i in ids)
    return pd.DataFrame(
        {
            "sample_id": ids,
            "input_ids": [held[i][:max_tokens] for i in ids],
            "loss_mask": [[1] * min(len(held[i]), max_tokens) for i in ids],
        }
    ), cut


def _write_corpus(
    corpus: tuple[str, str] | None,
    fraction: float,
    max_tokens: int,
    fingerprint: str,
    directory: str,
    log: Callable[[str], None],
) -> dict[str, Any] | None:
    """Freeze ``corpus`` = (bin/idx root, run hash)'s eval-side documents into ``corpus.parquet``; its manifest
    entry, or None without a corpus or without a document on the eval side (the SFT samples are frozen all the
    same; base models then need a later version)."""
    if corpus is None:
        return None
    root, run_hash = corpus
    plan = storage.join(root, "plan.json")
    corpus_tokenizer = storage.read_json(plan)["config"].get("tokenizer") if storage.exists(plan) else None
    if corpus_tokenizer not in (None, fingerprint):
        raise ValueError(
            f"pretraining corpus {root} was tokenized with tokenizer {corpus_tokenizer}, the student's "
            f"is {fingerprint}: materialize pretrain_corpus again before freezing the eval set"
        )
    frame, cut = corpus_documents(root, fraction, max_tokens)
    if frame.empty:
        log(
            f"pretraining corpus {root}: none of its documents hashes to the eval side (eval_set.corpus_fraction="
            f"{fraction}): this version has no corpus documents for base models"
        )
        return None
    table = pa.table(
        {
            "sample_id": pa.array(frame["sample_id"]),
            "input_ids": pa.array(frame["input_ids"], pa.list_(pa.int32())),
            "loss_mask": pa.array(frame["loss_mask"], pa.list_(pa.int8())),
        }
    )
    storage.write_parquet(table.to_pandas(), storage.join(directory, "corpus.parquet"))
    return {
        "run_hash": run_hash,
        "fraction": fraction,
        "documents": len(frame),
        "cut_to_max_tokens": cut,
        "tokens": int(sum(len(ids) - 1 for ids in frame["input_ids"])),
    }


def freeze_eval_set(
    samples: pd.DataFrame,
    tokenizer: Any,
    root: str,
    version: int,
    fraction: float,
    max_tokens: int,
    log: Callable[[str], None] = print,
    corpus: tuple[str, str] | None = None,
    corpus_fraction: float = 0.0,
) -> dict[str, Any]:
    """Write eval-set version ``version`` from the held-out ``samples`` (columns sample_id, day, system_prompt,
    prompt, response), or return the manifest of the one already frozen. ``max_tokens`` keeps the first tokens of
    a long conversation (the model's context in training); an example left with no answer token is dropped.
    ``corpus`` (a ``pretrain_corpus`` root and its run hash) adds its documents on the eval side
    (``corpus_fraction``) for the base models; without one the version has none and base models cannot be
    scored against it."""
    directory = version_dir(root, version)
    if storage.exists(storage.join(directory, "manifest.json")):
        manifest = load_eval_set(root, version)
        if manifest["tokenizer_fingerprint"] != tokenizer_fingerprint(tokenizer):
            raise ValueError(
                f"eval set v{version} in {directory} was tokenized with tokenizer "
                f"{manifest['tokenizer_fingerprint']}, the student's is now "
                f"{tokenizer_fingerprint(tokenizer)}: set eval_set.version in configs/pipeline.yaml "
                "to a new number to freeze a new eval set"
            )
        log(
            f"eval set v{version} is frozen: {manifest['examples']} examples, {manifest['tokens']} scored tokens"
        )
        return manifest
    held = samples[held_out_mask(samples["sample_id"].astype(str).tolist(), fraction)]
    held = held.drop_duplicates("sample_id").sort_values("sample_id", kind="stable").reset_index(drop=True)
    # the same tokenization as packing (ChatTokenizer), so the eval set's tokens are the ones training sees
    chat = ChatTokenizer.from_hf(
        tokenizer, storage.join(root, "tokenizers", f"{tokenizer_fingerprint(tokenizer)}.json")
    )
    conversations = [conversation(r.system_prompt, r.prompt, r.response) for r in held.itertuples()]
    encoded = chat.encode_conversations(conversations) if conversations else []
    rows, lines, dropped = [], [], 0
    for r, messages, (all_ids, all_mask) in zip(held.itertuples(), conversations, encoded, strict=True):
        ids, mask = all_ids[:max_tokens].tolist(), all_mask[:max_tokens].tolist()
        if sum(mask[1:]) == 0:  # the first token is never predicted
            dropped += 1
            continue
        rows.append({"sample_id": str(r.sample_id), "input_ids": ids, "loss_mask": mask})
        lines.append(dumps({"sample_id": str(r.sample_id), "day": str(r.day), "messages": messages}))
    if not rows:
        raise ValueError(
            f"eval set v{version}: none of the {len(samples)} samples hashes to the held-out side "
            f"(eval_set.fraction={fraction}, {dropped} too long to keep an answer token); "
            "raise the fraction or wait for more data"
        )
    table = pa.table(
        {
            "sample_id": pa.array([r["sample_id"] for r in rows]),
            "input_ids": pa.array([r["input_ids"] for r in rows], pa.list_(pa.int32())),
            "loss_mask": pa.array([r["loss_mask"] for r in rows], pa.list_(pa.int8())),
        }
    )
    examples, samples_path = (
        storage.join(directory, "examples.parquet"),
        storage.join(directory, "samples.jsonl"),
    )
    storage.write_parquet(table.to_pandas(), examples)
    with storage.atomic_writer(samples_path) as f:
        f.write(b"".join(lines))
    frozen_corpus = _write_corpus(
        corpus, corpus_fraction, max_tokens, tokenizer_fingerprint(tokenizer), directory, log
    )
    manifest = {
        "format": FORMAT,
        "version": version,
        "fraction": fraction,
        "examples": len(rows),
        "tokens": int(sum(sum(r["loss_mask"][1:]) for r in rows)),
        "dropped_too_long": dropped,
        "max_tokens": max_tokens,
        "days": sorted(held["day"].astype(str).unique().tolist()),
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "corpus": frozen_corpus,
        "files": {
            name: storage.sha256_file(storage.join(directory, name))
            for name in ("examples.parquet", "samples.jsonl", *(["corpus.parquet"] if frozen_corpus else []))
        },
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    storage.write_json(
        manifest, storage.join(directory, "manifest.json")
    )  # last: its presence means complete
    log(
        f"froze eval set v{version}: {len(rows)} held-out examples ({manifest['tokens']} scored tokens) in "
        f"{directory}"
        + (
            f", and {frozen_corpus['documents']} corpus documents ({frozen_corpus['tokens']} scored "
            f"tokens) of corpus {frozen_corpus['run_hash']} for base models"
            if frozen_corpus
            else ""
        )
    )
    return manifest


def load_eval_set(root: str, version: int) -> dict[str, Any]:
    """The manifest of frozen version ``version`` (with ``path``: its examples file), its files checked."""
    directory = version_dir(root, version)
    manifest_path = storage.join(directory, "manifest.json")
    if not storage.exists(manifest_path):
        raise FileNotFoundError(
            f"no eval set v{version} in {directory}: materialize the eval_set asset "
            "(training_job does) before evaluating"
        )
    manifest = storage.read_json(manifest_path)
    for name, digest in manifest["files"].items():
        actual = storage.sha256_file(storage.join(directory, name))
        if actual != digest:
            raise ValueError(
                f"eval set v{version}: {storage.join(directory, name)} changed since it was frozen "
                f"(SHA-256 {actual[:12]} != {digest[:12]}); a frozen eval set is never edited, "
                "freeze a new version instead"
            )
    return {
        **manifest,
        "path": storage.join(directory, "examples.parquet"),
        "samples_path": storage.join(directory, "samples.jsonl"),
        "corpus_path": storage.join(directory, "corpus.parquet") if manifest.get("corpus") else None,
    }


def eval_prompts(manifest: dict[str, Any], limit: int) -> list[str]:
    """The user turns of the first ``limit`` eval-set examples: the questions both models answer for the judge."""
    import json

    prompts: list[str] = []
    with storage.open_read(manifest["samples_path"]) as f:
        for line in f:
            messages = json.loads(line)["messages"]
            prompts.append(next(m["content"] for m in messages if m["role"] == "user"))
            if len(prompts) == limit:
                break
    return prompts
