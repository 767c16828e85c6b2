"""Removing what the shard store holds for snapshots nobody keeps: the store must not grow with every night forever.

A snapshot (``<out_root>/<run_hash>/snapshot.json``) lists its shards' keys; the content-addressed store
(``<out_root>/store/``) holds the outputs and receipts of every shard any snapshot asked for. The last
``keep_snapshots`` snapshots (by the time their manifest was written) are kept with every shard they list; older
snapshot folders are removed, then every store shard that no kept snapshot lists. Never removed:

* a shard a kept snapshot lists (it is what training reads);
* anything while a packaging run is in flight: every run holds a shared lock on ``store/.lock`` from before it
  checks the store's receipts until its snapshot manifest is written, and the clean-up runs only with the exclusive
  lock, taken without waiting (busy: nothing is removed, the next night tries again);
* a temporary file whose writer is alive (``storage.temporary_is_abandoned`` decides, as for every clean-up).

Local stores only (the lock is ``flock``); for an fsspec URL nothing is removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from nexa_dagster.core.common import storage

SNAPSHOT = "snapshot.json"


def _local(out_root: str) -> Path | None:
    if "://" in out_root and not out_root.startswith("file://"):
        return None
    return Path(out_root.removeprefix("file://"))


@contextlib.contextmanager
def packaging_in_flight(out_root: str) -> Iterator[None]:
    """Held by a packaging run (shared): no clean-up removes a shard while the run may still pick it up."""
    root = _local(out_root)
    if root is None:
        yield
        return
    (root / "store").mkdir(parents=True, exist_ok=True)
    with open(root / "store" / ".lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@dataclass
class Cleanup:
    """What a clean-up kept and removed (snapshot run hashes, shard keys), or why it did nothing."""

    kept_snapshots: list[str] = field(default_factory=list)
    removed_snapshots: list[str] = field(default_factory=list)
    removed_shards: list[str] = field(default_factory=list)
    skipped: str = ""


def _snapshots(root: Path) -> list[tuple[float, Path]]:
    found = []
    for manifest in root.glob(f"*/{SNAPSHOT}"):
        with contextlib.suppress(OSError):
            found.append((manifest.stat().st_mtime, manifest.parent))
    return sorted(found)


class StoreLayout(Protocol):
    """How a store names what its snapshots list, and which files make up each stored shard."""

    def listed(self, snapshot: Path) -> set[str]:
        """The keys of the shards ``snapshot`` (a snapshot folder) lists; unreadable: raise."""

    def shards(self, store: Path) -> list[tuple[str, list[Path]]]:
        """Every stored shard: its key and its files, the one whose absence stops reuse first."""


class SFTStore:
    """``sft_dataset``'s store: ``receipts/<key>.json`` beside ``shards/<key>.*``; ``snapshot.json`` lists the
    shard ids."""

    def listed(self, snapshot: Path) -> set[str]:
        return {str(s["shard_id"]) for s in storage.read_json(str(snapshot / SNAPSHOT))["shards"]}

    def shards(self, store: Path) -> list[tuple[str, list[Path]]]:
        found = []
        for receipt in sorted((store / "receipts").glob("*.json")):
            key = receipt.name.removesuffix(".json")
            outputs = [o for o in (store / "shards").glob(f"{key}.*") if not o.name.endswith(".tmp")]
            found.append((key, [receipt, *outputs]))  # the receipt first: a shard without it is never reused
        return found


class SplitManifestStore:
    """``preference_dataset``'s store: one Parquet file per day and split directly in ``store/``; a snapshot's
    split manifests (``<split>.shards.json``) list the files it reads."""

    def listed(self, snapshot: Path) -> set[str]:
        return {
            Path(entry["path"]).name
            for manifest in snapshot.glob("*.shards.json")
            for entry in storage.read_json(str(manifest))["files"]
        }

    def shards(self, store: Path) -> list[tuple[str, list[Path]]]:
        return [(f.name, [f]) for f in sorted(store.glob("*.parquet"))]


def clean_store(
    out_root: str, keep_snapshots: int, log: Callable[[str], None] = print, layout: StoreLayout | None = None
) -> Cleanup:
    """Keep the newest ``keep_snapshots`` snapshots and the store shards they list; remove the rest (0: keep all).
    ``layout``: the store's (default: ``sft_dataset``'s)."""
    layout = layout or SFTStore()
    report = Cleanup()
    root = _local(out_root)
    if keep_snapshots <= 0 or root is None or not (root / "store").is_dir():
        report.skipped = "clean-up off (keep_snapshots: 0)" if keep_snapshots <= 0 else "no local shard store"
        return report
    with open(root / "store" / ".lock", "a+b") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            report.skipped = "a packaging run is in flight: nothing removed"
            log(f"store clean-up of {root}: {report.skipped}")
            return report
        try:
            snapshots = _snapshots(root)
            kept, old = snapshots[-keep_snapshots:], snapshots[:-keep_snapshots]
            referenced: set[str] = set()
            for _, folder in kept:
                referenced |= layout.listed(folder)  # unreadable: raise, remove nothing
                report.kept_snapshots.append(folder.name)
            for _, folder in old:
                shutil.rmtree(folder, ignore_errors=True)
                report.removed_snapshots.append(folder.name)
            for key, files in layout.shards(root / "store"):
                if key in referenced:
                    continue
                for file in files:
                    file.unlink(missing_ok=True)
                report.removed_shards.append(key)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    if report.removed_snapshots or report.removed_shards:
        log(
            f"store clean-up of {root}: kept the last {len(report.kept_snapshots)} snapshots; removed "
            f"{len(report.removed_snapshots)} older snapshot(s) and {len(report.removed_shards)} shard(s) none of "
            "the kept ones lists"
        )
    return report
