"""A tiny OpenAI-shaped HTTP endpoint on 127.0.0.1 (stdlib ``http.server`` in a thread) whose answers a test scripts.

Used where a real engine cannot be had offline on a CPU: an engine that honours ``logprobs`` (vLLM's shape), one
that rejects it with 400, a flaky one (503, 429 with ``Retry-After``, a dropped connection), a wrong key.
``reply(call_number, body)`` returns ``(status, json)``, ``(status, json, headers)`` or ``DROP`` (close the
connection without an answer). Every request body is recorded with the time it arrived.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

DROP = "drop"
Reply = Callable[[int, dict[str, Any]], Any]


class _Stub(BaseHTTPRequestHandler):
    reply: Reply
    calls: list[dict[str, Any]]
    times: list[float]
    lock: threading.Lock

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        with self.lock:
            self.calls.append(body)
            self.times.append(time.monotonic())
            n = len(self.calls)
        answer = type(self).reply(n, body)
        if answer == DROP:
            self.close_connection = True
            self.connection.shutdown(2)  # the client sees the connection dropped mid-request
            return
        status, payload, headers = (*answer, {}) if len(answer) == 2 else answer
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        """``/health`` answers 200, as a real engine's does (what a load balancer's health check asks)."""
        self.send_response(200 if self.path.rstrip("/").endswith("/health") else 404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def stub_server(reply: Reply) -> Iterator[tuple[str, list[dict[str, Any]], list[float]]]:
    """``(base_url, calls, arrival_times)`` of a running stub; stopped when the block exits."""
    handler = type(
        "Handler",
        (_Stub,),
        {"reply": staticmethod(reply), "calls": [], "times": [], "lock": threading.Lock()},
    )
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/v1", handler.calls, handler.times
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def chat_payload(content: str, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "id": "x",
        "object": "chat.completion",
        "created": 0,
        "model": "stub",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "logprobs": logprobs,
                "message": {"role": "assistant", "content": content},
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }


def json_judge(verdict: dict[str, Any] | None = None, logprobs: int = 200, json_schema: int = 200) -> Reply:
    """An engine that answers the capability probes (``logprobs``/``response_format`` honoured, or refused with the
    given status) and every verdict request with ``verdict``."""
    verdict = verdict or {"score": 4, "rationale": "clear and correct"}

    def reply(n: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if body.get("logprobs"):
            if logprobs != 200:
                return logprobs, {"error": {"message": "logprobs is not supported by this engine"}}
            return 200, chat_payload("1")  # ignored: no logprobs in the answer
        if body.get("response_format"):
            if json_schema != 200:
                return json_schema, {"error": {"message": "response_format is not supported"}}
            name = body["response_format"]["json_schema"]["name"]
            return 200, chat_payload(json.dumps({"ok": True} if name == "probe" else verdict))
        return 200, chat_payload(json.dumps(verdict))

    return reply
