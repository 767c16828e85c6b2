"""A guard on `pytest -n 2 --dist loadgroup`: every test marked ``xdist_group`` must really be grouped.

The groups carry the suite's time budget and its correctness: one worker builds the module-scoped lifecycle
(minutes) instead of each worker building its own, and one worker owns the session's PostgreSQL server and Slurm
cluster. pytest-xdist groups a test by appending ``@<group>`` to its node id; when a pytest release changes how node
ids are stored (9.2 did), the marks are dropped without a word and the suite quietly runs minutes longer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class _Item(Protocol):
    nodeid: str

    def iter_markers(self, name: str) -> Iterable[object]: ...


def ungrouped(items: Iterable[_Item]) -> list[str]:
    """Node ids of tests marked ``xdist_group`` that pytest-xdist did not put in a group."""
    return [
        item.nodeid
        for item in items
        if any(True for _ in item.iter_markers("xdist_group")) and "@" not in item.nodeid.rsplit("]", 1)[-1]
    ]
