"""A canary run end to end on the real HAProxy, with a load generator sending requests the whole time: a healthy
canary promoted (every request then to it), a canary failing a fifth of its requests rolled back (every request
then to the stable colour), neither losing a request to the switch; and a runner killed with SIGKILL mid-canary,
resumed by a new process from the saved state, which decides it.

The engines are stand-ins on the colours' sockets (tests/support/stand_in_engines.py): what is under test is the
split, the log, the decision and the routing that follows it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from support.services import missing
from support.stand_in_engines import Load, stand_in_engine

from nexa_dagster.core.common.net import free_port
from nexa_dagster.core.serving.canary import CanaryDecision, CanaryPolicy, CanaryState
from nexa_dagster.core.serving.canary_runner import CanaryRunner
from nexa_dagster.core.serving.canary_store import Canary, load
from nexa_dagster.core.serving.haproxy import HAProxyRouter, haproxy_binary, socket_dir

# failures only: quality needs scored answers and the stand-ins' latency is flat
POLICY = CanaryPolicy(share=0.5, max_slow_increase=None, max_quality_drop=None, max_duration_s=120)


@pytest.fixture
def endpoint(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[HAProxyRouter, Path]]:
    """HAProxy with blue serving and green loaded beside it (``request.param``: green's fail_every, or a pair of
    fail_every and green's delay in seconds, blue's being 1 ms)."""
    fail_every, green_delay_s = request.param if isinstance(request.param, tuple) else (request.param, 0.001)
    if haproxy_binary() is None:
        missing("haproxy", "scripts/install_services.sh, or: apt-get install haproxy")
    sockets = socket_dir(tmp_path)
    engines = {c: sockets / f"{c}.sock" for c in ("blue", "green")}
    log_socket = sockets / "requests.sock"
    with ExitStack() as stack:
        stack.enter_context(stand_in_engine(engines["blue"], "blue", delay_s=0.001))
        stack.enter_context(
            stand_in_engine(engines["green"], "green", fail_every=fail_every, delay_s=green_delay_s)
        )
        proxy = HAProxyRouter(
            tmp_path / "router", free_port(), engines, sockets / "public.sock", request_log=log_socket
        ).start()
        stack.callback(proxy.stop)
        proxy.route_to("blue")
        yield proxy, log_socket


def _canary(policy: CanaryPolicy = POLICY) -> Canary:
    return Canary(
        "blue", "green", policy, CanaryState.start("ckpt-blue", "ckpt-green", policy, now=time.time())
    )


def _decided_under_load(
    proxy: HAProxyRouter, log_socket: Path, folder: Path, policy: CanaryPolicy = POLICY
) -> tuple[CanaryDecision | None, Load]:
    """A canary run by a runner until it decides, clients sending requests all along and a second after."""
    with Load(proxy.port) as load_:
        runner = CanaryRunner(proxy, folder, log_socket, check_every_s=0.5).start(_canary(policy))
        decision = runner.wait(timeout_s=90)
        load_.mark()
        time.sleep(1.0)
    return decision, load_


@pytest.mark.parametrize("endpoint", [0], indirect=True)
def test_a_healthy_canary_is_promoted_on_live_traffic_without_a_failed_request(
    endpoint, tmp_path: Path
) -> None:
    decision, load_ = _decided_under_load(*endpoint, tmp_path / "serving")
    assert decision is not None and decision.verdict == "promote", decision
    saved = load(tmp_path / "serving")
    assert saved.verdict == "promote" and saved.reason == decision.reason
    n = {r.figure: (r.n_stable, r.n_canary) for r in decision.figures}["failed"]
    print(f"promoted after {sum(n)} requests ({n[1]} on the canary)")
    assert load_.errors == [] and all(status == 200 for _, status in load_.answers)
    # every request after the decision to the canary
    assert load_.after and set(load_.after) == {("green", 200)}


@pytest.mark.parametrize("endpoint", [5], indirect=True)
def test_a_failing_canary_is_rolled_back_and_the_stable_colour_takes_every_request(
    endpoint, tmp_path
) -> None:
    decision, load_ = _decided_under_load(*endpoint, tmp_path / "serving")
    assert decision is not None and decision.verdict == "roll back", decision
    assert decision.reason.startswith("canary worse: failed: ")
    assert load(tmp_path / "serving").verdict == "roll back"
    assert load_.errors == []  # the switch back dropped nothing: only the canary's own 500s failed
    assert {engine for (engine, status) in load_.answers if status != 200} == {"green"}
    assert load_.after and set(load_.after) == {("blue", 200)}


@pytest.mark.parametrize("endpoint", [(0, 0.005)], indirect=True)
def test_a_canary_three_times_slower_is_rolled_back_on_its_slow_requests(endpoint, tmp_path) -> None:
    """Blue does 1 ms of work, green 5 ms: through HAProxy about 2 ms against 6 ms a request, three times slower.
    The threshold is derived from the stable's warm-up (twice its median): most green requests are slow, few
    blue ones."""
    policy = CanaryPolicy(share=0.5, max_failure_increase=None, max_quality_drop=None, max_duration_s=120)
    decision, load_ = _decided_under_load(*endpoint, tmp_path / "serving", policy)
    assert decision is not None and decision.verdict == "roll back", decision
    assert decision.reason.startswith("canary worse: slow: "), decision.reason
    slow = {r.figure: r for r in decision.figures}["slow"]
    print(
        f"rolled back after {slow.n_stable + slow.n_canary} timed requests; threshold {slow.threshold_s:.3f} s"
    )
    assert slow.canary_mean > slow.stable_mean + 0.1 and slow.threshold_s is not None
    assert load_.errors == [] and all(status == 200 for _, status in load_.answers)
    assert load_.after and set(load_.after) == {("blue", 200)}


RUNNER = """
import sys, time
from pathlib import Path
from nexa_dagster.core.serving.canary import CanaryState
from nexa_dagster.core.serving.canary_runner import CanaryRunner
from nexa_dagster.core.serving.canary_store import Canary
from nexa_dagster.core.serving.haproxy import HAProxyRouter
work, port, folder, log_socket, mode = sys.argv[1:6]
sockets = Path(log_socket).parent
router = HAProxyRouter(work, int(port), {c: sockets / f"{c}.sock" for c in ("blue", "green")}, sockets / "public.sock")
runner = CanaryRunner(router, Path(folder), Path(log_socket), check_every_s=0.5)
if mode == "start":
    from tests_policy import POLICY
    runner.start(Canary("blue", "green", POLICY, CanaryState.start("ckpt-blue", "ckpt-green", POLICY, now=time.time())))
else:
    assert runner.resume() is not None
print("running", flush=True)
runner.wait(timeout_s=120)
"""


@pytest.mark.parametrize("endpoint", [0], indirect=True)
def test_a_runner_killed_mid_canary_is_resumed_by_a_new_process_from_its_saved_state(
    endpoint, tmp_path
) -> None:
    proxy, log_socket = endpoint
    folder = tmp_path / "serving"
    (tmp_path / "tests_policy.py").write_text(
        "from nexa_dagster.core.serving.canary import CanaryPolicy\n"
        f"POLICY = CanaryPolicy.model_validate_json({POLICY.model_dump_json()!r})\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    args = [str(tmp_path / "router"), str(proxy.port), str(folder), str(log_socket)]

    def runner(mode: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", RUNNER, *args, mode], env=env, stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "running"
        return proc

    with Load(proxy.port) as load_:
        first = runner("start")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until a check has saved some of the canary's requests
            saved = load(folder)
            if saved.state.sequences["canary"]["failed"].n >= 20:
                break
            time.sleep(0.2)
        first.send_signal(signal.SIGKILL)
        first.wait()
        before = load(folder)
        assert before.running and before.state.sequences["canary"]["failed"].n >= 20
        second = runner("resume")
        assert second.wait(timeout=120) == 0
    after = load(folder)
    assert after.verdict == "promote", after.reason
    # the resumed canary went on from the saved sums: it counted at least what the first had saved
    assert after.state.sequences["canary"]["failed"].n > before.state.sequences["canary"]["failed"].n
    assert load_.errors == []
    assert json.loads((folder / "canary.json").read_text())["verdict"] == "promote"
