"""Stand-ins for the serving engines on the colours' Unix sockets: small HTTP servers that answer 200 naming their
colour, 500 to every n-th request where asked, after a delay where asked. For the tests of what sits in front of
the engines (HAProxy's split, its request log, a canary's decision), where a model would only add minutes."""

from __future__ import annotations

import socketserver
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from pathlib import Path


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


@contextmanager
def stand_in_engine(path: Path, colour: str, fail_every: int = 0, delay_s: float = 0.0) -> Iterator[None]:
    """An engine stand-in on ``path``: answers 200 naming its colour; 500 to every ``fail_every``-th request."""
    count = Counter()
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def address_string(self) -> str:  # a Unix socket's peer has no address
            return colour

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("content-length", 0)))
            with lock:
                count["n"] += 1
                n = count["n"]
            time.sleep(delay_s)
            status = 500 if fail_every and n % fail_every == 0 else 200
            body = f'{{"engine": "{colour}"}}'.encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    path.unlink(missing_ok=True)
    server = _UnixHTTPServer(str(path), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
