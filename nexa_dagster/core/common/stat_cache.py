"""Facts about a file (its SHA-256, its shard ranges) remembered by its ``stat``, so a night does not re-read history.

An incremental night still looked at every earlier day's files: the SHA-256 of each partition's Parquet file (to
find its JSONL), one streaming pass over each day's JSONL (the shard plan) and the SHA-256 of every reused shard
output (the receipt check). Each is a pure function of the file's bytes; the bytes of a local file have not changed
while its device, inode, size, modification and change times (nanoseconds) are the same, the rule git's index uses.
The change time cannot be set by a writer, so rewriting a file in place (same size, other bytes) is always seen.

Two guards keep the rule safe:

* a fact is remembered only for a file last modified more than ``RACY_S`` ago (git's "racy" case: a write in the
  same clock tick as the ``stat`` would not change the times), so a file written moments ago is always re-read;
* only local files are remembered; an fsspec URL (``s3://``, ``memory://``) is always read.

Entries are small JSON files named by a hash of (purpose, absolute path, stat) in this machine's cache,
``$NEXA_CACHE_DIR/stat-cache`` (default ``~/.cache/nexa-dagster``; inode numbers are the machine's own, and a data
root's own files stay only its data); a wrong or unreadable entry only costs a re-read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Callable
from typing import TypeVar

from nexa_dagster import settings
from nexa_dagster.core.common import storage

RACY_S = (
    2.0  # a file modified this recently may still change within the same timestamp tick: never remembered
)
T = TypeVar("T")


def _identity(path: str) -> str | None:
    """The file's stat as a string, or None where the stat cannot vouch for the bytes (remote, or too recent)."""
    if "://" in str(path) and not str(path).startswith("file://"):
        return None
    try:
        st = os.stat(str(path).removeprefix("file://"))
    except OSError:
        return None
    if time.time() - st.st_mtime < RACY_S or time.time() - st.st_ctime < RACY_S:
        return None
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def default_dir() -> str:
    return str(settings.cache_root() / "stat-cache")


def remembered(path: str, purpose: str, compute: Callable[[], T], cache_dir: str | None = None) -> T:
    """``compute()`` (a JSON-serialisable fact about ``path``'s bytes), read from the cache when the file's stat is
    the one it was computed for (``cache_dir``: default this machine's)."""
    cache_dir = cache_dir or default_dir()
    identity = _identity(path)
    if identity is None:
        return compute()
    name = hashlib.sha256(
        json.dumps([purpose, os.path.abspath(str(path).removeprefix("file://")), identity]).encode()
    ).hexdigest()[:32]
    entry = storage.join(cache_dir, f"{name}.json")
    try:
        with open(entry, encoding="utf-8") as f:
            return json.load(f)["value"]
    except (OSError, ValueError, KeyError):
        pass
    value = compute()
    if _identity(path) == identity:  # unchanged while it was read: the fact is about these bytes
        with contextlib.suppress(OSError):  # a read-only or full cache only costs the re-read next time
            storage.write_json({"purpose": purpose, "path": str(path), "value": value}, entry)
    return value


def sha256_file(path: str, cache_dir: str | None = None) -> str:
    """``storage.sha256_file``, remembered by the file's stat."""
    return remembered(path, "sha256", lambda: storage.sha256_file(path), cache_dir)
