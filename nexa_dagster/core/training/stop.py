"""Stopping a training on request with its state saved: the flag the worker's SIGTERM handler sets, and what the
loop raises once every rank has saved. Plain Python (no torch), so the launcher can import it."""

from __future__ import annotations

import threading

STOP = threading.Event()  # set by the worker's SIGTERM handler; read at the next step by every rank together


class StopRequested(Exception):  # noqa: N818 (not an error: the run was asked to stop and saved its state)
    """Raised out of ``train`` after every rank saved its resumable state because a stop was requested (SIGTERM:
    Slurm's warning before the time limit, a preempted node, a deleted pod); a relaunch resumes from ``step``."""

    def __init__(self, step: int) -> None:
        super().__init__(
            f"stopped after step {step} on request; its resumable state is saved, a relaunch resumes from it"
        )
        self.step = step
