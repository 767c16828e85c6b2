"""HAProxy (Debian's package) in front of the two engine colours, steered through its runtime API.

Why HAProxy: it is a proven HTTP router whose runtime API (the admin socket) changes a server's state without a
reload: ``ready`` (takes new requests), ``drain`` (no new requests, the ones in flight finish) and ``maint``
(out). That is blue/green without dropping a request, and without a home-made proxy in the request path. The
two colours are two ``server`` lines of one backend, at Unix sockets fixed when the router is configured (no
engine has a TCP port); the routes ``/v1/models`` and ``/status`` (as ``/public/status``: what is served, nothing
internal) go to the serving service's own control API on a socket of its own, everything else to the engines. With
an API key, every request needs it (``Authorization: Bearer <key>``): HAProxy answers 401 itself otherwise. The
valid keys (their salted digests) change through the same runtime API (``set_keys``): a key rotation needs no
reload either (docs/security.md).
"""

from __future__ import annotations

import base64
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
from typing import Self

from nexa_dagster import settings
from nexa_dagster.core.common.processes import stop_process_group
from nexa_dagster.core.llm.managed_server import with_parent_death_signal
from nexa_dagster.core.serving import access
from nexa_dagster.core.serving.request_log import LOG_FORMAT

log = logging.getLogger(__name__)

COLOURS = ("blue", "green")
# the public port's GET /status, as HAProxy hands it to the control API: what is served, nothing internal
PUBLIC_STATUS = "/public/status"
BACKEND = "engines"
INSTALL_HINT = "install it with scripts/install_services.sh (Debian: apt-get install haproxy)"


# HAProxy refuses a UNIX socket path longer than this ("socket path ... too long (max 97)", the NUL included); the
# kernel's own limit (sun_path) is 107
MAX_SOCKET_PATH = 96
SAMPLE_MAP = "sample.map"  # the request log's sampling rate of answers to score, changed at run time
SAMPLE_SCALE = 10_000  # the rate's unit: 1/10,000 of the requests
MAX_LOG_LINE = 65_535  # HAProxy's longest log line: two bodies of up to its 16 KiB buffer, in base64


def admin_socket_path(work_dir: Path) -> Path:
    """``<work_dir>/haproxy.sock``, or, when that path is too long for a UNIX socket (a data root deep in the file
    system, e.g. restored or moved under a long path), a short one in the temporary directory named by a hash of
    ``work_dir`` (one per router, whatever the data root)."""
    beside = work_dir / "haproxy.sock"
    if len(str(beside)) <= MAX_SOCKET_PATH:
        return beside
    digest = hashlib.sha256(str(work_dir.resolve()).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"nexa-haproxy-{digest}.sock"


def socket_dir(work_dir: Path) -> Path:
    """The private folder (mode 700, ``access.private_dir``) of the service's Unix sockets (the engines', the
    control API's public one): ``<work_dir>/sockets``, or a short one in the temporary directory when that path is
    too long for a socket (as ``admin_socket_path``)."""
    beside = work_dir / "sockets"
    if len(str(beside / "public.sock")) > MAX_SOCKET_PATH:
        digest = hashlib.sha256(str(work_dir.resolve()).encode()).hexdigest()[:16]
        beside = Path(tempfile.gettempdir()) / f"nexa-serving-{digest}"
    return access.private_dir(beside)


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


def header_check(salt: bytes, digests_file: Path, acl: str = "right_key") -> str:
    """The ACL ``acl``: the HMAC-SHA-256 under ``salt`` of the request's whole ``Authorization`` header (a comma
    cannot split it) is one of the digests in ``digests_file`` (one a line; changed at run time through the admin
    socket, ``HAProxyRouter.set_keys``). The salt is random per configuration: two deployments with one key share
    no digest, and no table computed ahead matches (HAProxy 2.6's ``hmac`` converter takes the key in base64)."""
    salt64 = base64.b64encode(salt).decode()
    return f"    acl {acl} req.fhdr(authorization),hmac(sha256,{salt64}),hex -m str -f {digests_file}"


def api_key_rules(salt: bytes | None, digests_file: Path) -> str:
    """The frontend's key check (None: no check, a loopback-only endpoint). The header is removed before the
    request goes on (no engine sees or logs it)."""
    if salt is None:
        return ""
    return "\n".join(
        [
            "    acl has_key req.fhdr(authorization) -m found",
            header_check(salt, digests_file),
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
    engine_sockets: dict[str, Path],
    public_socket: Path,
    admin_socket: Path,
    host: str = "127.0.0.1",
    salt: bytes | None = None,
    digests_file: Path | None = None,
    request_log: Path | None = None,
    sample_map: Path | None = None,
) -> str:
    """The whole configuration: one frontend (the API key checked first), the engines backend (both colours out at
    first, each reached on its Unix socket: no engine has a TCP port), the control API's public routes (on a Unix
    socket of their own: the control API's TCP port wants its token on every route). With ``request_log``, one
    line per request in ``request_log.LOG_FORMAT`` to that Unix datagram socket (what a canary watches)."""
    servers = "\n".join(f"    server {c} unix@{engine_sockets[c]} disabled" for c in COLOURS)
    rules = api_key_rules(salt, digests_file or admin_socket.with_name("keys.acl"))
    written = f"haproxy; traffic is steered at run time through {admin_socket}"
    logging_ = (
        request_logging(request_log, sample_map or admin_socket.with_name(SAMPLE_MAP)) if request_log else ""
    )
    return f"""{preamble(written, admin_socket)}    option redispatch 1

frontend endpoint
    bind {host}:{port}
{logging_}{rules}    http-request set-path {PUBLIC_STATUS} if {{ path /status }}
    use_backend control if {{ path /v1/models {PUBLIC_STATUS} }} || {{ path_beg /v1/models/ }}
    default_backend {BACKEND}

backend {BACKEND}
    balance roundrobin
    http-response set-header X-Nexa-Engine %s
{RESPONSE_SAMPLING if request_log else ""}{servers}

backend control
    server control unix@{public_socket}
"""


def request_logging(request_log: Path, sample_map: Path) -> str:
    """The frontend's request log (``request_log.LOG_FORMAT``, one datagram a request) and its sample of answers to
    score: a request drawn at the rate the map file holds (``quality``, in 1/``SAMPLE_SCALE``; 0 until a canary
    that watches quality sets it at run time, ``HAProxyRouter.sample_answers``) has its body kept (it waits for the
    body, a small JSON, before it goes on), and its answer's body too (``RESPONSE_SAMPLING``); both go in its log
    line in base64. Nothing is written to disk: the line goes to the service's private socket and is read there."""
    return f"""    log {request_log} len {MAX_LOG_LINE} format raw local0
    log-format "{LOG_FORMAT}"
    http-request set-var(txn.rate) str(quality),map_str_int({sample_map},0)
    http-request set-var(txn.draw) rand({SAMPLE_SCALE})
    acl sampled var(txn.draw),sub(txn.rate) lt 0
    acl scorable path /v1/chat/completions /v1/completions
    http-request wait-for-body time 1s if sampled scorable METH_POST
    http-request set-var(txn.qreq) req.body,base64 if sampled scorable METH_POST
"""


# a kept request's answer, unless it streams (its events would hold the first chunk back from the caller)
_KEEP_ANSWER = "if { var(txn.qreq) -m found } !{ res.hdr(content-type) -m beg text/event-stream }"
RESPONSE_SAMPLING = f"""    http-response wait-for-body time 5s {_KEEP_ANSWER}
    http-response set-var(txn.qres) res.body,base64 {_KEEP_ANSWER}
"""


def preamble(written_by: str, admin_socket: Path) -> str:
    """The head of every configuration the project writes: who wrote it, the runtime API on a private socket (the
    key rotation and the colour switches go through it), HTTP mode and the timeouts a streamed answer needs."""
    return f"""# written by nexa_dagster.core.serving.{written_by}
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
"""


class KeyedHAProxy:
    """One HAProxy process whose frontend checks the API key, its valid keys changed at run time (``set_keys``):
    the process, its runtime API and the key rotation, whatever the configuration (``render``) routes to."""

    def __init__(
        self,
        work_dir: str | Path,
        port: int,
        host: str = "127.0.0.1",
        logger: logging.Logger | None = None,
        api_keys: list[str] | None = None,
    ) -> None:
        self.work_dir = Path(work_dir)
        # no keys: an open endpoint (loopback only, the caller checked); else a fresh salt for this configuration
        self.salt = access.new_salt() if api_keys else None
        self.api_keys = list(api_keys or [])
        self.port, self.host = port, host
        self.admin_socket = admin_socket_path(self.work_dir)
        self.config_path = self.work_dir / "haproxy.cfg"
        self.digests_path = self.work_dir / "keys.acl"
        self.log_path = self.work_dir / "haproxy.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.log = logger or log

    def render(self) -> str:
        """The whole configuration (written mode 600 at start)."""
        raise NotImplementedError

    def _digests(self, keys: list[str]) -> list[str]:
        assert self.salt is not None
        return [access.bearer_digest(k, self.salt) for k in keys]

    # -- process -------------------------------------------------------------------------------------------------
    def start(self, timeout_s: float = 15.0) -> Self:
        exe = haproxy_binary()
        if exe is None:
            raise RouterError(f"haproxy is not installed: {INSTALL_HINT}")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.admin_socket.unlink(missing_ok=True)  # a leftover of a killed service
        # both files readable by this user only (the digests are no secret, but a guess could be tested on them)
        access.write_private(
            self.digests_path, "".join(f"{d}\n" for d in self._digests(self.api_keys)) if self.salt else ""
        )
        access.write_private(self.config_path, self.render())
        # dies with the service, even when the service is killed with SIGKILL; inherits no secret
        cmd = with_parent_death_signal([exe, "-db", "-f", str(self.config_path)])
        with open(self.log_path, "ab") as logfile:
            self.process = subprocess.Popen(
                cmd,
                stdout=logfile,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(settings.environ()),
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

    def set_keys(self, keys: list[str]) -> tuple[int, int]:
        """Make ``keys`` the valid keys without a reload (HAProxy's runtime API): the new digests are added first,
        then the ones of keys no longer given are deleted, so a key valid before and after is never refused, and
        no connection is closed. Returns (keys added, keys removed)."""
        if self.salt is None:
            raise RouterError(
                "this endpoint was started without an API key: restart it with NEXA_SERVING_API_KEY_FILE to add one"
            )
        if not keys:
            raise RouterError("no API key left: an endpoint that had a key keeps one (the file was emptied?)")
        old, new = set(self._digests(self.api_keys)), self._digests(keys)
        added, removed = [d for d in new if d not in old], sorted(old - set(new))
        for verb, digests in (("add", added), ("del", removed)):
            for digest in digests:
                answer = self.command(f"{verb} acl {self.digests_path} {digest}").strip()
                if answer:  # nothing on success
                    raise RouterError(f"haproxy refused `{verb} acl {self.digests_path} <digest>`: {answer}")
        self.api_keys = list(keys)
        access.write_private(self.digests_path, "".join(f"{d}\n" for d in new))
        return len(added), len(removed)

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


class HAProxyRouter(KeyedHAProxy):
    """``router.start()`` then ``router.route_to("green")``: green takes new requests, blue drains, then is out."""

    def __init__(
        self,
        work_dir: str | Path,
        port: int,
        engine_sockets: dict[str, Path],
        public_socket: Path,
        host: str = "127.0.0.1",
        logger: logging.Logger | None = None,
        api_keys: list[str] | None = None,
        request_log: Path | None = None,
    ) -> None:
        super().__init__(work_dir, port, host, logger, api_keys)
        self.engine_sockets, self.public_socket, self.request_log = engine_sockets, public_socket, request_log
        self.sample_map = self.work_dir / SAMPLE_MAP

    def render(self) -> str:
        return render_config(
            self.port,
            self.engine_sockets,
            self.public_socket,
            self.admin_socket,
            self.host,
            self.salt,
            self.digests_path,
            self.request_log,
            self.sample_map,
        )

    def start(self, timeout_s: float = 15.0) -> Self:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        access.write_private(self.sample_map, "quality 0\n")  # no answer kept until a canary asks
        return super().start(timeout_s)

    def sample_answers(self, share: float) -> int:
        """Keep the bodies of about ``share`` of the requests (and of their answers) in the request log, for a
        canary that scores answers; 0 stops it. Changed at run time (``set map``), no reload. Returns the rate in
        1/``SAMPLE_SCALE``."""
        if not 0 <= share <= 1:
            raise RouterError(f"the share of answers to score must be in [0, 1], got {share}")
        if self.request_log is None:
            raise RouterError("this router logs no requests (request_log): no answers can be kept")
        rate = round(share * SAMPLE_SCALE)
        answer = self.command(f"set map {self.sample_map} quality {rate}").strip()
        if answer:
            raise RouterError(f"haproxy refused `set map {self.sample_map}`: {answer}")
        return rate

    def split(self, canary: str, share: float) -> tuple[int, int]:
        """Both colours take new requests, ``canary`` about ``share`` of them (HAProxy's weights, 0-256, round
        robin): a canary beside the stable colour. ``route_to`` ends it either way (promote: to the canary; roll
        back: to the stable colour, the canary's requests in flight finishing). Returns (stable, canary) weights."""
        if not 0 < share < 1:
            raise RouterError(f"a canary's share must be in (0, 1), got {share}")
        stable = next(c for c in COLOURS if c != canary)
        weights = {canary: min(max(round(256 * share), 1), 255)}
        weights[stable] = 256 - weights[canary]
        for colour in (stable, canary):
            answer = self.command(f"set weight {BACKEND}/{colour} {weights[colour]}").strip()
            if answer:
                raise RouterError(f"haproxy refused `set weight {BACKEND}/{colour}`: {answer}")
            self.set_state(colour, "ready")
        return weights[stable], weights[canary]

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
