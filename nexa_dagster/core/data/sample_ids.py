"""One ``sample_id``, one day: a duplicate across days is caught with an on-disk index, in bounded memory.

``filtered_samples`` used to be validated as one DataFrame of every day, whose schema makes ``sample_id`` unique.
Packaging now reads the partitions one day at a time and checks each against the schema, so an id repeated on two
days passed both checks and was trained on twice. This index restores the check without holding the history:

* ``ids(sample_id, file)`` holds every id of every day file ever indexed (SQLite, on disk, primary key on the id);
* a day file is indexed once, in one transaction: its ids are looked up against the index (a clash is recorded in
  ``clashes(sample_id, first, second)``), then added;
* a snapshot fails when a recorded clash joins two of *its* files, so a day that was replaced (a re-materialized
  partition gets a new content-addressed file) clashes only with the snapshots it is part of.

A night therefore reads only its new day's ids, and memory is SQLite's page cache whatever the history. Files are
named by their base name (content-addressed under ``inputs/``), so a moved data root keeps its index.

Real landing data repeats documents across days, and two days processed at once cannot see each other's ids
upstream (the gate's dedup history holds only the days that finished before). Packaging therefore resolves a
cross-day repeat instead of failing on it (``keep_earliest_day``): the day that sorts first keeps the row, the
later days' files are packaged without it (a content-addressed copy of the file without those rows), and the
count is reported; the outcome is the same whatever order the days ran in. ``check_unique_across_days`` is the
strict form (an error naming the id and both days). An id twice within one day is an error either way.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from nexa_dagster.core.common import storage

SCHEMA = """
CREATE TABLE IF NOT EXISTS ids(sample_id TEXT NOT NULL, file TEXT NOT NULL, PRIMARY KEY(sample_id, file)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS files(file TEXT PRIMARY KEY, days TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS clashes(sample_id TEXT NOT NULL, first TEXT NOT NULL, second TEXT NOT NULL,
                                   PRIMARY KEY(first, second, sample_id)) WITHOUT ROWID;
"""


class DuplicateSampleId(ValueError):
    """A sample id on two days (or twice in one day): the snapshot would train on it twice."""


def _ids_of(path: str, field: str = "sample_id") -> Iterator[str]:
    """The id (``field``) of each line of a day's JSONL file, streamed."""
    with storage.open_read(path) as f:
        for number, line in enumerate(f, 1):
            try:
                yield str(json.loads(line)[field])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{number}: no readable {field} ({e})") from e


def _name(path: str) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1]


@contextlib.contextmanager
def _connect(index: str | None) -> Iterator[sqlite3.Connection]:
    """The index at ``index`` (a local file), or a throwaway one (a remote data root: rebuilt every run)."""
    with tempfile.TemporaryDirectory(prefix="nexa-sample-ids-") as scratch:
        path = index or os.path.join(scratch, "sample-ids.sqlite")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        con = sqlite3.connect(path, timeout=120, isolation_level=None)  # transactions are explicit below
        try:
            con.executescript(SCHEMA)
            yield con
        finally:
            con.close()


def _index_file(con: sqlite3.Connection, path: str, days: Sequence[str], field: str, table: str) -> None:
    file = _name(path)
    con.execute("BEGIN IMMEDIATE")  # one writer at a time: two runs packaging at once index a file once
    try:
        if con.execute("SELECT 1 FROM files WHERE file = ?", (file,)).fetchone():
            con.execute("ROLLBACK")
            return
        con.execute("CREATE TEMP TABLE IF NOT EXISTS new_ids(sample_id TEXT PRIMARY KEY) WITHOUT ROWID")
        con.execute("DELETE FROM new_ids")
        for sid in _ids_of(path, field):
            try:
                con.execute("INSERT INTO new_ids VALUES (?)", (sid,))
            except sqlite3.IntegrityError:
                raise DuplicateSampleId(
                    f"{table}: {field} {sid!r} occurs twice in day {', '.join(days)} ({path})"
                ) from None
        con.execute(
            "INSERT OR IGNORE INTO clashes SELECT n.sample_id, i.file, ? FROM new_ids n "
            "JOIN ids i ON i.sample_id = n.sample_id",
            (file,),
        )
        con.execute("INSERT INTO ids SELECT sample_id, ? FROM new_ids", (file,))
        con.execute("INSERT INTO files VALUES (?, ?)", (file, json.dumps(list(days))))
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise


def index_for(out_root: str) -> str | None:
    """Where a data root keeps its id index (``<out_root>/inputs/sample-ids.sqlite``); None for a remote root."""
    if "://" in out_root and not out_root.startswith("file://"):
        return None
    return storage.join(out_root.removeprefix("file://"), "inputs", "sample-ids.sqlite")


def check_unique_across_days(
    files: Sequence[tuple[str, Sequence[str]]],
    index: str | None,
    field: str = "sample_id",
    table: str = "filtered_samples",
) -> None:
    """Raise ``DuplicateSampleId`` naming the id and both days if an id (``field`` of ``table``: ``sample_id`` of
    ``filtered_samples``, ``doc_id`` of ``raw_documents``) is in two of ``files``.

    ``files`` are ``(path of a day's JSONL, its days)``; ``index`` is the SQLite file that remembers every day
    indexed so far (None: a temporary one, for data roots that are not on a local disk).
    """
    with _connect(index) as con:
        for path, days in files:
            _index_file(con, path, days, field, table)
        con.execute("CREATE TEMP TABLE IF NOT EXISTS snapshot(file TEXT PRIMARY KEY) WITHOUT ROWID")
        con.execute("DELETE FROM snapshot")
        con.executemany("INSERT OR IGNORE INTO snapshot VALUES (?)", [(_name(p),) for p, _ in files])
        clash = "FROM clashes c JOIN snapshot a ON a.file = c.first JOIN snapshot b ON b.file = c.second"
        first = con.execute(
            f"SELECT c.sample_id, c.first, c.second {clash} ORDER BY c.sample_id LIMIT 1"
        ).fetchone()
        if first is None:
            return
        count = con.execute(f"SELECT COUNT(DISTINCT c.sample_id) {clash}").fetchone()[0]
        sid, one, two = first
        days = {
            f: ", ".join(json.loads(d))
            for f, d in con.execute("SELECT file, days FROM files WHERE file IN (?, ?)", (one, two))
        }
        raise DuplicateSampleId(
            f"{table}: {field} {sid!r} is on day {days[one]} ({one}) and on day {days[two]} ({two}); "
            f"{count} id(s) in all are on two days. A row belongs to one day: re-materialize one of those days' "
            f"{table}, or fix what gave two days the same id"
        )


@dataclass(frozen=True)
class EarliestDayKept:
    """What ``keep_earliest_day`` gives packaging: the day files to read (in the order given; a later day's file
    replaced by a copy without the rows an earlier day holds), how many rows were dropped, and an example."""

    files: list[tuple[str, tuple[str, ...]]]
    dropped: int
    example: str | None = None  # "sample_id 'x' kept from day A, dropped from day B"


def _order(days: Sequence[str], path: str) -> tuple[str, str, str]:
    return (min(days) if days else "", max(days) if days else "", _name(path))


def keep_earliest_day(
    files: Sequence[tuple[str, Sequence[str]]],
    index: str | None,
    field: str = "sample_id",
    table: str = "filtered_samples",
) -> EarliestDayKept:
    """Resolve ids that are on two days of ``files`` (``(path of a day's JSONL, its days)``): the file of the earliest
    day keeps the row (ties by file name), the others are given as content-addressed copies without it, written
    beside the original (``<table>-<sha256>.jsonl``); a file left with no row is left out. Deterministic: the same
    files give the same result whatever order they were indexed in. An id twice within one file raises
    ``DuplicateSampleId``. Only new files' ids are read (the on-disk ``index``), and only files that lose rows are
    read again."""
    with _connect(index) as con:
        for path, days in files:
            _index_file(con, path, days, field, table)
        con.execute("CREATE TEMP TABLE IF NOT EXISTS snapshot(file TEXT PRIMARY KEY) WITHOUT ROWID")
        con.execute("DELETE FROM snapshot")
        con.executemany("INSERT OR IGNORE INTO snapshot VALUES (?)", [(_name(p),) for p, _ in files])
        pairs = con.execute(
            "SELECT c.sample_id, c.first, c.second FROM clashes c JOIN snapshot a ON a.file = c.first "
            "JOIN snapshot b ON b.file = c.second ORDER BY c.sample_id"
        ).fetchall()
    if not pairs:
        return EarliestDayKept([(p, tuple(d)) for p, d in files], 0)
    order = {_name(p): _order(d, p) for p, d in files}
    days_of = {_name(p): tuple(d) for p, d in files}
    holders: dict[str, set[str]] = {}
    for sid, one, two in pairs:
        holders.setdefault(sid, set()).update((one, two))
    drop: dict[str, set[str]] = {}  # file name -> ids it must not give
    example = None
    for sid, names in sorted(holders.items()):
        keeper, *others = sorted(names, key=lambda n: order[n])
        for other in others:
            drop.setdefault(other, set()).add(sid)
        if example is None:
            example = (
                f"{field} {sid!r} kept from day {', '.join(days_of[keeper])}, dropped from day "
                f"{', '.join(', '.join(days_of[o]) for o in others)}"
            )
    out: list[tuple[str, tuple[str, ...]]] = []
    dropped = 0
    for path, days in files:
        ids = drop.get(_name(path))
        if not ids:
            out.append((path, tuple(days)))
            continue
        kept, removed = _without(path, ids, field)
        dropped += removed
        if kept:
            directory = str(path).rstrip("/").rsplit("/", 1)[0]
            out.append((storage.write_content_addressed(directory, table, b"".join(kept)), tuple(days)))
    return EarliestDayKept(out, dropped, example)


def _without(path: str, ids: set[str], field: str) -> tuple[list[bytes], int]:
    """The lines of ``path`` whose ``field`` is not in ``ids``, and how many were left out."""
    kept, removed = [], 0
    with storage.open_read(path) as f:
        for line in f:
            if str(json.loads(line)[field]) in ids:
                removed += 1
            else:
                kept.append(line if line.endswith(b"\n") else line + b"\n")
    return kept, removed
