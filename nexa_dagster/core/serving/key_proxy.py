"""The endpoint's key check in front of one engine that has none worth the name: HAProxy, configured as the one
``nexa-dagster serve`` puts in front of its engines, for a Kubernetes pod (deploy/k8s/serving.yaml) whose vLLM
listens on the pod's loopback.

Why: ``vllm serve --api-key`` (``VLLM_API_KEY``) guards only the routes under ``/v1``; ``/invocations``,
``/tokenize``, ``/detokenize``, ``/metrics``, ``/pooling`` and the rest answer anyone who reaches the port, and a
key given as an environment variable sits in the engine's ``/proc/<pid>/environ``. Here the engine binds
``127.0.0.1`` (only the pod's own containers share that loopback) and this proxy, the pod's one port, answers 401
itself, on every route, to a request without a valid ``Authorization: Bearer <key>``, then removes the header and
forwards it. The keys come from the file ``NEXA_SERVING_API_KEY_FILE`` names (a Secret mounted into this container
only, never the engine's); HAProxy is given only their salted digests (``haproxy.header_check``). Rotation without
a restart: the file is re-read on SIGHUP and whenever its content changes (a Kubernetes Secret volume is updated in
place a minute or so after the Secret), and the valid keys change through HAProxy's runtime API, new ones first.

``nexa-dagster key-proxy`` runs it in the foreground (the container's main process) until SIGTERM.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from pathlib import Path

from nexa_dagster.core.serving import access
from nexa_dagster.core.serving.haproxy import KeyedHAProxy, RouterError, api_key_rules, preamble

log = logging.getLogger(__name__)


def render_key_proxy_config(
    host: str, port: int, upstream: str, admin_socket: Path, salt: bytes, digests_file: Path
) -> str:
    """One frontend that refuses every request without a valid key (HAProxy answers the 401: the engine never sees
    it) and drops the header; one backend, the engine (``host:port`` or ``unix@<path>``)."""
    return f"""{preamble("key_proxy: every route behind the API key (docs/security.md)", admin_socket)}
frontend endpoint
    bind {host}:{port}
{api_key_rules(salt, digests_file)}    default_backend engine

backend engine
    server engine {upstream}
"""


class KeyProxy(KeyedHAProxy):
    """``KeyProxy(work_dir, 8000, "127.0.0.1:8001", keys, host="0.0.0.0").start()``: keys are required."""

    def __init__(
        self,
        work_dir: str | Path,
        port: int,
        upstream: str,
        api_keys: list[str],
        host: str = "127.0.0.1",
        logger: logging.Logger | None = None,
    ) -> None:
        if not api_keys:
            raise access.SecretMissing(
                "the key proxy needs an API key: write one to a file (mode 600) and set NEXA_SERVING_API_KEY_FILE "
                f"(make one with {access.MAKE_ONE})"
            )
        super().__init__(access.private_dir(Path(work_dir)), port, host, logger, api_keys)
        self.upstream = upstream

    def render(self) -> str:
        assert self.salt is not None
        return render_key_proxy_config(
            self.host, self.port, self.upstream, self.admin_socket, self.salt, self.digests_path
        )

    def reload(self, read_keys: Callable[[], list[str]]) -> bool:
        """Make the key file's keys the valid ones, when they changed. A file that cannot be read, or holds a weak
        key, changes nothing (the keys valid before stay valid) and says why in the log."""
        try:
            keys = read_keys()
            if keys == self.api_keys:
                return False
            added, removed = self.set_keys(keys)
        except (access.SecretMissing, RouterError, OSError) as e:
            self.log.error("the API keys were not changed, the ones before stay valid: %s", e)
            return False
        self.log.info("%d API key(s) valid now (%d added, %d removed)", len(keys), added, removed)
        return True


def run_key_proxy(proxy: KeyProxy, read_keys: Callable[[], list[str]], watch_s: float = 10.0) -> int:
    """Serve until SIGTERM/SIGINT; re-read the keys on SIGHUP and every ``watch_s`` seconds. Main thread only
    (signal handlers). Returns 1 when HAProxy exits on its own (the container restarts), else 0."""
    stopping, wake = threading.Event(), threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: (stopping.set(), wake.set()))
    signal.signal(signal.SIGHUP, lambda *_: wake.set())
    proxy.start()
    try:
        while not stopping.is_set():
            wake.wait(timeout=watch_s)
            wake.clear()
            if proxy.process is None or proxy.process.poll() is not None:
                proxy.log.error("haproxy exited; its log: %s", proxy.log_path)
                return 1
            if not stopping.is_set():
                proxy.reload(read_keys)
    finally:
        proxy.stop()
    return 0
