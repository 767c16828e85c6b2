"""Stand-ins for the serving engines on the colours' Unix sockets: small HTTP servers that answer 200 naming their
colour, 500 to every n-th request where asked, after a delay where asked. For the tests of what sits in front of
the engines (HAProxy's split, its request log, a canary's decision), where a model would only add minutes."""

from __future__ import annotations

import json
import socketserver
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx

from nexa_dagster.core.common.net import free_port
from nexa_dagster.core.serving.haproxy import HAProxyRouter


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


@contextmanager
def stand_in_engine(
    path: Path,
    colour: str,
    fail_every: int = 0,
    delay_s: float = 0.0,
    answer: Callable[[dict[str, Any]], str] | None = None,
) -> Iterator[None]:
    """An engine stand-in on ``path``: answers 200 naming its colour (with ``answer``: a chat completion whose text
    is ``answer(request)``); 500 to every ``fail_every``-th request."""
    count = Counter()
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def address_string(self) -> str:  # a Unix socket's peer has no address
            return colour

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

        def do_POST(self) -> None:  # noqa: N802
            request = self.rfile.read(int(self.headers.get("content-length", 0)))
            with lock:
                count["n"] += 1
                n = count["n"]
            time.sleep(delay_s)
            status = 500 if fail_every and n % fail_every == 0 else 200
            body = (
                f'{{"engine": "{colour}"}}'.encode()
                if answer is None
                else json.dumps(
                    {"choices": [{"message": {"role": "assistant", "content": answer(json.loads(request))}}]}
                ).encode()
            )
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


class Load:
    """A client sending requests one after another until stopped (bounded: at most ``limit`` requests), counting
    (engine, status) and transport errors. ``body(i)``: the i-th request's JSON (default: an empty chat).
    ``timeout_s``: how long one request may take before it counts as an error."""

    def __init__(
        self,
        port: int,
        limit: int = 20000,
        body: Callable[[int], dict[str, Any]] | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self.port, self.limit, self.timeout_s = port, limit, timeout_s
        self.body = body or (lambda i: {"messages": []})
        self.answers: Counter = Counter()
        self.errors: list[str] = []
        self.after: Counter = Counter()  # answers after mark()
        self._marked = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=self.timeout_s) as client:
            for i in range(self.limit):
                if self._stop.is_set():
                    return
                try:
                    r = client.post("/v1/chat/completions", json=self.body(i))
                    key = (r.headers.get("x-nexa-engine"), r.status_code)
                    self.answers[key] += 1
                    if self._marked:
                        self.after[key] += 1
                except httpx.HTTPError as e:
                    self.errors.append(repr(e))

    def mark(self) -> None:
        self._marked = True

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=20)


def router_on_blue(stack: ExitStack, tmp_path: Path, engines: dict[str, Path]) -> tuple[HAProxyRouter, Path]:
    """HAProxy in front of the colours' sockets with its request log on, every request to blue, stopped with
    ``stack``: the router and its log socket (beside the engines' sockets)."""
    sockets = next(iter(engines.values())).parent
    proxy = HAProxyRouter(
        tmp_path / "router",
        free_port(),
        engines,
        sockets / "public.sock",
        request_log=sockets / "requests.sock",
    ).start()
    stack.callback(proxy.stop)
    proxy.route_to("blue")
    return proxy, sockets / "requests.sock"
