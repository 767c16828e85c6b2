"""HAProxy (Debian's package) in front of the two engine colours, steered through its runtime API.

Why HAProxy: it is a proven HTTP router whose runtime API (the admin socket) changes a server's state without a
reload: ``ready`` (takes new requests), ``drain`` (no new requests, the ones in flight finish) and ``maint``
(out). That is blue/green without dropping a request, and without a home-made proxy in the request path. The
two colours are two ``server`` lines of one backend, at ports fixed when the router is configured; the routes
``/v1/models`` and ``/status`` (as ``/public/status``: what is served, nothing internal) go to the serving
service's own control API, everything else to the engines. With an API key, every request needs it
(``Authorization: Bearer <key>``): HAProxy answers 401 itself otherwise.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from nexa_dagster.core.common.processes import stop_process_group
from nexa_dagster.core.llm.managed_server import with_parent_death_signal

log = logging.getLogger(__name__)

COLOURS = ("blue", "green")
# the public port's GET /status, as HAProxy hands it to the control API: what is served, nothing internal
PUBLIC_STATUS = "/public/status"
BACKEND = "engines"
INSTALL_HINT = "install it with scripts/install_services.sh (Debian: apt-get install haproxy)"


# HAProxy refuses a UNIX socket path longer than this ("socket path ... too long (max 97)", the NUL included); the
# kernel's own limit (sun_path) is 107
MAX_SOCKET_PATH = 96


def admin_socket_path(work_dir: Path) -> Path:
    """``<work_dir>/haproxy.sock``, or, when that path is too long for a UNIX socket (a data root deep in the file
    system, e.g. restored or moved under a long path), a short one in the temporary directory named by a hash of
    ``work_dir`` (one per router, whatever the data root)."""
    beside = work_dir / "haproxy.sock"
    if len(str(beside)) <= MAX_SOCKET_PATH:
        return beside
    digest = hashlib.sha256(str(work_dir.resolve()).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"nexa-haproxy-{digest}.sock"


class RouterError(RuntimeError):
    """HAProxy is missing, did not start, or refused a runtime command."""


def haproxy_binary() -> str | None:
    return shutil.which("haproxy") or next((p for p in ("/usr/sbin/haproxy",) if os.access(p, os.X_OK)), None)


def _unauthorized(message: str, condition: str) -> str:
    """An OpenAI-style 401 answered by HAProxy itself (as `vllm serve --api-key` answers, the request goes nowhere)."""
    body = json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "code": "invalid_api_key"}}
    )
    assert "'" not in body  # HAProxy's strong quoting
    return (
        "    http-request return status 401 content-type application/json "
        f"hdr www-authenticate Bearer string '{body}' if {condition}"
    )


def api_key_rules(api_key_digest: str | None) -> str:
    """The frontend's key check: the SHA-256 of the request's whole ``Authorization`` header against
    ``api_key_digest`` (``access.bearer_digest``), so that the configuration file holds no secret. The header is
    removed before the request goes on (no engine sees or logs it). None: no check (a loopback-only endpoint)."""
    if api_key_digest is None:
        return ""
    return "\n".join(
        [
            "    acl has_key req.fhdr(authorization) -m found",
            f"    acl right_key req.fhdr(authorization),sha2(256),hex -m str {api_key_digest}",
            _unauthorized(
                "missing API key: send the key of the serving endpoint as `Authorization: Bearer <key>` "
                "(OpenAI clients: api_key=...)",
                "!has_key",
            ),
            _unauthorized("wrong API key for the serving endpoint", "!right_key"),
            "    http-request del-header authorization",
            "",
        ]
    )


def render_config(
    port: int,
    engine_ports: dict[str, int],
    control_port: int,
    admin_socket: Path,
    host: str = "127.0.0.1",
    api_key_digest: str | None = None,
) -> str:
    """The whole configuration: one frontend (the API key checked first), the engines backend (both colours out at
    first), the control API's public routes."""
    servers = "\n".join(f"    server {c} 127.0.0.1:{engine_ports[c]} disabled" for c in COLOURS)
    return f"""# written by nexa_dagster.core.serving.haproxy; traffic is steered at run time through {admin_socket}
global
    stats socket {admin_socket} mode 600 level admin
    stats timeout 30s

defaults
    mode http
    timeout connect 2s
    timeout client 600s
    timeout server 600s
    timeout http-keep-alive 10s
    retries 3
    option redispatch 1

frontend endpoint
    bind {host}:{port}
{api_key_rules(api_key_digest)}    http-request set-path {PUBLIC_STATUS} if {{ path /status }}
    use_backend control if {{ path /v1/models {PUBLIC_STATUS} }} || {{ path_beg /v1/models/ }}
    default_backend {BACKEND}

backend {BACKEND}
    balance roundrobin
    http-response set-header X-Nexa-Engine %s
{servers}

backend control
    server control 127.0.0.1:{control_port}
"""


class HAProxyRouter:
    """``router.start()`` then ``router.route_to("green")``: green takes new requests, blue drains, then is out."""

    def __init__(
        self,
        work_dir: str | Path,
        port: int,
        engine_ports: dict[str, int],
        control_port: int,
        host: str = "127.0.0.1",
        logger: logging.Logger | None = None,
        api_key_digest: str | None = None,
    ) -> None:
        self.work_dir = Path(work_dir)
        self.api_key_digest = api_key_digest
        self.port, self.engine_ports, self.control_port, self.host = port, engine_ports, control_port, host
        self.admin_socket = admin_socket_path(self.work_dir)
        self.config_path = self.work_dir / "haproxy.cfg"
        self.log_path = self.work_dir / "haproxy.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.log = logger or log

    # -- process -------------------------------------------------------------------------------------------------
    def start(self, timeout_s: float = 15.0) -> HAProxyRouter:
        exe = haproxy_binary()
        if exe is None:
            raise RouterError(f"haproxy is not installed: {INSTALL_HINT}")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.admin_socket.unlink(missing_ok=True)  # a leftover of a killed service
        self.config_path.write_text(
            render_config(
                self.port,
                self.engine_ports,
                self.control_port,
                self.admin_socket,
                self.host,
                self.api_key_digest,
            )
        )
        # dies with the service, even when the service is killed with SIGKILL
        cmd = with_parent_death_signal([exe, "-db", "-f", str(self.config_path)])
        with open(self.log_path, "ab") as logfile:
            self.process = subprocess.Popen(
                cmd,
                stdout=logfile,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RouterError(
                    f"haproxy exited with code {self.process.returncode}; {self.log_path}:\n"
                    f"{self.log_path.read_text(errors='replace')[-2000:]}"
                )
            with contextlib.suppress(OSError):
                if "Name: HAProxy" in self.command("show info"):
                    return self
            if time.monotonic() > deadline:
                self.stop()
                raise RouterError(f"haproxy did not open {self.admin_socket} within {timeout_s:.0f} s")
            time.sleep(0.1)

    def stop(self) -> None:
        proc, self.process = self.process, None
        if proc is not None:
            stop_process_group(proc)
            self.admin_socket.unlink(missing_ok=True)

    # -- runtime API ---------------------------------------------------------------------------------------------
    def command(self, line: str) -> str:
        """One runtime API command on the admin socket; its answer."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5.0)
            s.connect(str(self.admin_socket))
            s.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode(errors="replace")

    def set_state(self, colour: str, state: str) -> None:
        answer = self.command(f"set server {BACKEND}/{colour} state {state}").strip()
        if answer:  # the runtime API answers nothing on success
            raise RouterError(f"haproxy refused `set server {BACKEND}/{colour} state {state}`: {answer}")

    def sessions(self) -> dict[str, dict[str, str]]:
        """``show stat`` rows of the engines backend's servers, by colour (``status``, ``scur``, ``stot`` ...)."""
        text = self.command("show stat").lstrip("# ")
        rows = csv.DictReader(io.StringIO(text))
        return {r["svname"]: r for r in rows if r.get("pxname") == BACKEND and r.get("svname") in COLOURS}

    def in_flight(self, colour: str) -> int:
        return int(self.sessions()[colour]["scur"] or 0)

    def route_to(self, colour: str, drain_timeout_s: float = 120.0) -> float:
        """New requests go to ``colour``; the other colour drains (its requests in flight finish) and goes out.

        Returns the seconds the drain took. A request still in flight after ``drain_timeout_s`` is left to
        finish on its own (the engine is stopped by the caller, which waits for it).
        """
        other = next(c for c in COLOURS if c != colour)
        self.set_state(colour, "ready")
        self.set_state(other, "drain")
        t0 = time.monotonic()
        while self.in_flight(other) > 0 and time.monotonic() - t0 < drain_timeout_s:
            time.sleep(0.05)
        self.set_state(other, "maint")
        return time.monotonic() - t0
