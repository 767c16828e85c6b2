"""A server started at a lower CPU priority: the exec wrapper lowers it before the server's first instruction, for
every thread it will start; the real process's nice value is read back from /proc (Linux)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nexa_dagster.core.llm.managed_server import with_parent_death_signal

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="nice values per thread and /proc: Linux")


def _nice(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


@pytest.mark.parametrize("increment", [0, 7])
def test_the_wrapper_starts_the_command_at_the_given_nice_increment(increment: int) -> None:
    # the command reports its own nice once it runs: lowered before exec, so what runs never ran at the old one
    code = "import os; print(os.getpriority(os.PRIO_PROCESS, 0), flush=True)"
    proc = subprocess.run(
        with_parent_death_signal([sys.executable, "-c", code], nice=increment),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + increment)


def test_a_long_running_command_keeps_it() -> None:
    proc = subprocess.Popen(with_parent_death_signal(["/bin/sleep", "30"], nice=5))
    try:
        expected = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 5)
        for _ in range(100):  # until the wrapper has exec'd sleep
            if Path(f"/proc/{proc.pid}/cmdline").read_bytes().startswith(b"/bin/sleep"):
                break
            time.sleep(0.05)
        assert _nice(proc.pid) == expected
    finally:
        proc.kill()
        proc.wait()
