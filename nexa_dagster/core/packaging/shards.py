"""Shard plans, receipts and the parallel runner behind every packaging format.

The work is planned before anything is computed: each input file is cut into shards of at most ``rows_per_shard``
lines (byte ranges found by one streaming pass that also hashes the bytes). The plan (shards with their input
hashes, plus the configuration: tokenizer, template, pack size, seed, blend...) hashes to the run hash. Each shard's
output depends only on its own bytes and the configuration, and outputs are concatenated in shard order, so the
result is byte-identical whatever the number of workers or the order in which they finish.

A finished shard writes a receipt (temporary file, then rename) that lists its outputs with their sizes and
SHA-256. A re-run of the same plan skips shards whose receipt is valid (same shard key, every output present with
the recorded size and checksum) and redoes the others, so a run killed part-way resumes where it stopped and a
corrupted receipt or output is redone rather than trusted.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import pyarrow.parquet as pq

from nexa_dagster import settings
from nexa_dagster.core.common import stat_cache, storage, threads
from nexa_dagster.core.common.progress import Progress

PLAN_FORMAT = 1
# the wall seconds a pool of two spawned processes takes before its first shard is done: each imports the work's
# module (the packaging formats, the tokenizer's library) and the launcher's main module. Measured 1.1-2.0 s for the
# three formats with a bare main module (sft 1.7-2.0, pretrain 1.3-1.8, jsonl 1.1-1.3; the 2-core AMD EPYC), about
# 6.4 s under bench/shard_pool.py (docs/measurements.md): 1.5 s, the low end, errs towards the pool (the old way)
POOL_START_S = 1.5


@dataclass(frozen=True)
class Shard:
    """A byte range of one input file: lines ``first_line .. first_line + rows - 1``."""

    index: int
    source: str
    path: str
    start: int
    end: int
    first_line: int
    rows: int
    input_sha256: str

    @property
    def shard_id(self) -> str:
        return f"{self.index:06d}"

    @property
    def label(self) -> str:
        return self.path.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class ShardTask:
    """What a worker needs: the shard, the run's configuration and where to write (picklable, no open handles)."""

    shard: Shard
    root: str
    key: str
    config: dict[str, Any]
    runtime: dict[str, Any] = field(
        default_factory=dict
    )  # not hashed: tokenizer handle, options that don't change bytes
    output_id: str = ""  # what the outputs and the receipt are named by: the shard key in a shard store

    @property
    def out_id(self) -> str:
        return self.output_id or self.shard.shard_id


@dataclass
class Receipt:
    """Proof that a shard finished: its outputs (relative path -> size and SHA-256) and its counts."""

    shard_id: str
    key: str
    rows: int
    outputs: dict[str, dict[str, Any]]
    stats: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def scan_file(path: str, rows_per_shard: int) -> list[tuple[int, int, int, int, str]]:
    """``(start, end, first_line, rows, sha256)`` per shard of ``path``, in one streaming pass."""
    if rows_per_shard <= 0:
        raise ValueError(f"rows_per_shard must be positive, got {rows_per_shard}")
    ranges = []
    start = pos = 0
    line = first = 1
    rows = 0
    h = hashlib.sha256()
    with storage.open_read(path) as f:
        while raw := f.readline():
            h.update(raw)
            pos += len(raw)
            rows += 1
            line += 1
            if rows == rows_per_shard:
                ranges.append((start, pos, first, rows, h.hexdigest()))
                start, first, rows, h = pos, line, 0, hashlib.sha256()
    if rows:
        ranges.append((start, pos, first, rows, h.hexdigest()))
    return ranges


def plan_shards(inputs: Sequence[tuple[str, Sequence[str]]], rows_per_shard: int) -> list[Shard]:
    """Shards for ``(source name, files)`` pairs, numbered in order; an empty file gives no shard.

    A local file's ranges are remembered by its stat (``core/stat_cache``): a night plans every earlier day's file
    without reading it again.
    """
    shards: list[Shard] = []
    for source, files in inputs:
        for path in files:
            ranges = stat_cache.remembered(
                path, f"shard-ranges:{rows_per_shard}", lambda p=path: scan_file(p, rows_per_shard)
            )
            for start, end, first, rows, digest in ranges:
                shards.append(Shard(len(shards), source, path, start, end, first, rows, digest))
    return shards


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode("utf-8")


def shard_key(shard: Shard, config: dict[str, Any], canonical_config: bytes | None = None) -> str:
    """What one shard's output is a function of: its input bytes, where it sits, and the configuration.

    ``canonical_config`` is ``_canonical(config)`` when the caller has it already: a plan of N shards serialises
    its configuration once, not N times (the bytes hashed are the same either way).
    """
    rest = _canonical(
        {
            "format": PLAN_FORMAT,
            "input": shard.input_sha256,
            "source": shard.source,
            "first_line": shard.first_line,
            "label": shard.label,
        }
    )
    # the canonical JSON of the whole dict, "config" being the first key in sorted order
    body = b'{"config":' + (canonical_config or _canonical(config)) + b"," + rest[1:]
    return hashlib.sha256(body).hexdigest()[:32]


ConfigFor = Callable[[Shard], dict[str, Any]]  # a shard's own configuration (default: the run's)


def _keyer(
    config: dict[str, Any], config_for: ConfigFor | None
) -> Callable[[Shard], tuple[dict[str, Any], str]]:
    """``shard -> (its configuration, its key)``, serialising each distinct configuration object once."""
    seen: dict[int, tuple[dict[str, Any], bytes]] = {}

    def key(shard: Shard) -> tuple[dict[str, Any], str]:
        own = config_for(shard) if config_for else config
        if id(own) not in seen:
            seen[id(own)] = (own, _canonical(own))  # keeps ``own`` alive, so its id is not reused
        return own, shard_key(shard, own, seen[id(own)][1])

    return key


def run_hash(shards: Sequence[Shard], config: dict[str, Any], config_for: ConfigFor | None = None) -> str:
    """What the whole output is a function of; equal run hashes mean byte-identical outputs.

    File locations are left out (only the input bytes, the source names and the file names count), so the same
    data copied to another bucket or machine hashes the same.
    """
    keyer = _keyer(config, config_for)
    keys = [keyer(s)[1] for s in shards]
    return hashlib.sha256(_canonical({"format": PLAN_FORMAT, "config": config, "shards": keys})).hexdigest()[
        :16
    ]


def receipt_path(root: str, shard_id: str) -> str:
    return storage.join(root, "receipts", f"{shard_id}.json")


def output_entry(root: str, relative: str) -> dict[str, Any]:
    path = storage.join(root, relative)
    return {"bytes": storage.size(path), "sha256": storage.sha256_file(path)}


def write_receipt(root: str, receipt: Receipt) -> None:
    """Written last, atomically: a receipt that exists was complete when written."""
    storage.write_json(receipt.to_json(), receipt_path(root, receipt.shard_id))


def check_receipt(root: str, shard_id: str, key: str) -> tuple[Receipt | None, str]:
    """The receipt if it is valid for this shard key, else ``None`` and the reason it is not."""
    path = receipt_path(root, shard_id)
    if not storage.exists(path):
        return None, "no receipt"
    try:
        data = storage.read_json(path)
        receipt = Receipt(**data)
    except (ValueError, TypeError) as e:
        return None, f"unreadable receipt {path}: {e}"
    if receipt.key != key:
        return None, f"receipt {path} is for another plan (key {receipt.key}, expected {key})"
    for relative, expected in receipt.outputs.items():
        out = storage.join(root, relative)
        if not storage.exists(out):
            return None, f"output {out} is missing"
        if storage.size(out) != expected.get("bytes"):
            return None, f"output {out} is {storage.size(out)} bytes, receipt says {expected.get('bytes')}"
        if stat_cache.sha256_file(out) != expected.get("sha256"):
            return None, f"output {out} does not match its checksum"
    return receipt, "valid"


def default_workers() -> int:
    """All the cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class ShardRunner(Protocol):
    """Runs shard tasks somewhere other than this machine's process pool (a Slurm array, a Kubernetes indexed Job).

    It must run ``run_task(work, task)`` for every task (outputs, then the receipt, exactly as the local runner
    does) and return their receipts in task order, checked (``check_receipt``); a task without a valid receipt
    afterwards raises, naming the shard.
    """

    def __call__(
        self, tasks: Sequence[ShardTask], work: Callable[[ShardTask], Receipt], log: Callable[[str], None]
    ) -> Sequence[Receipt]: ...


@dataclass
class RunReport:
    """Receipts in shard order, and which shards were done now, skipped, or redone (with the reason)."""

    receipts: list[Receipt]
    processed: list[str]
    skipped: list[str]
    redone: dict[str, str]


def run_shards(
    shards: Sequence[Shard],
    root: str,
    config: dict[str, Any],
    work: Callable[[ShardTask], Receipt],
    runtime: dict[str, Any] | None = None,
    workers: int = 1,
    log: Callable[[str], None] = print,
    *,
    store: bool = False,
    config_for: ConfigFor | None = None,
    runner: ShardRunner | None = None,
) -> RunReport:
    """Run ``work`` on every shard without a valid receipt, ``workers`` processes at a time.

    ``work`` must be a module-level function (it is pickled to spawned processes) that writes the shard's outputs
    atomically, then its receipt. With ``workers <= 1`` shards run in this process, one after the other.

    With ``store=True``, ``root`` is a content-addressed shard store shared by every run: outputs and receipts are
    named by the shard key (input bytes + configuration), not by the shard's position, so a shard that an earlier
    run (an earlier day's snapshot) already produced is reused instead of redone. ``config_for`` gives a shard a
    configuration of its own (what of the run's configuration concerns its rows only).

    ``runner`` runs the shards that lack a valid receipt elsewhere (``core/cluster/shard_task.py``: a Slurm job array, a
    Kubernetes indexed Job) instead of ``workers`` local processes; planning, the receipt checks before and the
    caller's concatenation after stay here, so the bytes are the same whatever ran the shards.
    """
    keyer = _keyer(config, config_for)
    tasks, done, skipped, redone = _tasks_to_do(shards, root, keyer, runtime, log, store)
    if skipped:
        log(f"{len(skipped)} of {len(shards)} shards already done (valid receipts), {len(tasks)} to do")
    with Progress(log, "shards done") as progress:
        progress(len(done), len(shards))

        def finished(shard_id: str, receipt: Receipt) -> None:
            done[shard_id] = receipt
            progress(len(done), len(shards))

        if runner is not None and tasks:
            for task, receipt in zip(tasks, runner(tasks, work, log), strict=True):
                done[task.shard.shard_id] = receipt
            progress(len(done), len(shards))
        elif workers <= 1 or len(tasks) <= 1:
            for task in tasks:
                finished(task.shard.shard_id, run_task(work, task))
        else:
            # the first shard here, timed: the rest go to a pool only where its start pays (pool_pays)
            t0 = time.perf_counter()
            finished(tasks[0].shard.shard_id, run_task(work, tasks[0]))
            first_s, rest = time.perf_counter() - t0, tasks[1:]
            if pool_pays(first_s / max(tasks[0].shard.rows, 1), rest, workers):
                _run_in_processes(rest, work, workers, finished)
            else:
                for task in rest:
                    finished(task.shard.shard_id, run_task(work, task))
    ordered = [done[s.shard_id] for s in shards]
    return RunReport(ordered, [t.shard.shard_id for t in tasks], skipped, redone)


def _tasks_to_do(
    shards: Sequence[Shard],
    root: str,
    keyer: Callable[[Shard], tuple[dict[str, Any], str]],
    runtime: dict[str, Any] | None,
    log: Callable[[str], None],
    store: bool,
) -> tuple[list[ShardTask], dict[str, Receipt], list[str], dict[str, str]]:
    """The shards without a valid receipt as tasks, and for the others: their receipts by shard id, their ids (the
    skipped shards), and the reason each redone shard's receipt was not valid (absent receipts are no reason)."""
    tasks: list[ShardTask] = []
    done: dict[str, Receipt] = {}
    skipped: list[str] = []
    redone: dict[str, str] = {}
    for shard in shards:
        own, key = keyer(shard)
        out_id = key if store else shard.shard_id
        receipt, why = check_receipt(root, out_id, key)
        if receipt is not None:
            done[shard.shard_id] = receipt
            skipped.append(shard.shard_id)
            continue
        if why != "no receipt":
            redone[shard.shard_id] = why
            log(f"shard {shard.shard_id}: redoing ({why})")
        tasks.append(ShardTask(shard, root, key, own, dict(runtime or {}), out_id if store else ""))
    return tasks, done, skipped, redone


def pool_pays(seconds_per_row: float, rest: Sequence[ShardTask], workers: int) -> bool:
    """Whether ``rest`` is worth a pool of spawned processes, given the first shard's seconds per row (done in this
    process, its imports and loads included, so the estimate errs towards the pool): ``workers`` processes cut the
    rest's estimated seconds to a ``1 / workers`` share at best and cost ``POOL_START_S`` before their first shard,
    so a pool pays when ``estimate * (1 - 1 / workers)`` exceeds it. At the demo's scale a day's shards take tenths
    of a second: the pool would cost more than the whole work."""
    if not rest:
        return False
    estimate = seconds_per_row * sum(t.shard.rows for t in rest)
    return estimate * (1 - 1 / min(workers, len(rest))) > POOL_START_S


def _run_in_processes(
    tasks: Sequence[ShardTask],
    work: Callable[[ShardTask], Receipt],
    workers: int,
    finished: Callable[[str, Receipt], None],
) -> None:
    """``tasks`` in a pool of up to ``workers`` spawned processes, ``finished(shard_id, receipt)`` as each ends; the
    first failure cancels the tasks not yet started and is raised."""
    ctx = multiprocessing.get_context("spawn")  # no inherited threads or locks; the same in any host
    pool_size = min(workers, len(tasks))
    policy = settings.thread_policy("shards", alongside=pool_size)  # the cores split among the pool
    with ProcessPoolExecutor(
        max_workers=pool_size, mp_context=ctx, initializer=threads.use, initargs=(policy,)
    ) as pool:
        futures = {pool.submit(run_task, work, t): t.shard.shard_id for t in tasks}
        try:
            for fut in as_completed(futures):
                finished(futures[fut], fut.result())
        except BaseException:
            for other in futures:
                other.cancel()
            raise


def run_task(work: Callable[[ShardTask], Receipt], task: ShardTask) -> Receipt:
    """Do one shard and write its receipt, in the worker, as soon as its outputs are in place."""
    receipt = work(task)
    write_receipt(task.root, receipt)
    return receipt


def clean_temporaries(root: str) -> int:
    """Remove the temporary files a killed run left behind (they never became outputs).

    Only those whose writer is gone: another run may be writing into the same snapshot folder or the shared
    shard store right now, and removing its temporary file would fail its rename.
    """
    removed = 0
    for pattern in ("shards/.*.tmp", "receipts/.*.tmp", ".*.tmp"):
        for path in storage.glob(storage.join(root, pattern)):
            if storage.temporary_is_abandoned(path):
                storage.remove(path)
                removed += 1
    return removed


def concat_files(parts: Sequence[str], out: str, chunk: int = 1 << 22) -> int:
    """Concatenate files byte for byte into ``out`` (atomic, streaming); returns the bytes written."""
    total = 0
    with storage.atomic_writer(out) as dst:
        for part in parts:
            with storage.open_read(part) as src:
                while block := src.read(chunk):
                    dst.write(block)
                    total += len(block)
    return total


def concat_parquet(parts: Sequence[str], out: str, schema: Any) -> int:
    """Concatenate Parquet shards into one file (atomic), one shard in memory at a time; returns the row count.

    Each shard becomes one row group, so the output's bytes depend only on the shards' contents and order.
    """
    rows = 0
    with storage.atomic_writer(out) as dst:
        writer = pq.ParquetWriter(dst, schema, compression="zstd", write_statistics=False)
        try:
            for part in parts:
                with storage.open_read(part) as src:
                    table = pq.read_table(src, schema=schema)
                if table.num_rows:
                    writer.write_table(table, row_group_size=max(table.num_rows, 1))
                    rows += table.num_rows
        finally:
            writer.close()
    return rows
