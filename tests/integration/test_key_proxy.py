"""The key proxy of a Kubernetes serving pod (deploy/k8s/serving.yaml), started for real as the pod runs it
(`nexa-dagster key-proxy`: HAProxy asking for the API key on every route), in front of an engine on loopback.

The engine is a stand-in that answers 200 to every path and records the headers it got: what matters is which
requests reach it. vLLM answers `/invocations`, `/tokenize`, `/metrics` without its key (`--api-key` guards `/v1`
only); behind the proxy none of them, nor any other route, is reached without the key. The key comes from a file
only, is rotated without a restart (the file changed in place: read at once on SIGHUP, else within `--watch-s`), and
a weak key written meanwhile changes nothing.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import psutil
import pytest
from support.services import free_port, missing

from nexa_dagster.core.common.config import REPO_ROOT
from nexa_dagster.core.common.processes import stop_process_group
from nexa_dagster.core.serving.haproxy import haproxy_binary

KEY, NEW_KEY = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
# what vLLM serves beside /v1, which its own key does not guard; and the rest
ROUTES = ("/invocations", "/tokenize", "/detokenize", "/metrics", "/health", "/v1/models", "/", "/anything")


@dataclass
class Pod:
    port: int
    key_file: Path
    log: Path
    proc: subprocess.Popen[bytes]
    seen: list[dict[str, str]] = field(default_factory=list)  # the engine's requests' headers

    @property
    def url(self) -> str:
        return f"http://127.0.0.2:{self.port}"

    def get(self, path: str, key: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(self.url + path, headers=headers, timeout=30)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def wait_log(self, said: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while said not in self.log_tail():
            assert time.monotonic() < deadline and self.proc.poll() is None, self.log_tail()
            time.sleep(0.1)


def _engine(seen: list[dict[str, str]]) -> ThreadingHTTPServer:
    class Engine(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _answer(self) -> None:
            seen.append({k.lower(): v for k, v in self.headers.items()})
            body = json.dumps({"path": self.path}).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer  # noqa: N815 - http.server's naming

    server = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    if haproxy_binary() is None:
        missing("haproxy", "scripts/install_services.sh, or: apt-get install haproxy")
    root = tmp_path_factory.mktemp("pod")
    key_file = root / "api-key"
    key_file.write_text(f"{KEY}\n")
    key_file.chmod(0o600)
    seen: list[dict[str, str]] = []
    engine = _engine(seen)
    port, log = free_port(), root / "key-proxy.log"
    command = ["key-proxy", "--host", "127.0.0.2", "--port", str(port), "--work-dir", str(root / "proxy")]
    command += ["--upstream", f"127.0.0.1:{engine.server_address[1]}", "--watch-s", "0.5"]
    env = {**os.environ, "NEXA_SERVING_API_KEY_FILE": str(key_file)}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nexa_dagster.cli", *command],
            env=env,
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    p = Pod(port, key_file, log, proc, seen)
    deadline = time.monotonic() + 120
    while True:
        try:
            p.get("/health")
            break
        except httpx.HTTPError:
            assert proc.poll() is None and time.monotonic() < deadline, p.log_tail()
            time.sleep(0.2)
    yield p
    stop_process_group(proc)
    engine.shutdown()


def test_every_route_wants_the_key_and_the_engine_never_sees_it(pod: Pod) -> None:
    for path in ROUTES:
        missing_key, wrong = pod.get(path), pod.get(path, "sk-not-the-key")
        assert (missing_key.status_code, wrong.status_code) == (401, 401), path
        assert missing_key.headers["www-authenticate"] == "Bearer"
    assert httpx.post(pod.url + "/v1/chat/completions", json={}, timeout=30).status_code == 401
    assert pod.seen == []  # HAProxy answered every 401 itself
    for path in ROUTES:
        answer = pod.get(path, KEY)
        assert answer.status_code == 200 and answer.json()["path"] == path
    assert len(pod.seen) == len(ROUTES) and not [h for h in pod.seen if "authorization" in h]


def test_no_process_of_the_proxy_holds_the_key_and_its_files_are_private(pod: Pod) -> None:
    tree = [psutil.Process(pod.proc.pid), *psutil.Process(pod.proc.pid).children(recursive=True)]
    assert any("haproxy" in " ".join(p.cmdline()) for p in tree)
    for proc in tree[1:]:  # the proxy's children: HAProxy and its wrapper
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
        assert KEY.encode() not in environ and b"NEXA_SERVING_API_KEY_FILE" not in environ
    work = pod.key_file.parent / "proxy"
    assert work.stat().st_mode & 0o777 == 0o700
    for private in (work / "haproxy.cfg", work / "keys.acl"):
        assert private.stat().st_mode & 0o777 == 0o600 and KEY not in private.read_text()


def test_the_key_rotates_without_a_restart_and_a_weak_key_changes_nothing(pod: Pod) -> None:
    """Old and new valid (SIGHUP), then the new alone (no signal: the file's change is seen), then a weak key
    written meanwhile is refused and the keys before stay valid; HAProxy is the same process throughout."""
    haproxy = [p.pid for p in psutil.Process(pod.proc.pid).children(recursive=True)]
    pod.key_file.write_text(f"{KEY}\n{NEW_KEY}\n")
    os.kill(pod.proc.pid, signal.SIGHUP)
    pod.wait_log("2 API key(s) valid now (1 added, 0 removed)")
    assert (pod.get("/metrics", KEY).status_code, pod.get("/metrics", NEW_KEY).status_code) == (200, 200)
    pod.key_file.write_text(f"{NEW_KEY}\n")
    pod.wait_log("1 API key(s) valid now (0 added, 1 removed)")
    assert (pod.get("/metrics", KEY).status_code, pod.get("/metrics", NEW_KEY).status_code) == (401, 200)
    pod.key_file.write_text(f"{NEW_KEY}\n{'abcdefgh' * 4}\n")
    pod.wait_log("the API keys were not changed, the ones before stay valid")
    assert "at least 128 bits are required" in pod.log_tail()
    assert (
        pod.get("/metrics", NEW_KEY).status_code == 200
        and pod.get("/metrics", "abcdefgh" * 4).status_code == 401
    )
    assert [p.pid for p in psutil.Process(pod.proc.pid).children(recursive=True)] == haproxy


def test_the_proxy_will_not_start_without_a_key_file(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "NEXA_SERVING_API_KEY_FILE"}
    proc = subprocess.run(
        [sys.executable, "-m", "nexa_dagster.cli", "key-proxy", "--port", str(free_port())],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        proc.returncode == 1 and "cannot start the key proxy: the key proxy needs an API key" in proc.stderr
    )
    assert "Traceback" not in proc.stderr
