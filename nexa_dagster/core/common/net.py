"""Local networking helpers shared by the processes this project starts (servers, training ranks, test services)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback port that is free now. Whoever binds it a moment later may lose a race; callers that start
    servers retry with a new port (``ManagedServer.start``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
