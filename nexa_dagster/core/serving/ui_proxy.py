"""The Dagster UI behind a password: HAProxy with HTTP basic authentication in front of ``dagster-webserver``.

Why: Dagster OSS has no authentication of its own; whoever reaches its webserver may launch any job, including
``model_deployment`` and a rollback. In docker compose the webserver listens on the stack's network only (no port
published) and this proxy, the one published port of the UI, lets through only a request carrying the UI's user
and password (a browser asks for them once). The password comes from a file (a Docker secret) and must carry 128
bits (``access.secret_bits``); the configuration holds only a salted HMAC of the expected header, as the serving
endpoint's key check does (haproxy.py), and is readable by its owner only.

``nexa-dagster ui-proxy`` writes the configuration and becomes HAProxy (exec): the container's main process.
"""

from __future__ import annotations

import base64
import os
import tempfile
from pathlib import Path

from nexa_dagster.core.serving import access
from nexa_dagster.core.serving.haproxy import INSTALL_HINT, RouterError, haproxy_binary, header_check


def basic_header(user: str, password: str) -> str:
    """The ``Authorization`` header a browser sends for ``user`` and ``password`` (RFC 7617)."""
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def render_ui_proxy_config(host: str, port: int, upstream: str, salt: bytes, users_file: Path) -> str:
    """One frontend that asks for the password (401 with ``WWW-Authenticate: Basic``) unless the request's header
    matches, then drops the header; one backend, the webserver (resolved again when its container restarts)."""
    return f"""# written by nexa_dagster.core.serving.ui_proxy: the Dagster UI behind a password (docs/security.md)
global
    maxconn 2000

resolvers stack
    parse-resolv-conf
    hold valid 10s

defaults
    mode http
    timeout connect 5s
    timeout client 600s
    timeout server 600s
    timeout tunnel 3600s

frontend ui
    bind {host}:{port}
{header_check(salt, users_file, acl="right_user")}
    http-request auth realm nexa-dagster unless right_user
    http-request del-header authorization
    default_backend webserver

backend webserver
    server webserver {upstream} resolvers stack init-addr last,libc,none
"""


def prepare_ui_proxy(
    work_dir: Path, host: str, port: int, upstream: str, user: str, password: str
) -> list[str]:
    """Write the configuration (mode 600, in ``work_dir``, made private) and return the HAProxy command line."""
    if ":" in user:
        raise access.SecretMissing(
            f"the UI user {user!r} holds a colon, which basic authentication cannot carry"
        )
    exe = haproxy_binary()
    if exe is None:
        raise RouterError(f"haproxy is not installed: {INSTALL_HINT}")
    access.private_dir(work_dir)
    salt = access.new_salt()
    users = work_dir / "ui-users.acl"
    access.write_private(users, access.header_digest(basic_header(user, password), salt) + "\n")
    config = work_dir / "ui-proxy.cfg"
    access.write_private(config, render_ui_proxy_config(host, port, upstream, salt, users))
    return [exe, "-db", "-f", str(config)]


def default_work_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"nexa-ui-proxy-{os.getuid()}"
