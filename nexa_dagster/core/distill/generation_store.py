"""A durable, per-partition store of model answers, written one answer at a time: nothing is paid for twice.

Teacher calls are the expensive part of distillation. Every successful answer is committed to a SQLite file of
its partition (``<root>/<partition>.sqlite``) the moment it arrives, keyed by the sample key (a hash of prompt,
system prompt, model, sampling parameters and generation index; see ``core.distillation.sample_key``). A run
killed with SIGKILL halfway loses only the requests that were in flight; the next run looks every key up first
and sends only the missing ones.

Why SQLite rather than an append-only JSONL file: each commit is atomic (a torn write is rolled back, never
read back as half a row), ``INSERT OR IGNORE`` on the primary key makes "exactly one answer per key" a property
of the file, and lookups by key do not read the whole partition. WAL mode with ``synchronous=NORMAL`` keeps every
committed answer through a crash or kill of the process (a power loss may lose the last few commits).

Failed requests are not stored: they cost nothing to ask again, and the next run retries them.
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

from nexa_dagster.core.llm.base import Completion

_SAFE_PARTITION = re.compile(r"^[A-Za-z0-9_.=-]+$")


class GenerationStore:
    """``<root>/<partition>.sqlite`` files, one per partition, opened on first use and kept open until ``close``.

    Use from one thread (the one consuming the client's answer stream); SQLite connections are not shared.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._connections: dict[str, sqlite3.Connection] = {}

    def __repr__(self) -> str:
        return f"GenerationStore({str(self.root)!r})"

    def path(self, partition: str) -> Path:
        if not _SAFE_PARTITION.match(partition):
            raise ValueError(f"partition key {partition!r} cannot name a store file under {self.root}")
        return self.root / f"{partition}.sqlite"

    def _db(self, partition: str) -> sqlite3.Connection:
        db = self._connections.get(partition)
        if db is None:
            path = self.path(partition)
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                db = sqlite3.connect(
                    path, isolation_level=None, timeout=30.0
                )  # autocommit: one statement, one commit
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=NORMAL")
                db.execute(
                    "CREATE TABLE IF NOT EXISTS answers (key TEXT PRIMARY KEY, answer TEXT NOT NULL, "
                    "stored_at REAL NOT NULL)"
                )
            except sqlite3.DatabaseError as e:
                raise RuntimeError(
                    f"generation store {path} is unreadable ({e}); move it aside to start the "
                    f"partition afresh (its answers would be paid for again)"
                ) from e
            self._connections[partition] = db
        return db

    def get_many(self, partition: str, keys: Iterable[str]) -> dict[str, Completion]:
        """The stored answers among ``keys`` (missing keys are simply absent)."""
        wanted = list(dict.fromkeys(keys))
        if not wanted or not self.path(partition).exists():
            return {}
        db = self._db(partition)
        found: dict[str, Completion] = {}
        for start in range(0, len(wanted), 500):  # SQLite's bound-parameter limit
            chunk = wanted[start : start + 500]
            rows = db.execute(
                f"SELECT key, answer FROM answers WHERE key IN ({','.join('?' * len(chunk))})", chunk
            )
            for key, payload in rows:
                try:
                    found[key] = Completion(**json.loads(payload))
                except (ValueError, TypeError) as e:
                    raise RuntimeError(
                        f"generation store {self.path(partition)}: answer for key {key} is unreadable ({e})"
                    ) from e
        return found

    def put(self, partition: str, key: str, answer: Completion) -> bool:
        """Commit one answer; False (and the first answer kept) when the key was stored already.

        Only answers are stored: a failed request must be asked again by the next run, never replayed.
        """
        if answer.error is not None:
            raise ValueError(f"generation store: key {key} failed ({answer.error}); failures are not stored")
        cur = self._db(partition).execute(
            "INSERT OR IGNORE INTO answers (key, answer, stored_at) VALUES (?, ?, ?)",
            (key, json.dumps(asdict(answer), ensure_ascii=False), time.time()),
        )
        return cur.rowcount == 1

    def count(self, partition: str) -> int:
        if not self.path(partition).exists():
            return 0
        return int(self._db(partition).execute("SELECT COUNT(*) FROM answers").fetchone()[0])

    def keys(self, partition: str) -> set[str]:
        if not self.path(partition).exists():
            return set()
        return {k for (k,) in self._db(partition).execute("SELECT key FROM answers")}

    def close(self) -> None:
        for db in self._connections.values():
            db.close()
        self._connections.clear()

    def __enter__(self) -> GenerationStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
