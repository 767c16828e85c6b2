"""Who may use the serving service: the API key of the public endpoint and the token of its control API.

Both are secrets a person provides the way containers do, as an environment variable or a file (a Docker or
Kubernetes secret mounted read-only). Neither is ever written to the production pointer, ``service.json``, a log
line or Dagster metadata: HAProxy is given only the SHA-256 of the expected ``Authorization`` header, so its
configuration file holds no secret; the control API compares tokens in constant time.

Without a configured control token the service makes a fresh one at every start and writes it, readable by its
owner only, to ``<serving dir>/control-token``, where the pipeline on the same host reads it: whoever may read the
data root may already move the production pointer, which the service follows, so the file grants nothing more.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
from pathlib import Path

from nexa_dagster import settings

TOKEN_FILE = "control-token"
CONTROL_TOKEN_HEADER = "Authorization"


class SecretMissing(RuntimeError):
    """A secret the service needs is not configured, or its file cannot be read."""


def read_secret(value: settings.Variable, file: settings.Variable) -> str | None:
    """The secret in ``value``, else the content of the file ``file`` names (whitespace stripped), else None."""
    if value.is_set():
        return value.get().strip() or None
    if not file.is_set():
        return None
    path = Path(file.get())
    try:
        secret = path.read_text().strip()
    except OSError as e:
        raise SecretMissing(f"{file.name} names {path}, which cannot be read: {e.strerror or e}") from None
    if not secret:
        raise SecretMissing(f"{file.name} names {path}, which is empty")
    return secret


def api_key() -> str | None:
    return read_secret(settings.SERVING_API_KEY, settings.SERVING_API_KEY_FILE)


def configured_control_token() -> str | None:
    return read_secret(settings.SERVING_CONTROL_TOKEN, settings.SERVING_CONTROL_TOKEN_FILE)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (what the service binds) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bearer_digest(key: str) -> str:
    """The SHA-256, upper-case hex, of ``Bearer <key>``: what HAProxy compares the request's header with."""
    return hashlib.sha256(f"Bearer {key}".encode()).hexdigest().upper()


def bearer(token: str) -> str:
    return f"Bearer {token}"


def same_secret(given: str | None, expected: str) -> bool:
    """Constant-time comparison (the time taken says nothing about how much of a guess was right)."""
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def issue_control_token(serving_dir: Path) -> str:
    """A fresh random token in ``<serving_dir>/control-token``, created readable by its owner only."""
    token = secrets.token_urlsafe(32)
    path = serving_dir / TOKEN_FILE
    tmp = path.with_name(f".{TOKEN_FILE}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token)
    os.replace(tmp, path)
    return token


def local_control_token(serving_dir: Path) -> str | None:
    """The token a pipeline on this host sends: the configured one, else the one the running service issued."""
    if token := configured_control_token():
        return token
    try:
        return (serving_dir / TOKEN_FILE).read_text().strip() or None
    except OSError:
        return None


def checkpoint_roots(data_checkpoints: Path) -> list[Path]:
    """Where the service may load checkpoints from: the data root's ``checkpoints/`` and the configured others."""
    extra = [Path(p) for p in settings.SERVING_CHECKPOINT_ROOTS.get().split(os.pathsep) if p.strip()]
    return [data_checkpoints, *extra]


def outside_roots(checkpoint_path: str, roots: list[Path]) -> str | None:
    """None when ``checkpoint_path`` (links resolved, so ``..`` and links cannot step out) lies under one of
    ``roots``; else why it is refused."""
    resolved = Path(checkpoint_path).resolve()
    if any(resolved.is_relative_to(root.resolve()) for root in roots):
        return None
    return (
        f"{checkpoint_path} is outside the folders the serving service loads checkpoints from "
        f"({', '.join(str(r) for r in roots)}); NEXA_SERVING_CHECKPOINT_ROOTS adds one"
    )
