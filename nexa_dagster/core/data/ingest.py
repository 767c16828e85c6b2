"""Ingest: read a day's documents from its landing folder, normalise them, give them stable ids.

A day's landing folder may hold JSONL, Parquet, plain-text/Markdown files and Hugging Face ``datasets``
directories (``save_to_disk``). Bad input stops the stage with an ``IngestError`` that names the file, the line or
row and the field, because a silently skipped shard is data lost without anyone knowing; with ``on_error:
quarantine`` (``configs/pipeline.yaml``, as packaging has) bad lines are set aside with file:line and reason into a
quarantine file the stage's metadata points to, and counted.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from nexa_dagster.core.common.jsonl import BOM, OnError, json_error_reason

RAW_DOCUMENT_COLUMNS = ["doc_id", "day", "source", "title", "text", "n_chars"]
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_SPACES = re.compile(r"[ \t\u00a0]+")
_BLANK_LINES = re.compile(r"\n{3,}")


class IngestError(ValueError):
    """Bad input: the message names the file and the line, row or field at fault (``where``) and ``reason``."""

    def __init__(self, where: str, reason: str, raw: str = "") -> None:
        self.where, self.reason, self.raw = where, reason, raw
        super().__init__(f"{where}: {reason}")


@dataclass(frozen=True)
class RawDocument:
    source: str  # file path plus the line/row, e.g. "day/docs.jsonl:12"
    title: str
    text: str


@dataclass(frozen=True)
class BadInput:
    """A line, row or whole file set aside (``on_error: quarantine``): where it was, why, what it held."""

    where: str
    reason: str
    raw: str

    def to_json(self) -> dict[str, str]:
        return {"where": self.where, "reason": self.reason, "raw": self.raw[:2000]}


def normalise_text(text: str) -> str:
    """NFC, no control characters, one space between words, at most one blank line between paragraphs."""
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL.sub("", text)
    text = "\n".join(_SPACES.sub(" ", line).strip() for line in text.split("\n"))
    return _BLANK_LINES.sub("\n\n", text).strip()


def stable_doc_id(text: str) -> str:
    """A content hash: the same document gets the same id whichever file or day it arrives in."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _pick(record: dict[str, Any], candidates: Sequence[str], where: str, required: bool) -> str | None:
    for name in candidates:
        if name in record and record[name] is not None:
            value = record[name]
            if not isinstance(value, str):
                raise IngestError(
                    where, f"field {name!r} must be a string, got {type(value).__name__} ({value!r:.60})"
                )
            return value
    if required:
        raise IngestError(
            where, f"no text field (looked for {', '.join(candidates)}); fields are {sorted(record)}"
        )
    return None


def _parse_jsonl_line(
    raw: bytes, where: str, text_fields: Sequence[str], title_fields: Sequence[str]
) -> RawDocument | None:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise IngestError(
            where, f"not valid UTF-8 (byte {e.start} of the line: {raw[e.start : e.start + 4]!r})"
        ) from None
    line = line.removeprefix(
        BOM
    ).strip()  # a byte-order mark (Windows editors write one) and CRLF are accepted
    if not line:
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise IngestError(where, f"malformed JSON ({json_error_reason(e)})") from None
    if not isinstance(record, dict):
        raise IngestError(where, f"expected a JSON object, got {type(record).__name__}")
    return RawDocument(
        where, _pick(record, title_fields, where, False) or "", _pick(record, text_fields, where, True) or ""
    )


def read_jsonl(
    path: Path, text_fields: Sequence[str], title_fields: Sequence[str], on_error: OnError = "raise"
) -> Iterator[RawDocument | BadInput]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                doc = _parse_jsonl_line(raw, where, text_fields, title_fields)
            except IngestError as e:
                if on_error == "raise":
                    raise
                yield BadInput(e.where, e.reason, raw.decode("utf-8", "replace").rstrip("\r\n"))
                continue
            if doc is not None:
                yield doc


def read_table(
    frame: pd.DataFrame,
    label: str,
    text_fields: Sequence[str],
    title_fields: Sequence[str],
    on_error: OnError = "raise",
) -> Iterator[RawDocument | BadInput]:
    if not any(c in frame.columns for c in text_fields):
        raise IngestError(
            label, f"no text column (looked for {', '.join(text_fields)}); columns are {list(frame.columns)}"
        )
    for i, record in enumerate(frame.to_dict(orient="records")):
        where = f"{label} row {i}"
        try:
            yield RawDocument(
                where,
                _pick(record, title_fields, where, False) or "",
                _pick(record, text_fields, where, True) or "",
            )
        except IngestError as e:
            if on_error == "raise":
                raise
            yield BadInput(e.where, e.reason, json.dumps(record, ensure_ascii=False, default=str))


def read_text_file(path: Path) -> RawDocument:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise IngestError(
            f"{path}:{line}", f"not valid UTF-8 (byte offset {e.start}: {raw[e.start : e.start + 4]!r})"
        ) from None
    return RawDocument(str(path), path.stem, text.removeprefix(BOM))


def is_hf_dataset_dir(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists())


def _read_file(
    path: Path, text_fields: Sequence[str], title_fields: Sequence[str], on_error: OnError
) -> Iterator[RawDocument | BadInput]:
    if path.is_dir():
        if not is_hf_dataset_dir(path):
            raise IngestError(
                str(path), "a folder that is not a Hugging Face dataset saved with save_to_disk"
            )
        # seconds to import, only for a dataset folder: not at the code location's load
        from datasets import load_from_disk

        ds = load_from_disk(str(path))
        splits = ds.items() if hasattr(ds, "keys") else [("", ds)]
        for split, part in splits:
            label = f"{path}[{split}]" if split else str(path)
            yield from read_table(part.to_pandas(), label, text_fields, title_fields, on_error)
    elif path.suffix == ".jsonl":
        yield from read_jsonl(path, text_fields, title_fields, on_error)
    elif path.suffix == ".parquet":
        try:
            frame = pd.read_parquet(path)
        except Exception as e:  # pyarrow raises several types for a corrupt file
            raise IngestError(str(path), f"unreadable Parquet ({e})") from e
        yield from read_table(frame, str(path), text_fields, title_fields, on_error)
    elif path.suffix in (".txt", ".md"):
        yield read_text_file(path)
    else:
        raise IngestError(
            str(path),
            f"unsupported file type {path.suffix!r} (expected .jsonl, .parquet, .txt, .md "
            "or a datasets folder)",
        )


def iter_landing(
    day_dir: Path, text_fields: Sequence[str], title_fields: Sequence[str], on_error: OnError = "raise"
) -> Iterator[RawDocument | BadInput]:
    """Every document in a day's landing folder, in a deterministic order (sorted paths).

    ``on_error="quarantine"`` yields a bad line or row as a ``BadInput`` and goes on; a file that cannot be read
    at all (corrupt Parquet, unsupported type) is set aside whole, with its path as ``where``.
    """
    for path in landing_files(day_dir):
        try:
            # a file fails as a whole before its first document, or line by line after (read_* handle those)
            yield from _read_file(path, text_fields, title_fields, on_error)
        except IngestError as e:
            if on_error == "raise":
                raise
            yield BadInput(e.where, e.reason, "")


def landing_files(day_dir: Path) -> list[Path]:
    """The files (or dataset folders) a day's landing folder holds, sorted; hidden ones (partial uploads) are not."""
    if not day_dir.is_dir():
        return []
    return sorted(p for p in day_dir.iterdir() if not p.name.startswith("."))


def has_landed(day_dir: Path) -> bool:
    """Whether a day's landing folder exists and holds anything (hidden files, e.g. partial uploads, don't count)."""
    return bool(landing_files(day_dir))


def landed_days(landing_root: Path) -> list[str]:
    """The days (YYYY-MM-DD folders) under a landing root that hold documents, in order."""
    if not landing_root.is_dir():
        return []
    return sorted(
        p.name for p in landing_root.iterdir() if re.fullmatch(r"\d{4}-\d{2}-\d{2}", p.name) and has_landed(p)
    )


@dataclass(frozen=True)
class IngestedDay:
    documents: pd.DataFrame  # the raw_documents rows of the day
    quarantined: list[BadInput]  # lines, rows or files set aside (empty unless on_error="quarantine")
    files: int  # the files (a Parquet file, a datasets folder: one each) that landed on the day


def read_day(
    day_dir: Path,
    day: str,
    *,
    max_docs: int | None,
    max_chars: int,
    text_fields: Sequence[str] = ("text", "content", "body"),
    title_fields: Sequence[str] = ("title", "name", "topic"),
    on_error: OnError = "raise",
) -> IngestedDay:
    """Read, normalise and de-duplicate one day's documents into the ``raw_documents`` table.

    Documents are cut to ``max_chars`` at a paragraph boundary where possible, empty ones are dropped, and
    duplicates (same content id) are kept once. ``max_docs`` caps the day for scale presets. Bad input raises an
    ``IngestError`` naming file and line (``on_error="raise"``) or is set aside in ``quarantined``.
    """
    if not has_landed(day_dir):
        raise IngestError(f"partition {day}", f"no documents landed in {day_dir} (missing or empty folder)")
    rows: list[dict[str, Any]] = []
    bad: list[BadInput] = []
    seen: set[str] = set()
    root = day_dir.parent
    for doc in iter_landing(day_dir, text_fields, title_fields, on_error):
        if isinstance(doc, BadInput):
            bad.append(BadInput(doc.where.replace(str(root) + "/", ""), doc.reason, doc.raw))
            continue
        text = _cut(normalise_text(doc.text), max_chars)
        if not text:
            continue
        doc_id = stable_doc_id(text)
        if doc_id in seen:
            continue
        seen.add(doc_id)
        source = doc.source.replace(str(root) + "/", "")
        rows.append(
            {
                "doc_id": doc_id,
                "day": day,
                "source": source,
                "title": normalise_text(doc.title),
                "text": text,
                "n_chars": len(text),
            }
        )
        if max_docs is not None and len(rows) >= max_docs:
            break
    if not rows:
        set_aside = (
            f" ({len(bad)} bad lines/files set aside, first: {bad[0].where}: {bad[0].reason})" if bad else ""
        )
        raise IngestError(f"partition {day}", f"{day_dir} holds files but no non-empty documents{set_aside}")
    return IngestedDay(pd.DataFrame(rows, columns=RAW_DOCUMENT_COLUMNS), bad, len(landing_files(day_dir)))


def ingest_day(
    day_dir: Path,
    day: str,
    *,
    max_docs: int | None,
    max_chars: int,
    text_fields: Sequence[str] = ("text", "content", "body"),
    title_fields: Sequence[str] = ("title", "name", "topic"),
) -> pd.DataFrame:
    """``read_day`` with bad input raising: the day's ``raw_documents`` table."""
    return read_day(
        day_dir,
        day,
        max_docs=max_docs,
        max_chars=max_chars,
        text_fields=text_fields,
        title_fields=title_fields,
    ).documents


def _cut(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    cut = text.rfind("\n\n", 0, max_chars)
    return text[: cut if cut > max_chars // 2 else max_chars].rstrip()
