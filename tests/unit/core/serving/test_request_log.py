"""Reading a request's outcome from HAProxy's log line: served with its times, failed (5xx, no answer, a stream
cut by the server side), or not counted (the client went away, or no engine served it); and the configuration that
makes HAProxy write those lines, only where asked."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from nexa_dagster.core.serving.haproxy import render_config
from nexa_dagster.core.serving.request_log import LOG_FORMAT, Exchange, RequestOutcome, parse

_B64_REQ = base64.b64encode(b'{"prompt": "q"}').decode()
_B64_ANS = base64.b64encode(b'{"choices": []}').decode()


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("nexa-request green 200 35 1200 ----", RequestOutcome("green", 200, False, 0.035, 1.2)),
        ("<134>Dec  2 nexa-request blue 200 4 9 --NI", RequestOutcome("blue", 200, False, 0.004, 0.009)),
        ("nexa-request green 503 12 12 ----", RequestOutcome("green", 503, True, None, None)),
        ("nexa-request green -1 -1 30000 sC--", RequestOutcome("green", -1, True, None, None)),
        ("nexa-request blue 200 40 900 SD--", RequestOutcome("blue", 200, True, None, None)),  # a cut stream
        ("nexa-request blue 200 40 900 CD--", None),  # the client went away mid-answer
        ("nexa-request <NOSRV> 401 -1 0 PR--", None),  # refused at the door (a wrong key)
        ("[WARNING] (1) : Proxy engines started.", None),
        # a kept exchange (base64 bodies), one not kept, one whose bodies are not base64 (not scored, still counted)
        (
            f"nexa-request blue 200 4 9 ---- {_B64_REQ} {_B64_ANS}",
            RequestOutcome(
                "blue", 200, False, 0.004, 0.009, Exchange(b'{"prompt": "q"}', b'{"choices": []}')
            ),
        ),
        ("nexa-request blue 200 4 9 ---- - -", RequestOutcome("blue", 200, False, 0.004, 0.009)),
        ("nexa-request blue 200 4 9 ---- not!base64 -", RequestOutcome("blue", 200, False, 0.004, 0.009)),
        (
            f"nexa-request green 503 4 9 ---- {_B64_REQ} {_B64_ANS}",
            RequestOutcome("green", 503, True, None, None),
        ),
    ],
)
def test_a_log_line_is_an_outcome_or_nothing(line: str, expected: RequestOutcome | None) -> None:
    assert parse(line) == expected


def test_haproxy_logs_each_request_to_the_socket_only_when_asked(tmp_path: Path) -> None:
    sockets = {c: tmp_path / f"{c}.sock" for c in ("blue", "green")}
    args = (8000, sockets, tmp_path / "public.sock", tmp_path / "haproxy.sock")
    logged = render_config(*args, request_log=tmp_path / "requests.sock")
    assert f"log {tmp_path / 'requests.sock'} len 65535 format raw local0" in logged
    assert f'log-format "{LOG_FORMAT}"' in logged
    # answers are kept at the rate the map file holds (0 until a canary scores answers), streams never
    assert f"map_str_int({tmp_path / 'sample.map'},0)" in render_config(
        *args, request_log=tmp_path / "requests.sock", sample_map=tmp_path / "sample.map"
    )
    assert "!{ res.hdr(content-type) -m beg text/event-stream }" in logged
    assert "log " not in render_config(*args)
