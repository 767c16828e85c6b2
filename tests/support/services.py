"""Real services for the tests that need them, started by the tests themselves (no mocks).

Each starter returns connection details, or, when the service's programs are missing: fails under ``CI=true``
(the CI script installs them, so missing means broken) and skips elsewhere with the command that installs them.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from nexa_dagster.core.common.net import free_port
from nexa_dagster.core.common.processes import stop_process_group


def missing(what: str, install: str) -> None:
    message = f"{what} is not installed ({install})"
    if os.environ.get("CI") == "true":
        pytest.fail(message + " -- CI must provide it; .ci/run installs it")
    pytest.skip(message)


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
    subprocess.run(
        _as_postgres_user(
            [str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8"]
        ),
        check=True,
        capture_output=True,
    )
    subprocess.run(
        _as_postgres_user(
            [
                str(bin_dir / "pg_ctl"),
                "-D",
                str(data),
                "-l",
                str(root / "server.log"),
                "-o",
                f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c max_connections=200",
                "-w",
                "start",
            ]
        ),
        check=True,
        capture_output=True,
    )
    try:
        subprocess.run(
            [
                str(bin_dir / "psql"),
                "-h",
                "127.0.0.1",
                "-p",
                str(port),
                "-U",
                "postgres",
                "-c",
                "CREATE DATABASE dagster",
            ],
            check=True,
            capture_output=True,
        )
        yield {
            "DAGSTER_PG_URL": f"postgresql+psycopg2://postgres@127.0.0.1:{port}/dagster",
            "host": "127.0.0.1",
            "port": str(port),
            "db": "dagster",
            "psql": str(bin_dir / "psql"),
        }
    finally:
        subprocess.run(
            _as_postgres_user([str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]),
            capture_output=True,
        )
        time.sleep(0.2)
        shutil.rmtree(root, ignore_errors=True)


def database_of_its_own(pg: dict[str, str], name: str) -> dict[str, str]:
    """A new, empty database on the shared server ``pg``: a module whose assertions count runs or materializations
    must not see another module's (the server is one per session, and xdist runs modules side by side)."""
    subprocess.run(
        [pg["psql"], "-h", pg["host"], "-p", pg["port"], "-U", "postgres", "-c", f"CREATE DATABASE {name}"],
        check=True,
        capture_output=True,
    )
    url = pg["DAGSTER_PG_URL"].rsplit("/", 1)[0] + f"/{name}"
    return {**pg, "DAGSTER_PG_URL": url, "db": name}


@contextmanager
def slurm_cluster() -> Iterator[dict[str, str]]:
    """A one-node Slurm cluster on the loopback: munged, slurmctld and slurmd with a config of their own.

    Returns the environment (``SLURM_CONF``) under which ``sbatch``, ``scontrol`` and ``scancel`` reach it.
    """
    for program in ("slurmctld", "slurmd", "munged"):
        if shutil.which(program) is None and not Path(f"/usr/sbin/{program}").exists():
            missing("Slurm", "apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        missing("root (slurmd starts jobs as their users)", "run the Slurm tests as root, as CI does")
    root = Path(tempfile.mkdtemp(prefix="nexa-slurm-"))
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir()
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    if not Path("/etc/munge/munge.key").exists():
        subprocess.run(["/usr/sbin/mungekey", "--create"], check=True)
        shutil.chown("/etc/munge/munge.key", "munge", "munge")
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode != 0:
        subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True)
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=nexa-test",
                f"SlurmctldHost={host}(127.0.0.1)",
                f"SlurmctldPort={free_port()}",
                f"SlurmdPort={free_port()}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                f"StateSaveLocation={root}/state",
                f"SlurmdSpoolDir={root}/spool",
                f"SlurmctldPidFile={root}/slurmctld.pid",
                f"SlurmdPidFile={root}/slurmd.pid",
                f"SlurmctldLogFile={root}/log/slurmctld.log",
                f"SlurmdLogFile={root}/log/slurmd.log",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "ReturnToService=2",
                "MpiDefault=none",
                "KillWait=5",
                "MinJobAge=600",
                f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN",
                "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )
    )
    env = {"SLURM_CONF": str(conf)}
    full_env = {**os.environ, **env}
    subprocess.run(["/usr/sbin/slurmctld", "-i"], env=full_env, check=True)
    subprocess.run(["/usr/sbin/slurmd"], env=full_env, check=True)
    try:
        deadline = time.monotonic() + 60
        while (
            "idle"
            not in subprocess.run(
                ["sinfo", "-h", "-o", "%t"], env=full_env, capture_output=True, text=True
            ).stdout
        ):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    "Slurm node did not become idle: " + (root / "log" / "slurmd.log").read_text()
                )
            time.sleep(0.5)
        yield env
    finally:
        for daemon in ("slurmd", "slurmctld"):
            pid_file = root / f"{daemon}.pid"
            if pid_file.exists():
                subprocess.run(["kill", pid_file.read_text().strip()], capture_output=True)
        time.sleep(1)
        shutil.rmtree(root, ignore_errors=True)


def wait_http(url: str, process: subprocess.Popen, what: str, log: Path, timeout_s: float = 120.0) -> None:
    """Poll ``url`` until it answers 200; fail with the process's log if it exits or the time runs out."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}: {log.read_text()[-3000:]}")
        with (
            contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError),
            urllib.request.urlopen(url, timeout=2) as response,
        ):
            if response.status == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{what} did not answer {url} within {timeout_s:.0f} s: {log.read_text()[-3000:]}")


@contextmanager
def mlflow_server(root: Path, wait: bool = True) -> Iterator[tuple[str, Callable[[], None]]]:
    """A real ``mlflow server`` on 127.0.0.1 (free port) with a SQLite backend store and a proxied artifact store
    under ``root``; yields (its URL, a function that waits until it answers), having waited already unless
    ``wait=False``; kills it at the end (its log: ``root/server.log``)."""
    port = free_port()
    log = root / "server.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlflow",
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "1",
                "--backend-store-uri",
                f"sqlite:///{root / 'mlflow.db'}",
                "--artifacts-destination",
                str(root / "artifacts"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"

    def until_up() -> None:
        wait_http(f"{url}/health", process, "mlflow server", log, timeout_s=300)

    try:
        if wait:
            until_up()
        yield url, until_up
    finally:
        stop_process_group(process)


def descendants_matching(pid: int, *words: str, excluding: tuple[str, ...] = ()) -> list[psutil.Process]:
    """Live processes descending from ``pid`` whose command line holds one of ``words`` and none of ``excluding``.

    A child that has just exited is a zombie until its parent reaps it, and ``cmdline()`` raises on it; such a
    process (or one gone between listing and reading) is skipped: it is not running, whatever its command was."""
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            command = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if any(w in command for w in words) and not any(x in command for x in excluding):
            found.append(child)
    return found


def engines_under(pid: int) -> list[psutil.Process]:
    """The serving engines descending from ``pid``: ``serve`` processes, not HAProxy, and not an engine's own model
    process (``transformers serve``'s: forked from its engine, the engine's command line under the engine; or
    spawned, multiprocessing's ``-c``)."""
    found = descendants_matching(pid, "serve", excluding=("haproxy", " -c "))
    pids = {p.pid for p in found}
    engines = []
    for process in found:
        with contextlib.suppress(psutil.Error):  # gone between listing and asking: not running
            if process.ppid() not in pids:
                engines.append(process)
    return engines


def child_processes_matching(*words: str) -> list[psutil.Process]:
    """Processes descending from this test process whose command line holds one of ``words`` (an orphan's look).

    Under xdist a worker runs many tests, so a session fixture's server (the shared teacher) is a child too: take
    the pids before the test and compare (``pid not in before``)."""
    return descendants_matching(os.getpid(), *words)
