"""The loader thread of the training loop: ``close`` leaves no thread behind, whatever the thread was doing."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import torch

from nexa_dagster.core.training.data import Prefetcher


def _endless() -> Iterator[dict[str, torch.Tensor]]:
    for i in itertools.count():
        yield {"input_ids": torch.full((2, 4), i)}


def _finite(n: int) -> Iterator[dict[str, torch.Tensor]]:
    yield from itertools.islice(_endless(), n)


def test_close_stops_the_thread_of_an_endless_source_waiting_on_a_full_queue() -> None:
    """The GRPO and pretraining sources never end: the thread sits on a full queue when the loop stops."""
    batches = Prefetcher(_endless(), torch.device("cpu"), depth=2)
    assert int(next(batches)["input_ids"][0, 0]) == 0
    time.sleep(0.3)  # the thread fills the queue and waits on it
    batches.close(timeout_s=10)
    assert not batches._thread.is_alive()  # noqa: SLF001 (the thread is the point of the test)


def test_close_stops_a_thread_blocked_putting_the_end_marker() -> None:
    """A finite source whose end marker waits on a full queue (the loop stopped before reading it)."""
    batches = Prefetcher(_finite(3), torch.device("cpu"), depth=1)
    time.sleep(0.3)
    batches.close(timeout_s=10)
    assert not batches._thread.is_alive()  # noqa: SLF001
