"""The Dagster UI behind its password, as docker compose runs it (`nexa-dagster ui-proxy`: HAProxy with basic
authentication in front of `dagster-webserver`), seen from outside the stack.

The stack's network is 127.0.0.1 (the webserver listens there, as on compose's network); the published address is
127.0.0.2 (the proxy listens there, as compose publishes port 3000). From the published address: no UI and no
GraphQL (where a run, model_deployment included, is launched) without the password; the webserver itself is not
there at all. A real webserver serves a one-asset code location (the whole one is test_ui.py's).
"""

from __future__ import annotations

import base64
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.services import free_port, missing

from nexa_dagster.core.common.config import REPO_ROOT
from nexa_dagster.core.common.processes import stop_process_group
from nexa_dagster.core.serving.haproxy import haproxy_binary

# a Dagster webserver and HAProxy started for real: left out of make test-fast; one worker runs the module, so the
# stack starts once, not once per xdist worker
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ui_proxy")]

PUBLISHED, STACK = "127.0.0.2", "127.0.0.1"
LAUNCH = '{"query": "mutation { launchRun(executionParams: {}) { __typename } }"}'


def _wait(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            httpx.get(url, timeout=2)
            return
        except httpx.HTTPError:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[
                -3000:
            ]
            time.sleep(0.5)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    if haproxy_binary() is None:
        missing("haproxy", "scripts/install_services.sh, or: apt-get install haproxy")
    root = tmp_path_factory.mktemp("ui-stack")
    (root / "home").mkdir()
    (root / "home" / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    (root / "defs.py").write_text(
        "import dagster as dg\n\n\n@dg.asset\ndef model_deployment() -> None:\n    pass\n\n\n"
        "defs = dg.Definitions(assets=[model_deployment])\n"
    )
    password = secrets.token_urlsafe(32)
    secret = root / "ui-password"
    secret.write_text(password + "\n")
    secret.chmod(0o600)
    env = {**os.environ, "DAGSTER_HOME": str(root / "home"), "NEXA_UI_PASSWORD_FILE": str(secret)}
    web_port, ui_port = free_port(), free_port()
    procs = []
    try:
        with open(root / "webserver.log", "wb") as log:
            web = subprocess.Popen(
                [str(Path(sys.executable).parent / "dagster-webserver"), "-h", STACK, "-p", str(web_port),
                 "-f", str(root / "defs.py")],
                env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        procs.append(web)
        with open(root / "ui.log", "wb") as log:
            ui = subprocess.Popen(
                [sys.executable, "-m", "nexa_dagster.cli", "ui-proxy", "--host", PUBLISHED, "--port", str(ui_port),
                 "--upstream", f"{STACK}:{web_port}", "--work-dir", str(root / "proxy")],
                env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        procs.append(ui)
        _wait(f"http://{STACK}:{web_port}/server_info", web, root / "webserver.log")
        _wait(f"http://{PUBLISHED}:{ui_port}/", ui, root / "ui.log")
        yield {
            "root": root,
            "password": password,
            "ui": ui,
            "web_port": web_port,
            "url": f"http://{PUBLISHED}:{ui_port}",
        }
    finally:
        for proc in procs:
            stop_process_group(proc, grace_s=30)


def _basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def test_from_outside_the_stack_no_ui_and_no_launch_without_the_password(stack: dict) -> None:
    url, password = stack["url"], stack["password"]
    for headers in (
        {},
        _basic("nexa", "not-the-password"),
        _basic("admin", password),
        {"Authorization": "Bearer x"},
    ):
        page = httpx.get(url + "/", headers=headers, timeout=30)
        assert page.status_code == 401, (headers, page.status_code)
        assert page.headers["www-authenticate"] == 'Basic realm="nexa-dagster"'
        launch = httpx.post(
            url + "/graphql", content=LAUNCH, headers={**headers, "content-type": "application/json"}
        )
        assert launch.status_code == 401 and "launchRun" not in launch.text
    with pytest.raises(httpx.ConnectError):  # the webserver is not on the published address at all
        httpx.get(f"http://{PUBLISHED}:{stack['web_port']}/", timeout=10)
    # with the password: the real webserver answers, GraphQL included (what a browser's UI talks to)
    right = _basic("nexa", password)
    info = httpx.get(url + "/server_info", headers=right, timeout=60)
    assert info.status_code == 200 and "dagster_webserver_version" in info.json()
    query = httpx.post(url + "/graphql", json={"query": "{ version }"}, headers=right, timeout=60)
    assert query.status_code == 200 and query.json()["data"]["version"]
    assert httpx.get(url + "/", headers=right, timeout=60).status_code == 200


def test_the_proxy_holds_no_password_and_hands_none_to_haproxy(stack: dict) -> None:
    """HAProxy took the command's place (exec): its environment has no password file; its configuration holds a
    salted digest, not the password, readable by its owner only."""
    ui, password = stack["ui"], stack["password"]
    assert "haproxy" in Path(f"/proc/{ui.pid}/cmdline").read_text()
    environ = Path(f"/proc/{ui.pid}/environ").read_bytes()
    assert b"NEXA_UI_PASSWORD_FILE" not in environ and password.encode() not in environ
    for name in ("ui-proxy.cfg", "ui-users.acl"):
        written = stack["root"] / "proxy" / name
        assert written.stat().st_mode & 0o777 == 0o600 and password not in written.read_text(), name
    assert (stack["root"] / "proxy").stat().st_mode & 0o777 == 0o700


def test_a_weak_or_missing_password_is_refused_at_start(tmp_path: Path) -> None:
    weak = tmp_path / "weak"
    weak.write_text("dagster123\n")
    for env, said in (
        ({"NEXA_UI_PASSWORD_FILE": str(weak)}, "at least 128 bits are required"),
        ({}, "the UI proxy needs a password"),
    ):
        base = {k: v for k, v in os.environ.items() if not k.startswith("NEXA_UI_")}
        proc = subprocess.run(
            [sys.executable, "-m", "nexa_dagster.cli", "ui-proxy", "--port", str(free_port()),
             "--work-dir", str(tmp_path / "proxy")],
            env={**base, **env}, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 1 and said in proc.stderr, proc.stderr[-2000:]
