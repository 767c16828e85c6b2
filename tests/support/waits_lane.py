"""A third pytest-xdist worker for the tests that wait: `pytest -n 3 --dist loadgroup -p support.waits_lane`.

Some tests spend most of their time waiting on a clock that is not theirs: slurmctld's 30-s time-limit checks, a
retry policy's delays. On two workers for two cores, such a test holds a worker while its core idles (the suite's
cores were 10-15 % idle, docs/testing.md "The slowest tests"). A plain third worker fills that idle core and pays it
back in contention: every test ran 1.44x slower. This scheduler gives the third worker (the lane) the waiting tests
only, and the other two everything else, so the waits overlap the computing tests at the cost of the little CPU the
waiting tests use.

Which tests wait is said where they are: the ``waits`` marker (``tests/conftest.py`` turns it into the xdist group
``waits``, and gives it to every test of the Slurm cluster), so a lane's work unit is an xdist group whose name has
``waits`` among its ``_``-joined parts (pytest-xdist joins a test's several groups with ``_``). With fewer than
three workers, or another ``--dist``, it schedules as ``--dist loadgroup`` does.
"""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadGroupScheduling
from xdist.workermanage import WorkerController

WAITS = "waits"  # the group name of the tests that wait (tests/conftest.py)


def waits(nodeid: str) -> bool:
    """Whether a node id is in a group named ``waits`` (pytest-xdist appends ``@<groups joined by _>``)."""
    return "@" in nodeid and WAITS in nodeid.rsplit("@", 1)[1].split("_")


class WaitsLaneScheduling(LoadGroupScheduling):
    """``--dist loadgroup`` with the highest-numbered worker kept for the work units that wait."""

    def _lane(self) -> WorkerController | None:
        """The lane's worker (the last, ``gw<n-1>``), or None: fewer than three workers, or the lane is gone (a
        crash), when any worker takes any unit so that nothing is left unrun."""
        lane = f"gw{self.numnodes - 1}"
        return next((n for n in self.nodes if n.gateway.id == lane), None) if self.numnodes >= 3 else None

    def _next_scope(self, node: WorkerController) -> str | None:
        """The first unit in the queue this worker may take: the lane, those that wait; the others, the rest."""
        lane = self._lane()
        for scope, unit in self.workqueue.items():
            if lane is None or waits(next(iter(unit))) == (node is lane):
                return scope
        return None

    def _assign_work_unit(self, node: WorkerController) -> None:
        scope = self._next_scope(node)
        if scope is None:  # nothing left for this worker: it finishes what it has, then stops
            node.shutdown()
            return
        self.workqueue.move_to_end(scope, last=False)  # pytest-xdist's own assignment takes the queue's first
        super()._assign_work_unit(node)

    def _reschedule(self, node: WorkerController) -> None:
        if not node.shutting_down and self._next_scope(node) is None:
            node.shutdown()  # pytest-xdist's stops a worker only once the whole queue is empty
            return
        super()._reschedule(node)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> LoadGroupScheduling | None:
    """The lane's scheduler under ``--dist loadgroup``; pytest-xdist's own otherwise."""
    if config.getvalue("dist") != "loadgroup":
        return None
    return WaitsLaneScheduling(config, log)  # type: ignore[arg-type]
