"""The suite's process lookup (tests/support/services.py) skips a child that has exited but is not yet reaped.

A switch stops its old engine while a test polls the service's children; psutil raises on a zombie's command
line, and the lookup once failed a serving test that way (CI, 2026-11-26)."""

import os
import subprocess
import sys
import time

import psutil
from support.services import descendants_matching


def test_an_exited_unreaped_child_is_skipped_and_a_running_one_is_found() -> None:
    marker = "nexa-process-lookup-probe"
    running = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(60)  # {marker}"])
    exited = subprocess.Popen([sys.executable, "-c", f"pass  # {marker}"])
    try:
        deadline = time.monotonic() + 30
        while psutil.Process(exited.pid).status() != psutil.STATUS_ZOMBIE:  # exited, not yet waited for
            assert time.monotonic() < deadline
            time.sleep(0.05)
        found = descendants_matching(os.getpid(), marker)
        assert [p.pid for p in found] == [running.pid]
        assert descendants_matching(os.getpid(), marker, excluding=("sleep",)) == []
    finally:
        running.kill()
        running.wait()
        exited.wait()
