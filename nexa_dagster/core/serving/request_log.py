"""Each request's outcome per engine colour, read from HAProxy's own log: what a canary watches, collected without
anything in the path a request takes (HAProxy sends one line a request to a Unix datagram socket; a thread reads).

HAProxy logs every request the engines backend answers in ``LOG_FORMAT``: the tag, the server (the colour), the
status, the time to the response's headers and the whole request's time (milliseconds), and the termination state
(two letters: who ended the session, and at which stage; ``--`` a normal end). A request is

- *failed* when the engine answered 5xx, gave no answer (status -1: refused, reset, timed out), or the session was
  ended by the server side or the proxy while the answer was on its way (a cut stream: the first letter ``S``,
  ``P``, ``R``, ``I``, ``D`` or ``K``);
- *not counted* when the client ended it (``C``: the caller went away, not the engine's doing) or no engine
  served it (``<NOSRV>``: refused at the door, e.g. a wrong API key);
- else *served*, with its seconds to the response's headers (for a streamed answer, about the time to its first
  token: the engines send headers with the first chunk) and in all; and, where HAProxy kept it to be scored (a
  sample, while a canary watches quality), the request's body and its answer's (``Exchange``).
"""

from __future__ import annotations

import base64
import binascii
import re
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

TAG = "nexa-request"
# the frontend's log format (HAProxy's log-format variables: %s server, %ST status, %Tr response time, %Ta active
# time, %tsc termination state with cookie flags; then a kept request's body and its answer's, in base64, "-" when
# not kept: haproxy.request_logging)
LOG_FORMAT = f"{TAG} %s %ST %Tr %Ta %tsc %[var(txn.qreq)] %[var(txn.qres)]"
_LINE = re.compile(
    rf"{TAG} (?P<server>\S+) (?P<status>-?\d+) (?P<tr>-?\d+) (?P<ta>-?\d+) (?P<tsc>\S+)"
    r"(?: (?P<request>\S+) (?P<answer>\S+))?"
)
SERVER_SIDE_ENDS = frozenset("SPRIDK")  # termination codes of a session the client did not end


@dataclass(frozen=True)
class RequestOutcome:
    colour: str
    status: int
    failed: bool
    first_byte_s: float | None  # None: no answer, or failed
    total_s: float | None
    exchange: Exchange | None = None  # the request and its answer, where HAProxy kept them to be scored


@dataclass(frozen=True)
class Exchange:
    """A kept request's body and its answer's (bytes as sent; either may be cut at HAProxy's buffer)."""

    request: bytes
    answer: bytes


def _exchange(request: str | None, answer: str | None) -> Exchange | None:
    """The bodies of a kept request, or None when not kept (``-``) or not readable as base64."""
    if not request or not answer or request == "-" or answer == "-":
        return None
    try:
        return Exchange(base64.b64decode(request, validate=True), base64.b64decode(answer, validate=True))
    except binascii.Error:
        return None


def parse(line: str) -> RequestOutcome | None:
    """The outcome logged on ``line``, or None for a line that is not a request of an engine, or one not counted."""
    m = _LINE.search(line)
    if m is None or m["server"] == "<NOSRV>":
        return None
    status, tr, ta, tsc = int(m["status"]), int(m["tr"]), int(m["ta"]), m["tsc"]
    ended_by = tsc[0]
    if ended_by == "C":
        return None
    failed = status >= 500 or status < 0 or ended_by in SERVER_SIDE_ENDS
    if failed:
        return RequestOutcome(m["server"], status, True, None, None)
    return RequestOutcome(
        m["server"],
        status,
        False,
        tr / 1000 if tr >= 0 else None,
        ta / 1000 if ta >= 0 else None,
        _exchange(m["request"], m["answer"]),
    )


class RequestLogReceiver:
    """The Unix datagram socket HAProxy sends its request lines to (``log <path> format raw``): each line parsed and
    handed to ``on_outcome`` on a thread of its own. A datagram socket, not a file: nothing grows on disk on an
    endpoint that serves for months, and when nothing reads (no canary) HAProxy's sends are dropped, never queued in
    front of a request."""

    def __init__(self, path: Path, on_outcome: Callable[[RequestOutcome], None]) -> None:
        self.path, self.on_outcome = path, on_outcome
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> RequestLogReceiver:
        self.path.unlink(missing_ok=True)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(self.path))
        self._sock.settimeout(0.2)
        self._thread = threading.Thread(target=self._receive, name="request-log", daemon=True)
        self._thread.start()
        return self

    def _receive(self) -> None:
        while (sock := self._sock) is not None:
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:  # closed by stop()
                return
            for line in data.decode(errors="replace").splitlines():
                if (outcome := parse(line)) is not None:
                    self.on_outcome(outcome)

    def stop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> RequestLogReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
