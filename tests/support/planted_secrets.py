"""Secrets planted in a launching process's environment, and the check that a child's ``/proc/<pid>/environ``
holds none of them: the project's own secret variables (``settings.SECRET_VARIABLES``, each with a value of its
own) and secrets under names the project never heard of (a cloud key, a CI token)."""

from __future__ import annotations

import secrets
from pathlib import Path

from nexa_dagster import settings

# names the project does not know: an allow-list leaves them out, a deny-list of the project's own names would not
FOREIGN = ("NEXA_TEST_SECRET", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN", "GITHUB_TOKEN")
PLANTED: dict[str, str] = {
    name: f"planted-{secrets.token_hex(16)}"
    for name in (*FOREIGN, *(v.name for v in settings.SECRET_VARIABLES))
}


def environ_of(pid: int) -> dict[str, str]:
    """The environment a process was started with, from ``/proc/<pid>/environ``."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(entry.split("=", 1) for entry in raw.decode(errors="replace").split("\0") if "=" in entry)


def leaked(environ: dict[str, str]) -> list[str]:
    """The planted names, or values under any name, that ``environ`` holds."""
    values = set(environ.values())
    return sorted({name for name, value in PLANTED.items() if name in environ or value in values})
