"""A split as a list of shard files: written by packaging, read by training, the asset check and ``datasets``.

A snapshot used to concatenate every shard's packed rows into one ``train.parquet``: on night N that is N days of
rows read and written again, the one cost of an incremental night that grew with the history. A split is now a
small manifest, ``<snapshot>/<split>.shards.json``, that names its shard files in order (paths relative to the
folder that holds the snapshot folder, e.g. ``store/shards/<key>.train.parquet``, so a data root can be moved or
copied) with each file's size, SHA-256 and row count. Reading the files in manifest order gives exactly the rows,
in exactly the order, that the concatenated file held. The JSONL export of the conversations is a manifest the
same way (``<split>.jsonl.shards.json``, read line by line with ``split_lines``).

Every reader goes through ``split_files``, which also accepts a plain packed Parquet file (datasets packaged
before this change, hand-made test files), so a checkpoint's lineage keeps pointing at data that can be read.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from nexa_dagster.core.common import storage

FORMAT = "nexa-packed-shards/1"
SUFFIX = ".shards.json"
# one row of packed SFT data: exactly pack_size tokens (the column-by-column meaning: README.md in this folder)
PACKED_SCHEMA = pa.schema(
    [
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("position_ids", pa.list_(pa.int32())),
        ("attention_mask", pa.list_(pa.int8())),
        ("cu_seqlens", pa.list_(pa.int32())),
        ("num_documents", pa.int64()),
        ("num_tokens", pa.int64()),
        ("num_loss_tokens", pa.int64()),
        ("labels", pa.list_(pa.int32())),
    ]
)


def split_manifest_path(snapshot_root: str, split: str) -> str:
    return storage.join(snapshot_root, f"{split}{SUFFIX}")


def is_manifest(path: str) -> bool:
    return str(path).endswith(SUFFIX)


def _base_of(manifest: str) -> str:
    """The folder the manifest's entries are relative to: the one that holds the snapshot folder."""
    parts = str(manifest).rstrip("/").rsplit("/", 2)
    if len(parts) < 3:
        raise ValueError(
            f"split manifest {manifest} must sit in a snapshot folder (<root>/<run_hash>/{SUFFIX})"
        )
    return parts[0]


def write_split_manifest(
    path: str, split: str, run_hash: str, base: str, files: Sequence[tuple[str, int, str, int | None]]
) -> None:
    """Write ``path`` (atomically) listing ``(path under base, bytes, sha256, rows)`` per shard file, in order.

    Files with no rows (or no bytes) are left out: they add nothing to the split and would cost an open per night.
    ``rows`` may be None where the writer does not count them (the JSONL export).
    """
    if _base_of(path).rstrip("/") != str(base).rstrip("/"):
        raise ValueError(f"split manifest {path}: entries must be relative to {_base_of(path)}, not {base}")
    storage.write_json(
        {
            "format": FORMAT,
            "split": split,
            "run_hash": run_hash,
            "files": [
                {"path": rel, "bytes": size, "sha256": digest, "rows": rows}
                for rel, size, digest, rows in files
                if rows != 0 and size
            ],
        },
        path,
    )


def read_split_manifest(path: str) -> dict[str, Any]:
    if not storage.exists(path):
        raise FileNotFoundError(f"packed dataset not found: {path}")
    try:
        data = storage.read_json(path)
    except ValueError as e:
        raise ValueError(f"packed split manifest {path} is not valid JSON: {e}") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("files"), list):
        raise ValueError(f"{path} is not a packed split manifest (format {FORMAT!r} with a 'files' list)")
    return data


def split_files(path: str, check_sizes: bool = True) -> list[str]:
    """The files a split is read from, in order: a manifest's shard files, or ``path`` itself (one file).

    ``check_sizes`` compares each file's size with the manifest (one ``stat`` per file, no read), so a shard
    missing from or replaced in the store fails here naming the manifest and the file, not deep inside a reader.
    """
    if not is_manifest(path):
        if not storage.exists(path):
            raise FileNotFoundError(f"packed dataset not found: {path}")
        return [str(path)]
    data = read_split_manifest(path)
    base = _base_of(path)
    out = []
    for entry in data["files"]:
        file = storage.join(base, entry["path"])
        if check_sizes:
            if not storage.exists(file):
                raise FileNotFoundError(
                    f"packed split {path}: shard file {file} is missing (the shard store was "
                    "cleaned or moved without this snapshot)"
                )
            if storage.size(file) != entry["bytes"]:
                raise ValueError(
                    f"packed split {path}: shard file {file} is {storage.size(file)} bytes, the manifest "
                    f"says {entry['bytes']}"
                )
        out.append(file)
    return out


def iter_packed_tables(path: str, columns: Sequence[str] | None = None) -> Iterator[tuple[str, Any]]:
    """``(file, pyarrow table)`` per shard file of the split, in order: one shard in memory at a time."""
    for file in split_files(path):
        with storage.open_read(file) as f:
            yield file, pq.read_table(f, columns=list(columns) if columns else None)


def read_packed_table(path: str, columns: Sequence[str] | None = None) -> Any:
    """The whole split as one pyarrow table (rows in manifest order), for readers that hold it anyway."""
    tables = [t for _, t in iter_packed_tables(path, columns)]
    if not tables:
        schema = PACKED_SCHEMA if columns is None else pa.schema([PACKED_SCHEMA.field(c) for c in columns])
        return schema.empty_table()
    return pa.concat_tables(tables)


def read_packed_frame(path: str) -> Any:
    """The whole split as one pandas DataFrame, rows in manifest order (what ``pd.read_parquet`` gave for the
    concatenated file)."""
    return read_packed_table(path).to_pandas()


def split_lines(path: str) -> Iterator[str]:
    """The lines of a JSONL split (a ``.jsonl.shards.json`` manifest or one JSONL file), in order, streamed."""
    for file in split_files(path):
        with storage.open_read(file) as f:
            for raw in f:
                yield raw.decode("utf-8").rstrip("\n")
