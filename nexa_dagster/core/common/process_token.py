"""Name a process so that a later process can tell whether it is still alive, even after its pid is reused.

``make run`` executes its jobs in its own process; killed with ``kill -9`` it cannot record the end of its run,
which would stay STARTED in the instance forever (no daemon watches in-process runs). Each run it starts carries
this token as a tag, and the next ``make run`` fails the STARTED runs whose process is gone.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path


def _start_ticks(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), ``None`` if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the fields after "(comm)": state is field 3, starttime field 22
    return None if fields[0] in ("Z", "X") else fields[19]  # a zombie has ended; only its exit is not reaped


def process_token(pid: int | None = None) -> str:
    """``host:pid:start`` of ``pid`` (default: this process)."""
    pid = pid or os.getpid()
    return f"{socket.gethostname()}:{pid}:{_start_ticks(pid) or ''}"


def token_alive(token: str) -> bool | None:
    """Whether the process named by ``token`` still runs: ``None`` when it ran on another host (cannot tell)."""
    host, _, rest = token.partition(":")
    pid_text, _, start = rest.partition(":")
    if host != socket.gethostname() or not pid_text.isdigit():
        return None
    now = _start_ticks(int(pid_text))
    return now is not None and (not start or now == start)  # the same pid started later is another process
