"""Stopping the process groups this project starts (servers, routers) and the tests' own services."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def stop_process_group(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process group led by ``process`` (started with ``start_new_session=True``), then SIGKILL
    whatever is left after ``grace_s``: a child that ignores SIGTERM must not outlive the one who started it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
