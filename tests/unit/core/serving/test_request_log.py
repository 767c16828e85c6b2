"""Reading a request's outcome from HAProxy's log line: served with its times, failed (5xx, no answer, a stream
cut by the server side), or not counted (the client went away, or no engine served it); and the configuration that
makes HAProxy write those lines, only where asked."""

from __future__ import annotations

from pathlib import Path

import pytest

from nexa_dagster.core.serving.haproxy import render_config
from nexa_dagster.core.serving.request_log import LOG_FORMAT, RequestOutcome, parse


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
    ],
)
def test_a_log_line_is_an_outcome_or_nothing(line: str, expected: RequestOutcome | None) -> None:
    assert parse(line) == expected


def test_haproxy_logs_each_request_to_the_socket_only_when_asked(tmp_path: Path) -> None:
    sockets = {c: tmp_path / f"{c}.sock" for c in ("blue", "green")}
    args = (8000, sockets, tmp_path / "public.sock", tmp_path / "haproxy.sock")
    logged = render_config(*args, request_log=tmp_path / "requests.sock")
    assert f"log {tmp_path / 'requests.sock'} format raw local0" in logged
    assert f'log-format "{LOG_FORMAT}"' in logged
    assert "log " not in render_config(*args)
