"""Serving a checkpoint without the serving service: a real server comes up, answers a smoke request whose answer
must be text, and is gone afterwards; `nexa-dagster rollback` with nothing to roll back to says so in one line.
(The serving service itself: tests/test_serving_endpoint.py.)"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from support.services import child_processes_matching

from nexa_dagster.core.cluster import warm_python
from nexa_dagster.core.common.config import REPO_ROOT
from nexa_dagster.core.common.spans import PATTERN
from nexa_dagster.core.llm.managed_server import ManagedServer
from nexa_dagster.core.serving.answer_check import text_problem
from nexa_dagster.core.serving.haproxy import socket_dir
from nexa_dagster.core.serving.smoke import DeploymentManifest, smoke_request, smoke_test_in_temporary_engine
from nexa_dagster.resources.gpu_cluster.local import LocalGPUCluster


def test_a_smoke_test_in_a_temporary_engine_writes_a_manifest_and_stops_the_engine(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine has no key, so it has no TCP port either: a Unix socket in a folder of mode 700 (no other user
    reaches it), listened on while it ran, gone afterwards with the engine. Its log says what the engine cost
    apart from the request (the spans bench/pipeline_profile.py splits a deployment by)."""
    before = {p.pid for p in child_processes_matching("serve")}  # a session fixture's server may run already
    logger = logging.getLogger("test-smoke-spans")
    caplog.set_level(logging.INFO, logger=logger.name)
    seen: list[tuple[set[tuple[str, int]], int]] = []
    stop = threading.Event()

    def watch() -> None:  # the engine's TCP listeners and its socket folder's mode, while it runs
        while not stop.wait(0.2):
            for p in child_processes_matching("serve"):
                if p.pid not in before:
                    with contextlib.suppress(psutil.Error):
                        tcp = {
                            (c.laddr.ip, c.laddr.port)
                            for c in p.net_connections("inet")
                            if c.status == "LISTEN"
                        }
                        seen.append((tcp, (tmp_path / "sockets").stat().st_mode & 0o777))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        manifest = smoke_test_in_temporary_engine(
            tiny_model_dir, "tiny", tmp_path, max_tokens=16, logger=logger
        )
    finally:
        stop.set()
        watcher.join()
    lines = [r.getMessage() for r in caplog.records if r.name == logger.name]
    spans = {m["kind"] + "/" + m["name"]: float(m["seconds"]) for m in map(PATTERN.match, lines) if m}
    assert spans.keys() == {"fixed/smoke_engine_start", "work/smoke_request", "fixed/smoke_engine_stop"}, (
        lines
    )
    # the start span holds the engine's whole start to healthy, the request's span the request (a span line has
    # three decimals)
    assert spans["fixed/smoke_engine_start"] + 1e-3 >= manifest.ready_s > 0, (spans, manifest.ready_s)
    assert spans["work/smoke_request"] + 1e-3 >= manifest.smoke_latency_s > 0, (
        spans,
        manifest.smoke_latency_s,
    )
    stored = DeploymentManifest.model_validate(json.loads((tmp_path / "deployment.json").read_text()))
    assert stored == manifest
    assert manifest.engine == "transformers" and manifest.status == "ok" and manifest.error is None
    assert text_problem(manifest.smoke_response) is None and 0 < manifest.completion_tokens <= 16
    assert manifest.smoke_latency_s > 0 and manifest.ready_s > 0
    assert manifest.started_at <= manifest.stopped_at
    assert manifest.model_name == str(tiny_model_dir.resolve())
    assert manifest.socket == str(tmp_path / "sockets" / "smoke.sock")
    assert not (tmp_path / "sockets").exists()  # the socket and its folder go with the engine
    assert seen and all(tcp == set() and mode == 0o700 for tcp, mode in seen), seen
    leftovers = [p for p in child_processes_matching("serve") if p.pid not in before]
    assert not leftovers, [p.cmdline() for p in leftovers]
    assert not list(tmp_path.glob(".*.tmp"))  # the manifest was written under a temporary name, then renamed
    log = Path(manifest.log_path)
    assert log == tmp_path / "transformers-serve-smoke.log" and "serve" in log.read_text()


def _gone(processes: list[psutil.Process], timeout_s: float = 30.0) -> list[psutil.Process]:
    """Those of ``processes`` still running (not a zombie) after up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def test_a_smoke_engine_forked_from_the_warm_python_answers_stops_and_dies_with_it(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`make run` forks each deployment's smoke engine from the warm Python its workers fork from (the server's
    imports paid once: docs/measurements.md). Forked, it must still be the engine a cold start is: started under
    the environment make run's warm Python has (not refused for a difference, which would quietly give the seconds
    back), it answers the smoke request on its socket; its stop takes the model's process `transformers serve`
    started (forked from the engine in turn, transformers_engine.py); and a killed warm Python (its launcher
    killed) leaves neither behind."""
    cluster = (
        LocalGPUCluster()
    )  # the warm Python's environment, as LocalGPUCluster(warm_start=True) starts it
    env = warm_python.import_time_environment(cluster.worker_env("training", cluster.launch_env()))
    serving_only = ("uvicorn", "transformers.cli.serve", "transformers.processing_utils")
    warm = warm_python.WarmPython(sys.executable, env, serving_only).start()
    logger = logging.getLogger("test-warm-engine")
    caplog.set_level(logging.INFO, logger=logger.name)
    try:
        assert warm.ready() and warm.process is not None
        for round_ in ("stopped", "orphaned"):
            server = ManagedServer(
                tiny_model_dir,
                tmp_path / round_,
                socket_path=socket_dir(tmp_path) / f"{round_}.sock",
                warm=warm,
                logger=logger,
            )
            server.start()
            try:
                assert server.pid is not None
                engine = psutil.Process(server.pid)
                assert engine.ppid() == warm.process.pid and os.getsid(engine.pid) == engine.pid
                answer = smoke_request(
                    server.base_url, server.model_name, max_tokens=8, uds=server.socket_path
                )
                assert answer.ok, answer
                processes = [engine, *engine.children(recursive=True)]  # the model's process among them
                # forked from the engine (its command line; spawned, it would be multiprocessing's spawn_main)
                assert [p for p in engine.children() if p.cmdline() == engine.cmdline()], processes
                assert "model process forked from the engine" in server.log_path.read_text()
                if round_ == "orphaned":
                    os.kill(warm.process.pid, signal.SIGKILL)
                else:
                    server.stop()
                    assert warm.process.poll() is None  # the warm Python is not the engine's group
                alive = _gone(processes)
                assert not alive, [(p.pid, p.cmdline()) for p in alive]
            finally:
                server.stop()
    finally:
        warm.close()
    said = [r.getMessage() for r in caplog.records if r.name == logger.name]
    assert sum("engine forked from the warm Python" in m for m in said) == 2, said
    assert not [m for m in said if "cold" in m], said


def test_an_answer_of_replacement_characters_is_not_text() -> None:
    """The smoke test's bar (what a tiny model's untrained answer looked like, and what passed as `ok`)."""
    assert text_problem("A list comprehension builds a list from an iterable.") is None
    assert text_problem('converted added "** integers SUITEpro~~lass B se\ufffd') is None  # a few stray bytes
    soup = "\ufffd\ufffd \ufffd\ufffd\ufffd a\ufffd\ufffd"
    assert "does not decode to text" in (text_problem(soup) or "")
    assert text_problem("   ") == "the answer is empty"
    assert "no letter" in (text_problem("12 34 !!") or "")


def test_rollback_with_nothing_to_roll_back_to_is_one_clear_line(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "NEXA_DATA_ROOT": str(tmp_path / "data"),
        "NEXA_RESULTS_ROOT": str(tmp_path / "results"),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "nexa_dagster.cli", "rollback"],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"nothing to roll back to: there is no production model yet ({tmp_path}/data/serving/production.json)"
    ]
    assert "Traceback" not in proc.stderr + proc.stdout


def test_the_router_starts_in_a_data_root_too_deep_for_a_unix_socket_beside_it(tmp_path: Path) -> None:
    """A data root moved or restored under a long path: HAProxy refuses an admin socket path longer than 97
    characters (and the kernel one longer than 107), so `make serve` could not start there. The router's socket
    then lives under a short name in the temporary directory, and is gone once the router stops."""
    from support.services import missing

    from nexa_dagster.core.common.net import free_port
    from nexa_dagster.core.serving.haproxy import HAProxyRouter, haproxy_binary, socket_dir

    if haproxy_binary() is None:
        missing("haproxy", "scripts/install_services.sh, or: apt-get install haproxy")
    deep = tmp_path / "restored-from-the-nightly-backup" / "of-the-lab" / "data" / "serving" / "router"
    assert len(str(deep / "haproxy.sock")) > 108
    sockets = socket_dir(deep.parent)  # the engines' and the public routes' sockets: short, private
    assert len(str(sockets / "public.sock")) <= 96 and sockets.stat().st_mode & 0o777 == 0o700
    router = HAProxyRouter(
        deep, free_port(), {c: sockets / f"{c}.sock" for c in ("blue", "green")}, sockets / "public.sock"
    ).start()
    try:
        assert "Name: HAProxy" in router.command("show info")
    finally:
        router.stop()
    assert not router.admin_socket.exists()
