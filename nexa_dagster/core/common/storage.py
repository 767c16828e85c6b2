"""Atomic writes through fsspec: nothing already materialized is ever half-overwritten.

Every writer here writes to a temporary name beside the target and renames it into place, so a crash leaves
either the old file or the new one, never a torn mix. Paths may be local paths or any fsspec URL
(``memory://``, ``s3://``, ``gs://``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from nexa_dagster.core.common.faults import KILL_BEFORE_RENAME, fault_point

if TYPE_CHECKING:  # pyarrow converts to and from pandas itself: a training worker that never reads a table
    import pandas as pd  # does not pay pandas' import (0.6 s after torch on the 2-core machine)


def join(root: str | os.PathLike[str], *parts: str) -> str:
    base = str(root).rstrip("/")
    return "/".join([base, *[p.strip("/") for p in parts if p]])


def _fs(path: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, p = fsspec.core.url_to_fs(str(path))
    return fs, p


def exists(path: str | os.PathLike[str]) -> bool:
    fs, p = _fs(str(path))
    return fs.exists(p)


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocols


def _atomic_write_bytes(path: str, data: bytes) -> None:
    with atomic_writer(path) as f:
        f.write(data)


def write_parquet(df: pd.DataFrame, path: str | os.PathLike[str]) -> None:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False), buf)
    _atomic_write_bytes(str(path), buf.getvalue())


def read_parquet(path: str | os.PathLike[str]) -> pd.DataFrame:
    fs, p = _fs(str(path))
    with fs.open(p, "rb") as f:
        return pq.read_table(f).to_pandas()


def write_jsonl(rows: Iterable[dict[str, Any]], path: str | os.PathLike[str]) -> int:
    lines = [json.dumps(r, ensure_ascii=False, default=str) for r in rows]
    _atomic_write_bytes(str(path), ("\n".join(lines) + ("\n" if lines else "")).encode("utf-8"))
    return len(lines)


def write_json(obj: Any, path: str | os.PathLike[str]) -> None:
    _atomic_write_bytes(
        str(path), (json.dumps(obj, indent=2, ensure_ascii=False, default=str) + "\n").encode()
    )


def write_text(text: str, path: str | os.PathLike[str]) -> None:
    _atomic_write_bytes(str(path), text.encode("utf-8"))


def read_json(path: str | os.PathLike[str]) -> Any:
    fs, p = _fs(str(path))
    with fs.open(p, "rb") as f:
        return json.loads(f.read().decode("utf-8"))


def local_dir(path: str | os.PathLike[str]) -> Path:
    """A local directory path (created); model checkpoints live on local or mounted disks."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    return p


_TEMPORARY = re.compile(r"~(?P<host>[^~/]*)~(?P<pid>\d+)~[0-9a-f]+\.tmp$")
ABANDONED_AFTER_S = 3600.0  # a temporary file from another host untouched this long: its writer is gone


def temporary_name(name: str) -> str:
    """``.<name>.~<host>~<pid>~<random>.tmp``: the name of a file being written says who writes it, so that a
    clean-up can tell a live writer's file (another run packaging at the same time) from a killed one's."""
    return f".{name}.~{socket.gethostname()}~{os.getpid()}~{uuid.uuid4().hex[:12]}.tmp"


def temporary_is_abandoned(path: str) -> bool:
    """True when nobody will finish the temporary file at ``path``: its writer on this host has exited, or a
    writer elsewhere left it untouched for ``ABANDONED_AFTER_S``. A name without a writer (an older format)
    counts as abandoned; an age that cannot be read counts as alive."""
    match = _TEMPORARY.search(path)
    if match is None:
        return True
    if match["host"] == socket.gethostname():
        try:
            os.kill(int(match["pid"]), 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, someone else's
            return False
        return _is_zombie(int(match["pid"]))
    fs, p = _fs(path)
    try:
        modified = fs.modified(p).timestamp()
    except (NotImplementedError, OSError, AttributeError):
        return False
    return time.time() - modified > ABANDONED_AFTER_S


def _is_zombie(pid: int) -> bool:
    """A killed process stays a zombie until its parent reaps it; it writes nothing more."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


class atomic_writer:  # noqa: N801 - used like open()
    """A writable binary file that appears at ``path`` only when the ``with`` block ends without an error.

    Streams to a temporary name beside the target (so large outputs never sit in memory) and renames it into
    place at the end; on an error the temporary file is removed and the target is left as it was.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.fs, self.path = _fs(str(path))
        parent, _, name = self.path.rpartition("/")
        if parent:
            self.fs.makedirs(parent, exist_ok=True)
        self.tmp = f"{parent}/{temporary_name(name)}" if parent else temporary_name(name)
        self._file: Any = None

    def __enter__(self) -> Any:
        self._file = self.fs.open(self.tmp, "wb")
        return self._file

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            try:
                self._file.close()  # flushes: a full disk often shows up only here
            except OSError as e:
                if exc_type is None:
                    raise write_error(self.path, e) from e
            if exc_type is None:
                fault_point(KILL_BEFORE_RENAME, path=self.path)  # a test-only hook: see core/common/faults.py
                if _is_local(self.fs):
                    os.replace(self.tmp, self.path)
                else:
                    self.fs.mv(self.tmp, self.path)
            elif isinstance(exc, OSError):
                raise write_error(self.path, exc) from exc
        finally:
            if self.fs.exists(self.tmp):
                self.fs.rm(self.tmp)


def write_error(path: str, error: OSError) -> OSError:
    """An error that names the file and says what was kept (a disk full, a read-only mount, a lost bucket)."""
    return OSError(
        error.errno,
        f"cannot write {path}: {error.strerror or error}; nothing was replaced: the "
        "previous version, if any, is unchanged",
    )


def write_content_addressed(root: str | os.PathLike[str], stem: str, body: bytes, ext: str = "jsonl") -> str:
    """Write ``body`` once as ``<root>/<stem>-<sha256[:16]>.<ext>`` and return that path.

    The name is the content: the same input always lands at the same path (so a plan that hashes paths and bytes
    stays stable), and an existing file is reused instead of rewritten.
    """
    path = join(root, f"{stem}-{hashlib.sha256(body).hexdigest()[:16]}.{ext}")
    if not exists(path):
        with atomic_writer(path) as f:
            f.write(body)
    return path


def open_read(path: str | os.PathLike[str]) -> Any:
    """A readable binary file for a local path or any fsspec URL."""
    fs, p = _fs(str(path))
    return fs.open(p, "rb")


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    """Checksum of a file read in chunks (constant memory whatever its size)."""
    h = hashlib.sha256()
    with open_read(path) as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def size(path: str | os.PathLike[str]) -> int:
    fs, p = _fs(str(path))
    return int(fs.size(p))


def remove(path: str | os.PathLike[str]) -> None:
    """Delete a file if it is there (a missing file is already the wanted state)."""
    fs, p = _fs(str(path))
    if fs.exists(p):
        fs.rm(p)


def glob(pattern: str) -> list[str]:
    """Files matching a glob, sorted, with the URL scheme kept so they can be opened again."""
    fs, p = _fs(pattern)
    protocol = fs.protocol[0] if isinstance(fs.protocol, tuple) else fs.protocol
    found = sorted(fs.glob(p))
    if "://" in pattern and protocol not in ("file", "local"):
        return [f"{protocol}://{f.lstrip('/')}" for f in found]
    return found


def publish_directory(out: Path, fill: Callable[[Path], None]) -> None:
    """Fill a temporary folder beside ``out``, then put it in ``out``'s place in one rename.

    The caller holds ``out``'s build lock, so an existing ``out`` is an incomplete leftover of a crashed build
    that nobody reads; on an error the temporary folder is removed and ``out`` is left as it was.
    """
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        fill(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def directory_lock(out: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``.<name>.lock`` beside the directory ``out``, released when the holder exits
    (even killed: the kernel drops the lock with the process): concurrent builders of one directory take turns."""
    with open(out.parent / f".{out.name}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
