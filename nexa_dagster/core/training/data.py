"""Training input: packed rows from ``sft_dataset``, a deterministic resumable order, and a prefetching loader.

The order of rows is a pure function of (seed, position): a resumed run asks for the stream from the position it
had reached and gets exactly the micro-batches an uninterrupted run would have seen next. The loader prepares the
next micro-batches on a background thread (pinned memory on GPUs) and measures how long the training loop waited
for each one, so the run can report the share of step time lost to input.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from nexa_dagster.core.packaging.formats.packed_split import read_packed_frame
from nexa_dagster.core.packaging.packing import IGNORE_INDEX, learned
from nexa_dagster.core.training.corpus import load_corpus, record_served
from nexa_dagster.core.training.job import TrainingJob

Batch = dict[str, torch.Tensor]

PACKED_COLUMNS = ("input_ids", "loss_mask", "position_ids", "attention_mask")
OPTIONAL_COLUMNS = (
    "labels",
)  # written by packaging since packed-sft-parquet/3; computed here for older data
LOSS_TOKENS = "loss_tokens"  # a micro-batch's learned-token count, added by micro_batches
HOST_KEYS = {LOSS_TOKENS}  # stay on the CPU: the loop reads them without waiting for the GPU


def load_packed(path: str) -> Batch:
    """Read a packed split into ``[rows, pack_size]`` tensors, failing with the path in every message.

    ``path`` is the snapshot's split manifest (its shard files, read in manifest order: the rows and order the
    concatenated file had) or one packed Parquet file (older datasets, hand-made ones).
    """
    frame = read_packed_frame(path)
    missing = [c for c in PACKED_COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(f"packed dataset {path} lacks columns {missing} (has {list(frame.columns)})")
    if frame.empty:
        raise ValueError(f"packed dataset is empty: {path}")
    data: Batch = {}
    for column in PACKED_COLUMNS + tuple(c for c in OPTIONAL_COLUMNS if c in frame.columns):
        try:
            data[column] = torch.from_numpy(np.stack(frame[column].to_numpy()).astype(np.int64))
        except ValueError as e:  # ragged rows: the packer must emit exactly pack_size tokens per row
            raise ValueError(f"packed dataset {path}: column {column} has rows of different lengths") from e
    return data


def check_packed(data: Batch, path: str, vocab_size: int) -> None:
    """Catch data the model cannot train on before the engine starts, with a message that says what to fix."""
    top = int(data["input_ids"].max())
    if top >= vocab_size:
        raise ValueError(
            f"packed dataset {path} has token id {top} but the tokenizer's vocabulary has {vocab_size} "
            "entries: the data was tokenized with a different tokenizer"
        )
    if "labels" in data:
        stored, rule = (
            data["labels"],
            data["input_ids"].masked_fill(
                ~learned(data["loss_mask"], data["attention_mask"], data["position_ids"]), IGNORE_INDEX
            ),
        )
        if not torch.equal(stored, rule):
            row = int(stored.ne(rule).any(dim=1).nonzero()[0, 0])
            raise ValueError(
                f"packed dataset {path}: row {row} has labels that disagree with its input_ids and "
                "loss_mask (labels must be the token id where learned, -100 elsewhere)"
            )
    if int(labels_for(data).ne(IGNORE_INDEX).sum()) == 0:
        raise ValueError(f"packed dataset {path} has no loss-mask tokens: nothing to learn")


def labels_for(batch: Batch) -> torch.Tensor:
    """Targets for the causal-LM loss (the model shifts them by one): the packed data's stored ``labels`` column,
    or, for data without one (the pretraining corpus, older packed datasets), the same rule
    (``core.packing.learned``) applied here."""
    if "labels" in batch:
        return batch["labels"]
    learn = learned(batch["loss_mask"], batch["attention_mask"], batch["position_ids"])
    return batch["input_ids"].masked_fill(~learn, IGNORE_INDEX)


def index_stream(num_rows: int, seed: int) -> Iterator[int]:
    """Row indices forever: one seeded permutation per epoch, identical on every rank."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield from torch.randperm(num_rows, generator=generator).tolist()


def micro_batches(
    data: Batch, micro_batch: int, seed: int, rank: int, world_size: int, start: int = 0
) -> Iterator[Batch]:
    """This rank's share of every global batch, from global batch number ``start`` on (resume).

    Each global batch holds ``micro_batch * world_size`` rows, no row twice unless the dataset is smaller than a
    global batch (then it repeats, which tiny runs rely on).
    """
    stream = index_stream(data["input_ids"].shape[0], seed)
    if start:
        next(
            itertools.islice(stream, start * micro_batch * world_size - 1, None)
        )  # skip without building lists
    while True:
        global_batch = list(itertools.islice(stream, micro_batch * world_size))
        mine = torch.tensor(global_batch[rank * micro_batch : (rank + 1) * micro_batch])
        batch = {name: tensor[mine] for name, tensor in data.items()}
        batch[LOSS_TOKENS] = labels_for(batch)[:, 1:].ne(IGNORE_INDEX).sum()  # counted here, on the host
        yield batch


class Prefetcher:
    """Pull micro-batches from ``source`` on a thread, ``depth`` ahead; ``next()`` returns them on ``device``.

    ``wait_s`` accumulates the time the training loop spent blocked in ``next()``: input-bound steps show up as a
    high data-wait share in the run's metrics instead of as a mysteriously slow GPU.
    """

    _END = object()

    def __init__(
        self,
        source: Iterator[Batch],
        device: torch.device,
        depth: int = 2,
        host_keys: frozenset[str] | set[str] = frozenset(HOST_KEYS),
    ) -> None:
        self.device = device
        self.host_keys = host_keys  # left on the host: counts the loop reads without waiting for the GPU
        self.wait_s = 0.0
        self._source = source
        self._pin = device.type == "cuda"
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max(1, depth))
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = (
            threading.Thread(target=self._fill, name="prefetch", daemon=True) if depth > 0 else None
        )
        if self._thread is not None:
            self._thread.start()

    def _fill(self) -> None:
        try:
            for batch in self._source:
                if self._pin:
                    batch = {k: v.pin_memory() for k, v in batch.items()}
                while not self._stop.is_set():
                    try:
                        self._queue.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as e:  # surfaced in the training loop, not lost on a thread
            self._error = e
        self._queue.put(self._END)

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Batch:
        start = time.perf_counter()
        if self._thread is None:
            batch = next(self._source)
        else:
            item = self._queue.get()
            if item is self._END:
                if self._error is not None:
                    raise self._error
                raise StopIteration
            batch = item  # type: ignore[assignment]
        batch = {
            k: v if k in self.host_keys else v.to(self.device, non_blocking=True) for k, v in batch.items()
        }
        self.wait_s += time.perf_counter() - start
        return batch

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the loader thread and wait for it: a daemon thread still inside a torch call when the process
        exits is unwound by the interpreter's teardown through C++ frames, which can abort the process."""
        self._stop.set()
        if self._thread is None:
            return
        with contextlib.suppress(queue.Empty):  # a put() blocked on a full queue (the end marker) can go on
            while True:
                self._queue.get_nowait()
        self._thread.join(timeout=timeout_s)


def load_job_data(job: TrainingJob, tokenizer: Any) -> tuple[Batch, Batch, int]:
    """(training rows, validation rows, held-out documents) for the job's data kind, checked for this vocabulary.

    ``packed_sft``: the packaging stage's Parquet files. ``pretrain_corpus``: a bin/idx corpus packed here
    (``core/training/corpus.py``); its validation rows are the held-out documents.
    """
    vocab_size = len(tokenizer)
    if job.data_kind == "pretrain_corpus":
        if job.pack_size <= 0:
            raise ValueError(f"training job {job.run_id}: a pretrain_corpus job needs pack_size > 0")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        # the split is the corpus's, not the run's: no training seed in it, so every base model trained on this
        # corpus holds out the same documents
        train, validation, split = load_corpus(
            job.train_path,
            job.pack_size,
            job.heldout_fraction,
            pad,
            eval_fraction=job.eval_fraction,
            exclude=frozenset(job.exclude_documents),
        )
        check_packed(train, f"{job.train_path} (training side)", vocab_size)
        check_packed(validation, f"{job.train_path} (held-out side)", vocab_size)
        record_served(job.output_dir, split, train)  # <checkpoint>.served.json: what the loader serves from
        return train, validation, len(split.heldout)
    train, validation = load_packed(job.train_path), load_packed(job.validation_path)
    check_packed(train, job.train_path, vocab_size)
    check_packed(validation, job.validation_path, vocab_size)
    return train, validation, 0
