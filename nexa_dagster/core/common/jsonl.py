"""JSONL records: streaming reads by byte range, one error type naming file, line and field, and bad rows.

A bad row (blank line, invalid JSON, not an object, not UTF-8) either stops the run with an error naming the file
and the line (``on_error="raise"``, the default: a silently dropped row is data lost without anyone knowing), or is
set aside with its reason (``on_error="quarantine"``) into a quarantine file that the run's metadata counts.
Ingest reads landing files with it; packaging reads its inputs with it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

Record = dict[str, Any]
OnError = Literal["raise", "quarantine"]
BOM = "\ufeff"  # a UTF-8 byte-order mark, which Windows editors put at the start of a file


def json_error_reason(e: json.JSONDecodeError) -> str:
    """``json``'s message with the column (of one JSONL line); some messages already end in "at" ("Invalid control
    character at"), which read "at at" with the column appended."""
    return f"{e.msg.removesuffix(' at')} at column {e.colno}"


class RecordError(ValueError):
    """A bad input row; ``where`` is ``file:line`` and ``field`` the field at fault (when there is one)."""

    def __init__(self, reason: str, where: str = "", field: str | None = None) -> None:
        self.reason, self.where, self.field = reason, where, field
        located = f"{where}: " if where else ""
        super().__init__(f"{located}{f'field {field!r}: ' if field else ''}{reason}")

    def at(self, where: str) -> RecordError:
        return RecordError(self.reason, where, self.field)


@dataclass(frozen=True)
class BadRow:
    """A row set aside: where it was, why, and (the start of) what it held."""

    where: str
    field: str | None
    reason: str
    raw: str

    def to_json(self) -> Record:
        return {"where": self.where, "field": self.field, "reason": self.reason, "raw": self.raw[:2000]}


def iter_jsonl(
    file: Any,
    label: str,
    start: int = 0,
    end: int | None = None,
    first_line: int = 1,
    on_error: OnError = "raise",
) -> Iterator[tuple[str, Record | BadRow]]:
    """``(file:line, record)`` for each line of ``file`` in the byte range ``[start, end)``.

    ``file`` is an open binary file (fsspec or local); the range must start at a line start (the planner's
    offsets do). Bad rows raise ``RecordError`` or come out as ``BadRow`` according to ``on_error``.
    """
    file.seek(start)
    pos, line = start, first_line
    while end is None or pos < end:
        raw = file.readline()
        if not raw:
            break
        pos += len(raw)
        where = f"{label}:{line}"
        line += 1
        try:
            yield where, parse_line(raw, where)
        except RecordError as e:
            if on_error == "raise":
                raise
            yield where, BadRow(where, e.field, e.reason, raw.decode("utf-8", "replace").rstrip("\n"))


def parse_line(raw: bytes, where: str) -> Record:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecordError(f"not UTF-8 ({e.reason} at byte {e.start})", where) from None
    text = text.removeprefix(BOM)  # a byte-order mark opening the file is not part of the record
    if not text.strip():
        raise RecordError("empty row", where)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise RecordError(f"invalid JSON ({json_error_reason(e)})", where) from None
    if not isinstance(value, dict):
        raise RecordError(f"a row must be a JSON object, got {type(value).__name__}", where)
    return value


def dumps(record: Record) -> bytes:
    """One JSONL line; keys keep their order and non-ASCII stays readable, so equal records give equal bytes."""
    return (json.dumps(record, ensure_ascii=False, separators=(", ", ": "), default=str) + "\n").encode(
        "utf-8"
    )
