"""Exact and near-duplicate detection of samples, within a partition and against every earlier partition.

Exact duplicates: a hash of the normalised text (Unicode NFKC, case-folded, punctuation dropped, whitespace
collapsed), so answers that differ only in formatting collide. Near duplicates: MinHash signatures of character
shingles of the normalised text, indexed with locality-sensitive hashing (``datasketch.MinHashLSH``); an LSH hit is
confirmed with the signatures' estimated Jaccard similarity before a sample is called a duplicate, and the reason
code names the sample it duplicates and that similarity.

History: after a partition is gated, the signatures of the samples it *kept* are written to
``<root>/<partition>.parquet`` (atomically). A later partition loads every file whose partition key sorts before
its own (daily keys sort by date), so re-materialising a day never compares it with itself, and a sample is never
rejected as a copy of something that was itself rejected.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass

import fsspec
import numpy as np
import pandas as pd

from nexa_dagster.core.common import storage

_PUNCT = re.compile(r"[^\w\s]", re.UNICODE)
_SPACE = re.compile(r"\s+")
SIGNATURE_COLUMNS = ["sample_id", "partition", "exact_hash", "scheme", "num_perm", "shingle", "signature"]


def normalise(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).casefold()
    return _SPACE.sub(" ", _PUNCT.sub(" ", text)).strip()


def exact_hash(text: str) -> str:
    return hashlib.sha1(normalise(text).encode("utf-8")).hexdigest()


def shingles(text: str, k: int) -> set[bytes]:
    norm = normalise(text)
    if len(norm) <= k:
        return {norm.encode("utf-8")}
    return {norm[i : i + k].encode("utf-8") for i in range(len(norm) - k + 1)}


@dataclass(frozen=True)
class DedupSettings:
    near_duplicate_threshold: float = 0.85  # estimated Jaccard similarity of character shingles
    num_perm: int = 128
    shingle: int = 5


@dataclass(frozen=True)
class Duplicate:
    kind: str  # "exact_duplicate" or "near_duplicate"
    of_sample: str
    of_partition: str
    similarity: float

    def reason(self) -> str:
        where = f" (partition {self.of_partition})" if self.of_partition else ""
        return f"{self.kind}: Jaccard {self.similarity:.2f} with sample {self.of_sample}{where}"


class DedupIndex:
    """Exact hashes and an LSH index of MinHash signatures of the samples seen so far."""

    def __init__(self, settings: DedupSettings) -> None:
        # seconds to import (scipy), only when samples are gated: not at the code location's load
        from datasketch import MinHashLSH

        self.settings = settings
        self._lsh = MinHashLSH(threshold=settings.near_duplicate_threshold, num_perm=settings.num_perm)
        self._exact: dict[str, tuple[str, str]] = {}
        self._signatures: dict[str, object] = {}
        self._partition: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._partition)

    def signature(self, text: str) -> tuple[str, object]:
        from datasketch import MinHash  # as in __init__ (imported once, then a lookup)

        mh = MinHash(num_perm=self.settings.num_perm)
        mh.update_batch(list(shingles(text, self.settings.shingle)))
        return exact_hash(text), mh

    def find(self, exact: str, mh: object) -> Duplicate | None:
        if exact in self._exact:
            sample, partition = self._exact[exact]
            return Duplicate("exact_duplicate", sample, partition, 1.0)
        best: Duplicate | None = None
        for other in self._lsh.query(mh):
            sim = float(mh.jaccard(self._signatures[other]))  # type: ignore[attr-defined]
            if sim >= self.settings.near_duplicate_threshold and (best is None or sim > best.similarity):
                best = Duplicate("near_duplicate", other, self._partition[other], sim)
        return best

    def add(self, sample_id: str, partition: str, exact: str, mh: object) -> None:
        if sample_id in self._partition:
            return
        self._exact.setdefault(exact, (sample_id, partition))
        self._lsh.insert(sample_id, mh)
        self._signatures[sample_id] = mh
        self._partition[sample_id] = partition

    # -- persistence ----------------------------------------------------------------------------------------
    def frame(self, sample_ids: Iterable[str], exact: dict[str, str]) -> pd.DataFrame:
        """The persisted form of ``sample_ids`` (which must have been added)."""
        rows = []
        for sid in sample_ids:
            mh = self._signatures[sid]
            rows.append(
                {
                    "sample_id": sid,
                    "partition": self._partition[sid],
                    "exact_hash": exact[sid],
                    "scheme": str(mh.scheme),  # type: ignore[attr-defined]
                    "num_perm": self.settings.num_perm,
                    "shingle": self.settings.shingle,
                    "signature": np.asarray(mh.hashvalues, dtype=np.uint32).tobytes(),
                }
            )  # type: ignore[attr-defined]
        return pd.DataFrame(rows, columns=SIGNATURE_COLUMNS)

    def load_frame(self, frame: pd.DataFrame, source: str) -> int:
        """Add persisted signatures; rows made with other MinHash settings keep only their exact hash."""
        from datasketch import MinHash  # as in __init__

        scheme = MinHash(num_perm=1).scheme  # what this datasketch makes; older signatures are not comparable

        missing = set(SIGNATURE_COLUMNS) - set(frame.columns)
        if missing:
            raise ValueError(f"dedup history {source} lacks columns {sorted(missing)}")
        added = 0
        for row in frame.itertuples(index=False):
            if (
                row.scheme == scheme
                and int(row.num_perm) == self.settings.num_perm
                and int(row.shingle) == self.settings.shingle
            ):
                values = np.frombuffer(row.signature, dtype=np.uint32)
                if len(values) != self.settings.num_perm:
                    raise ValueError(
                        f"dedup history {source}: sample {row.sample_id} has a signature of "
                        f"{len(values)} values, expected {self.settings.num_perm}"
                    )
                self.add(
                    row.sample_id,
                    row.partition,
                    row.exact_hash,
                    MinHash(num_perm=self.settings.num_perm, hashvalues=values, scheme=scheme),
                )
            else:
                self._exact.setdefault(row.exact_hash, (row.sample_id, row.partition))
            added += 1
        return added


def history_path(root: str, partition: str) -> str:
    return storage.join(root, f"{partition}.parquet")


def load_history(index: DedupIndex, root: str, before: str) -> list[str]:
    """Load every persisted partition whose key sorts before ``before``; returns the partitions loaded."""
    fs, base = fsspec.core.url_to_fs(root)
    if not fs.exists(base):
        return []
    loaded = []
    for path in sorted(fs.glob(f"{base.rstrip('/')}/*.parquet")):
        partition = path.rsplit("/", 1)[-1][: -len(".parquet")]
        if partition < before:
            full = path if "://" not in root else f"{root.split('://', 1)[0]}://{path}"
            index.load_frame(storage.read_parquet(full), full)
            loaded.append(partition)
    return loaded


def save_partition(
    index: DedupIndex, root: str, partition: str, kept: list[str], exact: dict[str, str]
) -> str:
    path = history_path(root, partition)
    storage.write_parquet(index.frame(kept, exact), path)
    return path
