"""Real services for the tests that need them, started by the tests themselves (no mocks).

Each starter returns connection details, or, when the service's programs are missing: fails under ``CI=true``
(the CI script installs them, so missing means broken) and skips elsewhere with the command that installs them.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def missing(what: str, install: str) -> None:
    message = f"{what} is not installed ({install})"
    if os.environ.get("CI") == "true":
        pytest.fail(message + " -- CI must provide it; .ci/run installs it")
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_postgres_user(command: list[str]) -> list[str]:
    """initdb and postgres refuse to run as root: run them as the `postgres` user the Debian package creates."""
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


@contextmanager
def postgres_server() -> Iterator[dict[str, str]]:
    """A throw-away PostgreSQL server on 127.0.0.1 (its own data directory and port), with database `dagster`."""
    found = shutil.which("initdb") or next(iter(sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))), None)
    if found is None:
        missing("PostgreSQL", "apt-get install postgresql")
    bin_dir = Path(found).resolve().parent
    root = Path(tempfile.mkdtemp(prefix="nexa-pg-"))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    data, port = root / "data", free_port()
    subprocess.run(_as_postgres_user([str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
                                      "-E", "UTF8"]), check=True, capture_output=True)
    subprocess.run(_as_postgres_user([str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(root / "server.log"),
                                      "-o", f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c max_connections=200",
                                      "-w", "start"]), check=True, capture_output=True)
    try:
        subprocess.run([str(bin_dir / "psql"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "-c",
                        "CREATE DATABASE dagster"], check=True, capture_output=True)
        yield {"DAGSTER_PG_URL": f"postgresql+psycopg2://postgres@127.0.0.1:{port}/dagster",
               "host": "127.0.0.1", "port": str(port), "db": "dagster"}
    finally:
        subprocess.run(_as_postgres_user([str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]),
                       capture_output=True)
        time.sleep(0.2)
        shutil.rmtree(root, ignore_errors=True)
