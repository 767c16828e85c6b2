"""A canary's traffic through the real HAProxy: the weighted split between the two colours, each request's
outcome read from HAProxy's own log (a Unix datagram socket, nothing in the request path), and the canary's
decision on them; then the roll-back, after which the stable colour takes every request.

The engines are two small HTTP servers on the colours' Unix sockets (the canary answers 500 to every fifth request
and is slower): what is under test is the routing, the log and the decision, not a model."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.services import missing
from support.stand_in_engines import stand_in_engine

from nexa_dagster.core.common.net import free_port
from nexa_dagster.core.serving.canary import CanaryPolicy, CanaryState, decide
from nexa_dagster.core.serving.haproxy import HAProxyRouter, RouterError, haproxy_binary, socket_dir
from nexa_dagster.core.serving.request_log import RequestLogReceiver, RequestOutcome


@pytest.fixture
def router(tmp_path: Path) -> Iterator[tuple[HAProxyRouter, list[RequestOutcome]]]:
    if haproxy_binary() is None:
        missing("haproxy", "scripts/install_services.sh, or: apt-get install haproxy")
    sockets = socket_dir(tmp_path)
    engines = {c: sockets / f"{c}.sock" for c in ("blue", "green")}
    seen: list[RequestOutcome] = []
    receiver = RequestLogReceiver(sockets / "requests.sock", seen.append)
    with (
        receiver,
        stand_in_engine(engines["blue"], "blue", delay_s=0.002),
        stand_in_engine(engines["green"], "green", fail_every=5, delay_s=0.01),
    ):
        proxy = HAProxyRouter(
            tmp_path / "router", free_port(), engines, sockets / "public.sock", request_log=receiver.path
        ).start()
        try:
            proxy.route_to("blue")
            yield proxy, seen
        finally:
            proxy.stop()


def _send(proxy: HAProxyRouter, n: int) -> Counter:
    answered = Counter()
    with httpx.Client(base_url=f"http://127.0.0.1:{proxy.port}", timeout=10) as client:
        for _ in range(n):
            r = client.post("/v1/chat/completions", json={"messages": []})
            answered[(r.headers.get("x-nexa-engine"), r.status_code)] += 1
    return answered


def _wait_for(seen: list[RequestOutcome], n: int) -> None:
    deadline = time.monotonic() + 10
    while len(seen) < n and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_canary_gets_its_share_its_failures_are_logged_and_it_is_rolled_back(router) -> None:
    proxy, seen = router
    assert proxy.split("green", 0.25) == (192, 64)
    answered = _send(proxy, 400)
    _wait_for(seen, 400)
    by_colour = Counter(o.colour for o in seen)
    # round robin over weights 192 and 64: a quarter exactly, give or take the rotation's phase
    assert len(seen) == 400 and abs(by_colour["green"] - 100) <= 2
    failed = Counter(o.colour for o in seen if o.failed)
    assert failed["blue"] == 0 and failed["green"] == by_colour["green"] // 5
    assert answered[("green", 500)] == failed["green"]  # the log says what the callers saw
    served = [o for o in seen if not o.failed]
    assert all(o.first_byte_s is not None and o.total_s >= o.first_byte_s for o in served)
    green_s = sorted(o.total_s for o in served if o.colour == "green")
    assert green_s[len(green_s) // 2] >= 0.01  # the slower engine is timed as slower

    # the canary's decision on what HAProxy logged, checked after every 100 requests as a sensor would: a fifth
    # failing is worse than +2 points
    policy = CanaryPolicy(share=0.25, max_slow_increase=None, max_quality_drop=None)
    state = CanaryState.start("blue-ckpt", "green-ckpt", policy, now=0.0)
    counted, decision = 0, None
    while counted < 3000:
        _wait_for(seen, counted + 100)
        for o in seen[counted:]:
            arm = "canary" if o.colour == "green" else "stable"
            state.record(arm, policy, failed=o.failed, latency_s=o.total_s)
        counted = len(seen)
        decision = decide(state, policy, now=float(counted))
        if decision.verdict != "continue":
            break
        _send(proxy, 100)
    assert decision is not None and decision.verdict == "roll back", decision
    assert decision.reason.startswith("canary worse: failed: ")
    print(f"rolled back after {counted} requests ({state.sequences['canary']['failed'].n} on the canary)")

    proxy.route_to("blue")  # the roll-back: green drains, then is out
    before = len(seen)
    after = _send(proxy, 50)
    _wait_for(seen, before + 50)
    assert after == Counter({("blue", 200): 50})
    assert Counter(o.colour for o in seen[before:]) == Counter({"blue": 50})


def test_a_share_outside_zero_to_one_is_refused_before_anything_changes(router) -> None:
    proxy, _ = router
    for share in (0.0, 1.0, 1.5):
        with pytest.raises(RouterError, match=r"share must be in \(0, 1\)"):
            proxy.split("green", share)
    assert proxy.sessions()["green"]["status"] == "MAINT"
