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
    manifest.json      version, counts, tokenizer fingerprint, SHA-256 of every file, and ``content_sha256``: one
                       hash of the version's content (of its files' hashes), which every report and leaderboard
                       row measured on it carries, so two rows that say ``v1`` provably measured the same data

and never rewrites it: later materializations of the same version return it unchanged (a new version is made only
when the configuration asks for one), and ``load_eval_set`` checks the files' hashes, so every checkpoint scored
against ``v<N>`` is scored on exactly the same tokens. A version exists from the moment any of its files does
(or its ``v<N>.frozen`` marker beside the folder, written at the freeze): a file missing, changed or unreadable
is an error naming the version, the file and what to do (restore it, or freeze a new version by raising
``eval_set.version``), never a reason to freeze the version again. On a local disk the version is written into a
temporary folder and renamed into place whole, so a killed freeze leaves no half version behind. A corpus document is on the eval side by the same rule
(``is_held_out`` of its id below ``corpus_fraction``), and pretraining drops those documents before it splits a
corpus (``core.training.corpus.load_corpus``): no base model, whatever corpus it trains on, trains on them.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa

from nexa_dagster.core.common import storage
from nexa_dagster.core.common.jsonl import dumps
from nexa_dagster.core.data.splits import held_out_mask, is_held_out
from nexa_dagster.core.packaging.formats.indexed_dataset import corpus_prefixes, document_id, read_documents
from nexa_dagster.core.packaging.packing import ChatTokenizer, conversation, tokenizer_fingerprint

FORMAT = "nexa-eval-set/1"
FILES = ("manifest.json", "examples.parquet", "samples.jsonl", "corpus.parquet")


class EvalSetDamaged(ValueError):
    """A frozen eval-set version whose files are not as frozen (missing, changed or unreadable)."""


def version_dir(root: str, version: int) -> str:
    return storage.join(root, f"v{version}")


def frozen_marker(root: str, version: int) -> str:
    """``<root>/v<N>.frozen``: written once the version is frozen, holding its content hash; it says the version
    exists even when its whole folder is gone."""
    return storage.join(root, f"v{version}.frozen")


def content_sha256(files: dict[str, str]) -> str:
    """One hash of a version's content: of its files' names and SHA-256s (so it follows from the manifest of any
    version, including one frozen before the manifest recorded it)."""
    body = "".join(f"{name} {digest}\n" for name, digest in sorted(files.items()))
    return hashlib.sha256(body.encode()).hexdigest()


def _what_to_do(version: int) -> str:
    return (
        f"a frozen eval set is never rewritten: restore the file from a backup, or freeze a new version by "
        f"raising eval_set.version in configs/pipeline.yaml (to {version + 1} or any number not used yet)"
    )


def version_exists(root: str, version: int) -> bool:
    """Whether version ``version`` was frozen: any of its files, or its marker, is there."""
    directory = version_dir(root, version)
    return storage.exists(frozen_marker(root, version)) or any(
        storage.exists(storage.join(directory, name)) for name in FILES
    )


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
    if version_exists(root, version):
        return _already_frozen(root, version, tokenizer, log)
    held = samples[held_out_mask(samples["sample_id"].astype(str).tolist(), fraction)]
    held = held.drop_duplicates("sample_id").sort_values("sample_id", kind="stable").reset_index(drop=True)
    # the same tokenization as packing (ChatTokenizer), so the eval set's tokens are the ones training sees
    chat = ChatTokenizer.from_hf(
        tokenizer, storage.join(root, "tokenizers", f"{tokenizer_fingerprint(tokenizer)}.json")
    )
    rows, lines, dropped = _encoded_examples(held, chat, max_tokens)
    if not rows:
        raise ValueError(
            f"eval set v{version}: none of the {len(samples)} samples hashes to the held-out side "
            f"(eval_set.fraction={fraction}, {dropped} too long to keep an answer token); "
            "raise the fraction or wait for more data"
        )

    def write(directory: str) -> dict[str, Any]:
        """Every file of the version into ``directory``, the manifest last; returns the manifest."""
        storage.write_parquet(_examples_table(rows).to_pandas(), storage.join(directory, "examples.parquet"))
        with storage.atomic_writer(storage.join(directory, "samples.jsonl")) as f:
            f.write(b"".join(lines))
        frozen_corpus = _write_corpus(
            corpus, corpus_fraction, max_tokens, tokenizer_fingerprint(tokenizer), directory, log
        )
        return _write_manifest(
            directory, version, fraction, rows, dropped, max_tokens, held, tokenizer, frozen_corpus
        )

    if "://" in directory:  # a remote root: no rename of a folder; the manifest, written last, completes it
        manifest = write(directory)
    else:
        out = Path(directory)
        out.parent.mkdir(parents=True, exist_ok=True)
        with storage.directory_lock(out):  # two runs freezing at once: one freezes, the other finds it frozen
            if version_exists(root, version):
                return _already_frozen(root, version, tokenizer, log)
            written: dict[str, Any] = {}
            storage.publish_directory(out, lambda tmp: written.update(write(str(tmp))))
            manifest = written
    storage.write_text(manifest["content_sha256"] + "\n", frozen_marker(root, version))
    log(_frozen_message(version, directory, manifest))
    return {**manifest, **_paths(directory, manifest)}


def _encoded_examples(
    held: pd.DataFrame, chat: ChatTokenizer, max_tokens: int
) -> tuple[list[dict[str, Any]], list[bytes], int]:
    """The held-out samples as examples (sample_id, input_ids, loss_mask: cut to ``max_tokens``) and their
    ``samples.jsonl`` lines, in ``held``'s order, and how many were dropped with no answer token left."""
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
    return rows, lines, dropped


def _examples_table(rows: list[dict[str, Any]]) -> pa.Table:
    """``examples.parquet``'s table: int32 token ids and an int8 loss mask per example."""
    return pa.table(
        {
            "sample_id": pa.array([r["sample_id"] for r in rows]),
            "input_ids": pa.array([r["input_ids"] for r in rows], pa.list_(pa.int32())),
            "loss_mask": pa.array([r["loss_mask"] for r in rows], pa.list_(pa.int8())),
        }
    )


def _frozen_message(version: int, directory: str, manifest: dict[str, Any]) -> str:
    """The log line of a freeze: examples and scored tokens, the corpus documents if any, the content hash."""
    frozen_corpus = manifest["corpus"]
    return (
        f"froze eval set v{version}: {manifest['examples']} held-out examples ({manifest['tokens']} scored tokens) "
        f"in {directory}"
        + (
            f", and {frozen_corpus['documents']} corpus documents ({frozen_corpus['tokens']} scored "
            f"tokens) of corpus {frozen_corpus['run_hash']} for base models"
            if frozen_corpus
            else ""
        )
        + f"; content SHA-256 {manifest['content_sha256'][:16]}"
    )


def _already_frozen(root: str, version: int, tokenizer: Any, log: Callable[[str], None]) -> dict[str, Any]:
    """The frozen version, checked (a damaged one raises ``EvalSetDamaged``), for the same tokenizer."""
    directory = version_dir(root, version)
    manifest = load_eval_set(root, version)
    if manifest["tokenizer_fingerprint"] != tokenizer_fingerprint(tokenizer):
        raise ValueError(
            f"eval set v{version} in {directory} was tokenized with tokenizer "
            f"{manifest['tokenizer_fingerprint']}, the student's is now "
            f"{tokenizer_fingerprint(tokenizer)}: set eval_set.version in configs/pipeline.yaml "
            "to a new number to freeze a new eval set"
        )
    if not storage.exists(frozen_marker(root, version)):  # frozen before markers existed
        storage.write_text(manifest["content_sha256"] + "\n", frozen_marker(root, version))
    log(
        f"eval set v{version} is frozen: {manifest['examples']} examples, {manifest['tokens']} scored tokens "
        f"(content SHA-256 {manifest['content_sha256'][:16]})"
    )
    return manifest


def _write_manifest(
    directory: str,
    version: int,
    fraction: float,
    rows: list[dict[str, Any]],
    dropped: int,
    max_tokens: int,
    held: pd.DataFrame,
    tokenizer: Any,
    frozen_corpus: dict[str, Any] | None,
) -> dict[str, Any]:
    files = {
        name: storage.sha256_file(storage.join(directory, name))
        for name in ("examples.parquet", "samples.jsonl", *(["corpus.parquet"] if frozen_corpus else []))
    }
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
        "files": files,
        "content_sha256": content_sha256(files),
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    storage.write_json(
        manifest, storage.join(directory, "manifest.json")
    )  # last: its presence means complete
    return manifest


def _paths(directory: str, manifest: dict[str, Any]) -> dict[str, Any]:
    return {
        "path": storage.join(directory, "examples.parquet"),
        "samples_path": storage.join(directory, "samples.jsonl"),
        "corpus_path": storage.join(directory, "corpus.parquet") if manifest.get("corpus") else None,
    }


def load_eval_set(root: str, version: int) -> dict[str, Any]:
    """The manifest of frozen version ``version`` (with ``path``: its examples file, and ``content_sha256``), its
    files checked. ``FileNotFoundError`` when the version was never frozen; ``EvalSetDamaged`` naming the version,
    the file and what to do when a file of it is missing, changed or unreadable."""
    directory = version_dir(root, version)
    manifest_path = storage.join(directory, "manifest.json")
    if not version_exists(root, version):
        raise FileNotFoundError(
            f"no eval set v{version} in {directory}: materialize the eval_set asset "
            "(training_job does) before evaluating"
        )
    if not storage.exists(manifest_path):
        present = [n for n in FILES if storage.exists(storage.join(directory, n))]
        raise EvalSetDamaged(
            f"eval set v{version} is frozen but its manifest {manifest_path} is missing (the version holds "
            f"{', '.join(present) if present else 'no file: its whole folder is gone'}); {_what_to_do(version)}"
        )
    try:
        manifest = storage.read_json(manifest_path)
        files = manifest["files"]
        if not isinstance(files, dict) or manifest.get("version") != version:
            raise ValueError(f"not the manifest of version {version}")
    except (ValueError, KeyError, TypeError) as e:  # a truncated or edited manifest
        raise EvalSetDamaged(
            f"eval set v{version}: its manifest {manifest_path} is unreadable ({type(e).__name__}: {e}); "
            f"{_what_to_do(version)}"
        ) from e
    for name, digest in files.items():
        path = storage.join(directory, name)
        if not storage.exists(path):
            raise EvalSetDamaged(
                f"eval set v{version}: {path} is missing (its manifest lists it); {_what_to_do(version)}"
            )
        actual = storage.sha256_file(path)
        if actual != digest:
            raise EvalSetDamaged(
                f"eval set v{version}: {path} changed since it was frozen "
                f"(SHA-256 {actual[:12]} != {digest[:12]}); {_what_to_do(version)}"
            )
    content = content_sha256(files)
    if manifest.get("content_sha256", content) != content:
        raise EvalSetDamaged(
            f"eval set v{version}: its manifest {manifest_path} was edited (its content_sha256 does not match "
            f"its files); {_what_to_do(version)}"
        )
    marker = frozen_marker(root, version)
    if storage.exists(marker):
        with storage.open_read(marker) as f:
            recorded = f.read().decode("utf-8", errors="replace").strip()
        if recorded and recorded != content:
            raise EvalSetDamaged(
                f"eval set v{version}: its files are not the ones frozen (content SHA-256 {content[:16]}, "
                f"{marker} says {recorded[:16]}); {_what_to_do(version)}"
            )
    return {**manifest, "content_sha256": content, **_paths(directory, manifest)}


def eval_slices(manifest: dict[str, Any], field: str | None) -> list[str] | None:
    """Each example's value of ``field`` in ``samples.jsonl`` (in the examples' order), the promotion guards'
    slices; None when ``field`` is None. A field an example does not carry is an error naming the file and row."""
    if field is None:
        return None
    labels: list[str] = []
    with storage.open_read(manifest["samples_path"]) as f:
        for row, line in enumerate(f, 1):
            value = json.loads(line).get(field)
            if value is None:
                raise ValueError(
                    f"{manifest['samples_path']} row {row} has no field {field!r} to slice the eval set by "
                    "(promotion.yaml guards.slice_by)"
                )
            labels.append(str(value))
    return labels


def eval_prompts(manifest: dict[str, Any], limit: int) -> list[str]:
    """The user turns of the first ``limit`` eval-set examples: the questions both models answer for the judge."""
    prompts: list[str] = []
    with storage.open_read(manifest["samples_path"]) as f:
        for line in f:
            messages = json.loads(line)["messages"]
            prompts.append(next(m["content"] for m in messages if m["role"] == "user"))
            if len(prompts) == limit:
                break
    return prompts
