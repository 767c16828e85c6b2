"""The serving service: one stable URL in front of the production checkpoint, through promotions, rollbacks,
kills and broken checkpoints. Real processes on loopback: HAProxy (Debian's package), `transformers serve`
engines on tiny models, the service started as `nexa-dagster serve`, Dagster running `model_deployment`.

One service is shared by the tests of this module (in file order: each leaves it serving checkpoint A).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg
import httpx
import psutil
import pytest
from support.services import child_processes_matching, descendants_matching, engines_under, missing

from nexa_dagster.core.common.artifacts import EvalReport
from nexa_dagster.core.common.config import REPO_ROOT
from nexa_dagster.core.common.net import free_port
from nexa_dagster.core.evaluation.promotion import ProductionEntry, ProductionRegistry
from nexa_dagster.core.evaluation.rl_eval_set import freeze_rl_eval_set
from nexa_dagster.core.serving.answer_check import text_problem
from nexa_dagster.core.serving.client import ServingServiceClient, SwitchFailed
from nexa_dagster.core.serving.haproxy import haproxy_binary
from nexa_dagster.core.tiny.model import build_tiny_causal_lm

# HAProxy and model servers switched and killed: left out of make test-fast; one worker runs the module, so the
# module's endpoint (HAProxy and an engine) starts once, not once per xdist worker
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("serving_endpoint")]

MODEL = "nexa-moe"
# what a lab hands its users (in the file NEXA_SERVING_API_KEY_FILE names), made as docs/security.md says
API_KEY = secrets.token_urlsafe(32)
CONTROL_TOKEN = secrets.token_urlsafe(32)  # in the file NEXA_SERVING_CONTROL_TOKEN_FILE names
# the LLM endpoints' keys, given to the service's environment as the pipeline's are: no engine may inherit them
LLM_KEYS = {
    "NEXA_TEACHER_API_KEY": secrets.token_urlsafe(32),
    "NEXA_JUDGE_API_KEY": secrets.token_urlsafe(32),
}
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# the address the endpoint is published on (a lab's network, here a second loopback address): the control API stays
# on 127.0.0.1, the engines on Unix sockets
PUBLISHED = "127.0.0.2"


@dataclass
class Endpoint:
    root: Path
    env: dict[str, str]
    port: int
    a: Path
    b: Path
    process: subprocess.Popen[bytes] | None = None
    logs: list[Path] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://{PUBLISHED}:{self.port}/v1"

    @property
    def key_file(self) -> Path:
        return Path(self.env["NEXA_SERVING_API_KEY_FILE"])

    def set_keys(self, *keys: str) -> None:
        """Write the key file in place (as a lab edits a mounted secret) and tell the service (SIGHUP)."""
        self.key_file.write_text("".join(f"{k}\n" for k in keys))
        assert self.process is not None
        self.process.send_signal(signal.SIGHUP)

    @property
    def serving_dir(self) -> Path:
        return Path(self.env["NEXA_DATA_ROOT"]) / "serving"

    @property
    def registry(self) -> ProductionRegistry:
        return ProductionRegistry(self.serving_dir / "production.json")

    def start(self) -> None:
        log = self.root / f"service-{len(self.logs)}.log"
        self.logs.append(log)
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "nexa_dagster.cli",
                    "serve",
                    "--port",
                    str(self.port),
                    "--host",
                    PUBLISHED,
                ],
                env={**os.environ, **self.env},
                cwd=REPO_ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.wait_serving(self.registry.current().checkpoint_id)

    def wait_serving(self, checkpoint_id: str, timeout_s: float = 240.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process is not None and self.process.poll() is None, self.log_tail()
            client = ServingServiceClient.find(self.serving_dir)
            if client is not None and (status := client.status())["checkpoint_id"] == checkpoint_id:
                return status
            time.sleep(0.5)
        raise AssertionError(
            f"the service did not serve {checkpoint_id} within {timeout_s} s:\n{self.log_tail()}"
        )

    def client(self) -> ServingServiceClient:
        client = ServingServiceClient.find(self.serving_dir)
        assert client is not None, self.log_tail()
        return client

    def log_tail(self) -> str:
        return self.logs[-1].read_text(errors="replace")[-3000:] if self.logs else ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=60)


def serving_endpoint(root: Path, a: Path, b: Path, checkpoint_roots: Path) -> Iterator[Endpoint]:
    """A service started on checkpoint ``a`` (``b``: the other one the tests switch to) under ``root``, with its
    key and control token in private files; stopped at the end, leaving no HAProxy or engine behind."""
    if haproxy_binary() is None:
        missing("haproxy", "scripts/install_services.sh, or: apt-get install haproxy")
    (root / "secrets").mkdir(mode=0o700)
    key_file, token_file = root / "secrets" / "api-key", root / "secrets" / "control-token"
    for path, secret in ((key_file, API_KEY), (token_file, CONTROL_TOKEN)):
        path.write_text(f"{secret}\n")
        path.chmod(0o600)
    env = {
        "NEXA_DATA_ROOT": str(root / "data"),
        "NEXA_RESULTS_ROOT": str(root / "results"),
        "NEXA_LANDING_ROOT": str(root / "landing"),
        "DAGSTER_HOME": str(root / "home"),
        "NEXA_SERVING_API_KEY_FILE": str(key_file),
        "NEXA_SERVING_CONTROL_TOKEN_FILE": str(token_file),
        **LLM_KEYS,
        # the tests' models and checkpoints live in pytest's folders, not in the data root's checkpoints/
        "NEXA_SERVING_CHECKPOINT_ROOTS": str(checkpoint_roots),
    }
    before = {p.pid for p in child_processes_matching("haproxy", "serve")}  # the shared teacher's server, say
    ep = Endpoint(root, env, free_port(), a, b)
    ep.serving_dir.mkdir(parents=True)
    ep.registry.promote(
        ProductionEntry(checkpoint_id="a", checkpoint_path=str(a), metric="eval_loss", value=5.0)
    )
    mp = pytest.MonkeyPatch()  # this process finds the service's control API with the configured token
    mp.setenv("NEXA_SERVING_CONTROL_TOKEN_FILE", str(token_file))
    try:
        ep.start()
        yield ep
        ep.stop()
    finally:
        mp.undo()
    left = [p for p in child_processes_matching("haproxy", "serve") if p.pid not in before]
    assert not left, [p.cmdline() for p in left]


@pytest.fixture(scope="module")
def endpoint(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoint]:
    root = tmp_path_factory.mktemp("endpoint")
    b = build_tiny_causal_lm(
        root / "checkpoints" / "tiny-b", seed=1
    )  # same shape, other weights: other answers
    yield from serving_endpoint(root, tiny_model_dir, b, tmp_path_factory.getbasetemp())


def _chat(http: httpx.Client, base_url: str, max_tokens: int = 4) -> httpx.Response:
    return http.post(
        f"{base_url}/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "What is a list?"}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
        },
    )


def _cli(ep: Endpoint, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    """``nexa-dagster <args>`` as an operator on the service's host runs it (its environment, its data root)."""
    return subprocess.run(
        [sys.executable, "-m", "nexa_dagster.cli", *args],
        cwd=REPO_ROOT,
        env={**os.environ, **ep.env},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def _streamed_chat(client: object) -> str:
    stream = client.chat.completions.create(  # type: ignore[attr-defined]
        model=MODEL,
        messages=[{"role": "user", "content": "What is a list?"}],
        max_tokens=4,
        temperature=0,
        stream=True,
    )
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


class NonStopClient:
    """The official OpenAI SDK streaming chats one after another, without pause, until stopped (bounded in count and
    time), with the key it is told to use (``key``: a client that moves to the new key during a rotation); every
    request is recorded: (time sent, 200 or the error, the answer, the key it sent). No retry: a failure counts.

    Each request goes on a connection of its own, as a client per request would, through one HTTP client kept
    without idle connections: an SDK client of its own per request built an HTTP client each time, 41 CPU-ms of
    this pytest process per request (its TLS context, unused over http) beside the engines it loads."""

    def __init__(self, base_url: str, key: str, max_requests: int = 50_000, max_s: float = 900.0) -> None:
        self.base_url, self.key, self.max_requests, self.max_s = base_url, key, max_requests, max_s
        self.records: list[tuple[float, int | str, str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import httpx
        import openai

        t0 = time.monotonic()
        no_idle_connection = httpx.Limits(max_keepalive_connections=0)  # so a connection per request
        with httpx.Client(limits=no_idle_connection) as http:
            while (
                not self._stop.is_set()
                and len(self.records) < self.max_requests
                and time.monotonic() - t0 < self.max_s
            ):
                key, sent = self.key, time.monotonic()
                client = openai.OpenAI(
                    base_url=self.base_url, api_key=key, max_retries=0, timeout=60, http_client=http
                )
                try:
                    self.records.append((sent, 200, _streamed_chat(client), key))
                except openai.OpenAIError as e:
                    self.records.append((sent, f"{type(e).__name__}: {e}", "", key))

    def __enter__(self) -> NonStopClient:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def failures(self) -> list[tuple[float, int | str, str, str]]:
        return [r for r in self.records if r[1] != 200]


def _materialize_deployment(
    ep: Endpoint, checkpoint_id: str, path: Path, decision: str, policy_file: Path | None = None
) -> dg.ExecuteInProcessResult:
    """``model_deployment`` for one checkpoint in a real Dagster run; ``eval_report`` is given (its value), with the
    gate's ``decision`` made against production "a"; ``policy_file``: another promotion policy than the repo's."""
    from nexa_dagster.assets.partitions import checkpoint_partitions
    from nexa_dagster.assets.serving import model_deployment
    from nexa_dagster.definitions import build_resources

    report = EvalReport(
        checkpoint_id=checkpoint_id,
        checkpoint_path=str(path),
        eval_set_version=1,
        eval_loss=4.0,
        eval_examples=3,
        eval_tokens=10,
        perplexity=2.0,
        num_heldout_prompts=0,
        production_checkpoint_id="a",
        gate_decision=decision,
        gate_reason=f"test: {decision}",
        report_json="-",
        report_markdown="-",
    )

    @dg.asset(name="eval_report", partitions_def=checkpoint_partitions)
    def given_eval_report() -> EvalReport:
        return report

    mp = pytest.MonkeyPatch()
    for k, v in ep.env.items():
        mp.setenv(k, v)
    try:
        instance = dg.DagsterInstance.ephemeral()
        instance.add_dynamic_partitions("checkpoints", [checkpoint_id])
        resources = {
            k: v
            for k, v in build_resources().items()
            if k in ("io_manager", "storage", "tracking", "promotion_policy")
        }
        if policy_file is not None:
            from nexa_dagster.resources.configs import PromotionResource

            resources["promotion_policy"] = PromotionResource(file=str(policy_file))
        return dg.materialize(
            [given_eval_report, model_deployment],
            partition_key=checkpoint_id,
            instance=instance,
            resources=resources,
            raise_on_error=False,
        )
    finally:
        mp.undo()


def test_serve_on_loopback_needs_no_key_says_so_and_still_guards_its_control_api(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The newcomer's `make serve`: no key file, no token file. It starts, says no API key is needed (this machine
    only), answers 200 on the public port without a key; its control API still answers 401 without the token it
    issued (in <serving dir>/control-token, mode 600), and 200 with it. (Before the shared service starts: file
    order.)"""
    if haproxy_binary() is None:
        missing("haproxy", "scripts/install_services.sh, or: apt-get install haproxy")
    serving = tmp_path / "data" / "serving"
    serving.mkdir(parents=True)
    ProductionRegistry(serving / "production.json").promote(
        ProductionEntry(checkpoint_id="a", checkpoint_path=str(tiny_model_dir), metric="eval_loss", value=5.0)
    )
    secret = {v for v in os.environ if v.startswith("NEXA_SERVING_") or v in LLM_KEYS}
    env = {k: v for k, v in os.environ.items() if k not in secret}
    env |= {"NEXA_DATA_ROOT": str(tmp_path / "data"), "NEXA_RESULTS_ROOT": str(tmp_path / "results")}
    env["NEXA_SERVING_CHECKPOINT_ROOTS"] = str(tiny_model_dir.parent)
    port, log = free_port(), tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nexa_dagster.cli", "serve", "--port", str(port)],
            env=env,
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 240
        while "Ctrl-C stops it." not in (said := log.read_text(errors="replace")):
            assert proc.poll() is None and time.monotonic() < deadline, said[-3000:]
            time.sleep(0.5)
        assert f"serving 'nexa-moe' at http://127.0.0.1:{port}/v1" in said
        assert "no API key needed: the endpoint listens on 127.0.0.1, this machine only" in said
        with httpx.Client(timeout=60.0) as http:  # no key at all
            assert http.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"] == MODEL
            assert _chat(http, f"http://127.0.0.1:{port}/v1").status_code == 200
        facts = json.loads((serving / "service.json").read_text())
        issued = serving / "control-token"
        assert issued.stat().st_mode & 0o777 == 0o600
        token = {"Authorization": f"Bearer {issued.read_text().strip()}"}
        for route in ("/status", "/v1/models", "/public/status"):
            assert httpx.get(facts["control_url"] + route, timeout=60).status_code == 401, route
        assert httpx.post(facts["control_url"] + "/switch", json={}, timeout=60).status_code == 401
        assert (
            httpx.get(facts["control_url"] + "/status", headers=token, timeout=60).json()["checkpoint_id"]
            == "a"
        )
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert not issued.exists()  # the issued token goes with the service


def test_the_official_openai_client_lists_chats_and_streams_by_the_stable_name(endpoint: Endpoint) -> None:
    import openai

    client = openai.OpenAI(base_url=endpoint.base_url, api_key=API_KEY, max_retries=0)
    models = client.models.list()
    assert [m.id for m in models] == [MODEL]
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0
    )
    assert answer.choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == answer.choices[0].message.content  # greedy: the same answer, token by token
    # the engine batches the requests in flight (the service's default): four at once, each the answer it gets alone
    engines = _engines(endpoint)
    assert engines and all("--continuous-batching" in e.cmdline() for e in engines), engines

    def ask(prompt: str) -> str:
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=12, temperature=0
        )
        return reply.choices[0].message.content or ""

    prompts = [
        "hi",
        "what is two plus two?",
        "name a river",
        "a much longer question about the weather today",
    ]
    alone = [ask(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(ask, prompts)) == alone
    status = httpx.get(endpoint.base_url.removesuffix("/v1") + "/status", headers=AUTH).json()
    assert status["checkpoint_id"] == "a" and status["model"] == MODEL
    proc = _cli(endpoint, "status", timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(
        f"endpoint: {endpoint.base_url}  model 'nexa-moe' -> a (transformers on blue"
    )


def test_the_endpoint_answers_only_a_request_with_its_api_key(endpoint: Endpoint) -> None:
    """No key, a wrong key, the key: 401, 401, 200 (HAProxy answers the 401s: the engine never sees them), the
    model list and the status alike; the key is in no file the service, HAProxy or the engines wrote."""
    import openai

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    url = f"{endpoint.base_url}/chat/completions"
    missing = httpx.post(url, json=chat, timeout=60)
    wrong = httpx.post(url, json=chat, headers={"Authorization": "Bearer sk-not-the-key"}, timeout=60)
    right = httpx.post(url, json=chat, headers=AUTH, timeout=60)
    assert (missing.status_code, wrong.status_code, right.status_code) == (401, 401, 200), right.text
    assert missing.json()["error"]["message"].startswith(
        "missing API key: send the key of the serving endpoint"
    )
    assert wrong.json()["error"]["message"] == "wrong API key for the serving endpoint"
    assert missing.headers["www-authenticate"] == "Bearer" and "x-nexa-engine" not in missing.headers
    root = endpoint.base_url.removesuffix("/v1")
    for path in ("/v1/models", "/status", "/v1/completions"):
        assert httpx.get(root + path, timeout=60).status_code == 401, path
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=endpoint.base_url, api_key="sk-wrong", max_retries=0).models.list()
    written = [
        p
        for p in endpoint.root.rglob("*")
        if p.is_file() and API_KEY.encode() in p.read_bytes() and p != endpoint.key_file
    ]
    assert written == []
    assert (endpoint.serving_dir / "router" / "haproxy.cfg").read_text().count("hmac(sha256,") == 1


def test_status_through_the_public_port_says_what_is_served_and_nothing_internal(endpoint: Endpoint) -> None:
    public = httpx.get(endpoint.base_url.removesuffix("/v1") + "/status", headers=AUTH, timeout=60)
    assert public.status_code == 200, public.text
    said = public.json()
    assert set(said) == {"model", "checkpoint_id", "serving_since"}, said
    assert said["model"] == MODEL and said["checkpoint_id"] == "a" and said["serving_since"]
    internal = endpoint.client().status()  # the control API's, with its token
    assert internal["serving_since"] == said["serving_since"]
    assert "/" not in public.text  # no path, no URL
    assert not {str(internal["engine_pid"]), str(internal["service_pid"])} & {str(v) for v in said.values()}
    assert "pid" not in public.text and "url" not in public.text and "127.0.0.1" not in public.text


def _service_tree(ep: Endpoint) -> list[psutil.Process]:
    assert ep.process is not None
    return psutil.Process(ep.process.pid).children(recursive=True)


def _engines(ep: Endpoint) -> list[psutil.Process]:
    assert ep.process is not None
    return engines_under(ep.process.pid)


def _listening(procs: list[psutil.Process]) -> set[tuple[str, int]]:
    """Every TCP address (host, port) the processes listen on."""
    found = set()
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    found.add((conn.laddr.ip, conn.laddr.port))
    return found


ROUTES = ("/", "/v1/models", "/v1/models/nexa-moe", "/status", "/public/status", "/health", "/v1/completions")


def test_every_port_the_service_opens_answers_no_route_without_its_secret(endpoint: Endpoint) -> None:
    """The service, HAProxy and the engines listen on two TCP addresses only: the endpoint on the published
    address (every route 401 without the key) and the control API on 127.0.0.1 (every route 401 without the token,
    the model list and the public status included); from the published address the control port is refused; the
    engines have no TCP port, and their Unix sockets lie in a folder only the service's user may enter."""
    assert endpoint.process is not None
    control = endpoint.client()
    control_port = int(control.control_url.rsplit(":", 1)[1])
    tree = [psutil.Process(endpoint.process.pid), *_service_tree(endpoint)]
    assert _listening(tree) == {(PUBLISHED, endpoint.port), ("127.0.0.1", control_port)}
    root = endpoint.base_url.removesuffix("/v1")
    for path in ROUTES:
        assert httpx.get(root + path, timeout=60).status_code == 401, path
        assert httpx.get(control.control_url + path, timeout=60).status_code == 401, path
    assert httpx.post(root + "/v1/chat/completions", json={}, timeout=60).status_code == 401
    assert httpx.post(control.control_url + "/switch", json={}, timeout=60).status_code == 401
    with pytest.raises(httpx.ConnectError):  # the control API is not on the published address
        httpx.get(f"http://{PUBLISHED}:{control_port}/status", timeout=10)
    token = {"Authorization": f"Bearer {control._token}"}
    assert (
        httpx.get(control.control_url + "/v1/models", headers=token, timeout=60).json()["data"][0]["id"]
        == MODEL
    )
    engines = _engines(endpoint)
    assert engines and _listening(engines) == set()
    sockets = _engine_sockets(endpoint)
    assert sockets and all(s.parent.stat().st_mode & 0o777 == 0o700 for s in sockets), sockets


def _engine_sockets(ep: Endpoint) -> set[Path]:
    return {Path(p) for e in _engines(ep) for p in e.cmdline() if p.endswith(".sock")}


def test_another_user_cannot_reach_an_engine_straight(endpoint: Endpoint) -> None:
    """User nobody cannot open an engine's socket: its folder is private (mode 700). Running as nobody needs root
    (setuid): as another user the test is skipped, saying so (the folder's mode is checked above either way)."""
    system_python = shutil.which(
        "python3", path="/usr/bin:/bin"
    )  # the venv may lie where nobody cannot enter
    if os.geteuid() != 0 or system_python is None:
        pytest.skip("running a process as user nobody needs root (and a system python3)")
    reach = "import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])"
    sockets = _engine_sockets(endpoint)
    assert sockets
    for sock in sockets:
        mine = subprocess.run([system_python, "-c", reach, str(sock)], capture_output=True, text=True)
        assert mine.returncode == 0, mine.stderr  # the socket answers: the refusal below is nobody's
        other = subprocess.run(
            [system_python, "-c", reach, str(sock)], user=65534, group=65534, capture_output=True, text=True
        )
        assert other.returncode != 0 and "PermissionError" in other.stderr, other.stderr


# what no process the service starts may hold: the secrets' values, and the variables that name or hold them
def _secrets(token: str) -> dict[str, bytes]:
    named = ("NEXA_SERVING_API_KEY", "NEXA_SERVING_CONTROL_TOKEN", *LLM_KEYS)
    return {
        "the API key": API_KEY.encode(),
        "the control token": token.encode(),
        **{f"{k}'s value": v.encode() for k, v in LLM_KEYS.items()},
        **{k: f"{k}".encode() for k in named},  # NEXA_SERVING_API_KEY_FILE and the rest by their prefix
    }


def _secrets_in(environ: bytes, token: str) -> list[str]:
    return [what for what, secret in _secrets(token).items() if secret in environ]


def test_no_engine_or_proxy_inherits_a_secret_and_what_holds_one_is_private(endpoint: Endpoint) -> None:
    """/proc/<pid>/environ of every process the service started (HAProxy, the engines and their wrappers) holds
    neither the key, nor the control token (configured, as a file: a value the service holds), nor the LLM
    endpoints' keys, nor the variables naming any of them; the service itself holds them all, so the check can
    fail (the incoming engine of a switch is read too: test_the_incoming_engine_loads_at_a_lower_priority...).
    The files that hold a digest are 600."""
    client = endpoint.client()
    token = client._token
    assert token == CONTROL_TOKEN and endpoint.process is not None
    own = Path(f"/proc/{endpoint.process.pid}/environ").read_bytes()
    assert set(_secrets_in(own, token)) == {
        "NEXA_SERVING_API_KEY",
        "NEXA_SERVING_CONTROL_TOKEN",
        *LLM_KEYS,
    } | {
        f"{k}'s value" for k in LLM_KEYS
    }  # the service's own: the files' names, and the LLM keys as the pipeline is given them
    children = _service_tree(endpoint)
    assert len(_engines(endpoint)) >= 1 and any("haproxy" in " ".join(p.cmdline()) for p in children)
    for proc in children:
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
        assert _secrets_in(environ, token) == [], proc.cmdline()[:3]
    router = endpoint.serving_dir / "router"
    for private in (router / "haproxy.cfg", router / "keys.acl"):
        assert private.stat().st_mode & 0o777 == 0o600, private
    assert not (endpoint.serving_dir / "control-token").exists()  # configured: none issued


def _wait_keys(ep: Endpoint, n: int, reloads: int) -> None:
    """Until the service has reloaded its keys since ``reloads`` (its counter: two reloads in one second count
    two) and ``n`` are valid."""
    deadline = time.monotonic() + 60
    while (s := ep.client().status())["api_keys"] != n or s["api_keys_reloads"] <= reloads:
        assert time.monotonic() < deadline, ep.log_tail()
        time.sleep(0.1)


def test_serve_refuses_a_secret_given_as_a_value_or_too_short(endpoint: Endpoint, tmp_path: Path) -> None:
    """At start, before anything listens: a key as a value (every child would inherit it) and a key under 128 bits
    are refused, each with the reason and what to do."""
    weak = tmp_path / "weak-key"
    weak.write_text("sk-lab-7c1f9e22b0\n")
    for extra, said in (
        ({"NEXA_SERVING_API_KEY": API_KEY}, "NEXA_SERVING_API_KEY gives a secret as a value"),
        (
            {"NEXA_SERVING_API_KEY_FILE": str(weak)},
            f"{weak} (line 1, NEXA_SERVING_API_KEY_FILE) holds a secret of 17",
        ),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "nexa_dagster.cli", "serve", "--port", str(free_port())],
            cwd=REPO_ROOT,
            env={**os.environ, **endpoint.env, **extra},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 1 and said in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr


def test_a_switch_without_the_control_token_is_refused_and_production_is_unchanged(
    endpoint: Endpoint, tmp_path: Path
) -> None:
    client = endpoint.client()
    with httpx.Client(timeout=60.0, headers=AUTH) as http:
        before = _chat(http, endpoint.base_url).json()["choices"][0]["message"]["content"]
    switch = {"checkpoint_path": str(endpoint.b), "checkpoint_id": "b"}
    for headers in ({}, {"Authorization": "Bearer not-the-token"}, AUTH):  # the API key is not the token
        refused = httpx.post(f"{client.control_url}/switch", json=switch, headers=headers, timeout=60)
        assert refused.status_code == 401 and "control token" in refused.json()["error"], refused.text
    assert httpx.get(f"{client.control_url}/status", timeout=60).status_code == 401
    # with the token, a checkpoint outside the folders it may load from (here through a link inside one) is refused
    outside = Path(tempfile.mkdtemp(prefix="not-a-checkpoint-folder-"))
    try:
        shutil.copytree(endpoint.b, outside / "b")
        (tmp_path / "link").symlink_to(outside / "b")
        with pytest.raises(
            SwitchFailed, match="outside the folders the serving service loads checkpoints from"
        ):
            client.switch(str(tmp_path / "link"), "outside")
    finally:
        shutil.rmtree(outside)
    assert endpoint.registry.current().checkpoint_id == "a"
    assert client.status()["checkpoint_id"] == "a" and client.status()["engine_restarts"] == 0
    with httpx.Client(timeout=60.0, headers=AUTH) as http:
        assert _chat(http, endpoint.base_url).json()["choices"][0]["message"]["content"] == before


def _nice(pid: int) -> list[int]:
    """The nice value of every thread of ``pid`` (field 19 of /proc/<pid>/task/<tid>/stat: a nice value is a
    thread's), as the kernel schedules them."""
    values = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread that just ended
            values.append(int((task / "stat").read_text().rsplit(")", 1)[1].split()[16]))
    return values


class _IncomingEngine(threading.Thread):
    """A switch watched from outside: the engine the service starts beside the serving one (once its wrapper has
    exec'd `transformers serve`), its environment read while it loads, and both engines' thread nice values sampled
    every 50 ms until ``done`` (a sample is dropped once either engine is gone)."""

    def __init__(self, ep: Endpoint) -> None:
        super().__init__(daemon=True)
        assert ep.process is not None
        self.service_pid, self.serving = ep.process.pid, ep.client().status()["engine_pid"]
        self.process: psutil.Process | None = None
        self.environ: dict[str, str] = {}
        self.raw_environ = b""
        # the nice values of (the incoming engine's threads, the serving one's)
        self.samples: list[tuple[list[int], list[int]]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while self.process is None and not self.done.is_set():
            started = engines_under(self.service_pid)
            self.process = next((p for p in started if p.pid != self.serving), None)
            time.sleep(0.05)
        if self.process is None:
            return
        with contextlib.suppress(psutil.Error, FileNotFoundError):  # gone already: the assertions say so
            self.environ = self.process.environ()
            self.raw_environ = Path(f"/proc/{self.process.pid}/environ").read_bytes()  # while it loads
        while not self.done.is_set():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                self.samples.append((_nice(self.process.pid), _nice(self.serving)))
            time.sleep(0.05)

    def assert_loaded_at_a_lower_priority_until_promoted(self, ep: Endpoint) -> None:
        """While it loaded beside the serving engine, its every thread ran at nice 10 with fewer OpenMP threads
        that sleep when idle, the serving one's at 0; once it passed its smoke test and took the traffic, its
        threads are back at 0. It inherited no secret."""
        from nexa_dagster.core.serving.service import default_loading_threads

        assert self.process is not None and ep.client().status()["engine_pid"] == self.process.pid
        assert _secrets_in(self.raw_environ, CONTROL_TOKEN) == []
        assert self.environ["OMP_WAIT_POLICY"] == "PASSIVE"
        assert self.environ["OMP_NUM_THREADS"] == str(default_loading_threads())
        samples = self.samples
        assert samples and samples[0][0] and set(samples[0][0]) == {10}, samples[:3]  # loading: every thread
        assert all(set(s[1]) <= {0} for s in samples), samples  # the serving engine keeps its priority
        levels = [set(s[0]) for s in samples if s[0]]
        # nice 10 until the promotion, then 0; the service renices thread by thread, so a sample taken meanwhile
        # holds both (seen once, the machine loaded by a vLLM promotion beside it), never 10 again after it
        raised = next((i for i, lv in enumerate(levels) if lv != {10}), len(levels))
        settled = next((i for i, lv in enumerate(levels) if lv == {0}), len(levels))
        assert all(lv == {10} for lv in levels[:raised]), levels
        assert all(lv == {0, 10} for lv in levels[raised:settled]), levels
        assert all(lv == {0} for lv in levels[settled:]), levels
        assert set(_nice(self.process.pid)) == {0}  # promoted: the normal priority, every thread
        autogroup = Path(f"/proc/{self.process.pid}/autogroup")
        if autogroup.exists():  # the kernel's autogroups: the engines share the service's, so nice ranks them
            assert autogroup.read_text() == Path(f"/proc/{self.service_pid}/autogroup").read_text()


def test_a_promotion_a_rollback_and_a_key_rotation_fail_no_request(endpoint: Endpoint) -> None:
    """model_deployment (a real Dagster run) switches the endpoint to B, `nexa-dagster rollback` back to A, while a
    client (the official OpenAI SDK, streaming) sends chats without pause, and the lab rotates the key meanwhile:
    the key file gets the new key beside the old one (SIGHUP: both valid), the client moves to the new key, the old
    line goes (SIGHUP). No request fails, after each switch every answer is the new one's, and afterwards the old
    key gets openai.AuthenticationError. A weak key written meanwhile is refused and changes nothing. B loads at a
    lower priority than A until it is promoted (``_IncomingEngine``: one switch watched for both, since the
    priority is the switch's own)."""
    import openai

    new_key = secrets.token_urlsafe(32)
    client = endpoint.client()
    try:
        with NonStopClient(endpoint.base_url, API_KEY) as load:
            time.sleep(2)
            deploying = time.monotonic()
            _rotate(endpoint, API_KEY, new_key)  # both valid from here
            incoming = _IncomingEngine(endpoint)
            incoming.start()
            try:
                result = _materialize_deployment(endpoint, "b", endpoint.b, "promote")
            finally:
                incoming.done.set()
                incoming.join(timeout=30)
            assert result.success
            promoted = time.monotonic()
            incoming.assert_loaded_at_a_lower_priority_until_promoted(endpoint)
            load.key = new_key  # the client moves to the new key
            # the step also materializes production_model (the promotion's event): read model_deployment's own
            (deployed,) = [
                m
                for m in result.asset_materializations_for_node("model_deployment")
                if m.asset_key == dg.AssetKey("model_deployment")
            ]
            meta = {k: v.value for k, v in deployed.metadata.items()}
            assert meta["endpoint"] == endpoint.base_url and meta["checkpoint_served"] == "b"
            assert meta["previous_checkpoint"] == "a" and text_problem(meta["smoke_response"]) is None
            assert endpoint.registry.current().checkpoint_id == "b"
            time.sleep(2)
            _rotate(endpoint, new_key)  # the old key is refused from here
            rolling_back = time.monotonic()
            proc = _cli(endpoint, "rollback", timeout_s=600)
            assert proc.returncode == 0, proc.stderr[-2000:]
            assert "rolled back: production is a again (was b)" in proc.stdout
            rolled_back = time.monotonic()
            time.sleep(2)
        old_n = sum(1 for r in load.records if r[3] == API_KEY)
        print(  # the figure docs/security.md quotes (pytest -s)
            f"promotion, rotation, rollback: {len(load.records)} streamed chats ({old_n} with the old key, "
            f"{len(load.records) - old_n} with the new), {len(load.failures())} failed"
        )
        assert load.failures() == [], load.failures()[:5]
        assert {r[3] for r in load.records} == {API_KEY, new_key}
        _answers_follow_the_switches(load, deploying, promoted, rolling_back, rolled_back)
        assert endpoint.registry.current().checkpoint_id == "a"
        assert client.status()["checkpoint_id"] == "a"
        with pytest.raises(openai.AuthenticationError):
            _streamed_chat(openai.OpenAI(base_url=endpoint.base_url, api_key=API_KEY, max_retries=0))
        assert _streamed_chat(openai.OpenAI(base_url=endpoint.base_url, api_key=new_key, max_retries=0))
        _a_weak_key_changes_nothing(endpoint, new_key)
    finally:  # as the other tests expect it: the first key, and A in production
        _rotate(endpoint, API_KEY)
        if endpoint.registry.current().checkpoint_id == "b":  # failed between the promotion and the rollback
            _cli(endpoint, "rollback", timeout_s=600)  # its own failure would hide this test's: not checked


def _answers_follow_the_switches(
    load: NonStopClient, deploying: float, promoted: float, rolling_back: float, rolled_back: float
) -> None:
    """One answer per model (greedy), B's after the promotion, A's again after the rollback."""
    answers_a = {r[2] for r in load.records if r[0] < deploying}
    answers_b = {r[2] for r in load.records if promoted < r[0] < rolling_back}
    answers_a_again = {r[2] for r in load.records if r[0] > rolled_back}
    sent = f"{len(load.records)} requests sent (at most {load.max_requests})"  # a client at its cap stops
    assert len(answers_a) == 1 and len(answers_b) == 1, (answers_a, answers_b, sent)
    assert answers_b != answers_a and answers_a_again == answers_a, (answers_a, answers_b, answers_a_again)


def _rotate(ep: Endpoint, *keys: str) -> None:
    """The key file holds ``keys`` (in place, as a lab edits a mounted secret), SIGHUP, until the service says so."""
    reloads = ep.client().status()["api_keys_reloads"]
    ep.set_keys(*keys)
    _wait_keys(ep, len(keys), reloads)


def _a_weak_key_changes_nothing(ep: Endpoint, valid: str) -> None:
    """A weak key in the file: refused with the reason in the log, the keys before stay the valid ones."""
    import openai

    before = {k: ep.client().status()[k] for k in ("api_keys_loaded_at", "api_keys_reloads")}
    ep.set_keys(valid, "short-key")
    deadline = time.monotonic() + 60
    while "the API keys were not changed" not in ep.log_tail():
        assert time.monotonic() < deadline, ep.log_tail()
        time.sleep(0.1)
    assert "at least 128 bits are required" in ep.log_tail()
    assert {k: ep.client().status()[k] for k in before} == before
    with pytest.raises(openai.AuthenticationError):
        _streamed_chat(openai.OpenAI(base_url=ep.base_url, api_key="short-key", max_retries=0))


def _failure_message(result: dg.ExecuteInProcessResult, node: str) -> str:
    failure = result.failure_data_for_node(node)
    assert failure is not None and failure.error is not None
    return failure.error.message


def test_a_checkpoint_that_cannot_load_fails_the_deployment_and_the_old_one_keeps_serving(
    endpoint: Endpoint, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(endpoint.a, broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    with httpx.Client(timeout=60.0, headers=AUTH) as http:
        before = _chat(http, endpoint.base_url).json()["choices"][0]["message"]["content"]
        result = _materialize_deployment(endpoint, "broken", broken, "promote")
        assert not result.success
        message = _failure_message(result, "model_deployment")
        assert "did not switch to broken" in message and "broken did not start, a keeps serving" in message, (
            message
        )
        assert _chat(http, endpoint.base_url).json()["choices"][0]["message"]["content"] == before
    assert endpoint.registry.current().checkpoint_id == "a"  # pointer, alias and traffic agree
    assert endpoint.client().status()["checkpoint_id"] == "a"


def test_a_checkpoint_held_back_by_the_gate_is_a_successful_run_that_deploys_nothing(
    endpoint: Endpoint,
) -> None:
    """A tie with production, held back by the gate: the run succeeds, nothing is materialized."""
    result = _materialize_deployment(endpoint, "tie", endpoint.b, "hold back")
    assert result.success
    assert result.asset_materializations_for_node("model_deployment") == []
    assert endpoint.registry.current().checkpoint_id == "a"
    assert endpoint.client().status()["checkpoint_id"] == "a"


def _garbage_model(source: Path, out: Path) -> Path:
    """A's weights, made to answer only with tokens that are lone bytes of multi-byte UTF-8 characters (every
    other token is suppressed): an answer of U+FFFD characters, the tiny models' failure mode."""
    from transformers import AutoTokenizer

    shutil.copytree(source, out)
    tok = AutoTokenizer.from_pretrained(out)
    text_tokens = [i for i in range(len(tok)) if "\ufffd" not in tok.decode([i])]
    config = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**config, "suppress_tokens": text_tokens}))
    return out


def test_a_checkpoint_that_answers_garbage_fails_its_smoke_test(endpoint: Endpoint, tmp_path: Path) -> None:
    garbage = _garbage_model(endpoint.a, tmp_path / "garbage")
    with pytest.raises(
        SwitchFailed,
        match="garbage failed its smoke test, a keeps serving: the answer does not decode to text",
    ):
        endpoint.client().switch(str(garbage), "garbage")
    assert endpoint.client().status()["checkpoint_id"] == "a"


def test_a_canary_decided_on_live_traffic_is_promoted_and_the_pointer_follows_it(
    endpoint: Endpoint, tmp_path: Path
) -> None:
    """``model_deployment`` with a ``canary`` in the promotion policy (a real Dagster run): B serves half of the live
    requests beside A (the API key's, through the endpoint), its state in the control API's status while it runs,
    decided by the service's runner on HAProxy's request log, promoted with the production pointer and the MLflow
    alias moved to it and not one failed request; a share out of range, a canary that could never be promoted, a
    canary that answers garbage and a second canary while one runs are refused before anything changes. Then back
    to A (the module's next tests expect A)."""
    client = endpoint.client()
    with pytest.raises(SwitchFailed, match="share"):
        client.canary(str(endpoint.b), "b", policy={"share": 1.5})
    # quality watched (the default) with neither an answer book nor a judge: it could never be promoted
    with pytest.raises(SwitchFailed, match="nothing can score live answers"):
        client.canary(str(endpoint.b), "b", policy={"share": 0.5})
    # failures and the quality of every answer watched with wide limits: the tiny engines answer every request and
    # no checkable prompt right (both score 0), so a few hundred requests decide; the answer book is the frozen RL
    # eval set of the service's data root, which model_deployment hands the service, holding the live prompt
    policy = {
        "share": 0.5,
        "max_failure_increase": 0.2,
        "max_slow_increase": None,
        "max_quality_drop": 0.5,
        "quality_sample_share": 1.0,
    }
    book = _freeze_answer_book(Path(endpoint.env["NEXA_DATA_ROOT"]) / "rl_eval_sets")
    # a canary whose engine answers garbage never takes a request: refused with the smoke test's reason
    garbage = _garbage_model(endpoint.a, tmp_path / "garbage")
    with pytest.raises(SwitchFailed, match="garbage failed its smoke test, a keeps serving"):
        client.canary(str(garbage), "garbage", policy=policy, answer_book=book)
    assert client.status()["canary"] is None and client.status()["checkpoint_id"] == "a"
    policy_file = _policy_with_canary(tmp_path, policy)
    statuses: Counter = Counter()
    engines: Counter = Counter()
    stop = threading.Event()

    def live_traffic() -> None:
        with httpx.Client(timeout=60.0, headers=AUTH) as http:
            while not stop.is_set():
                r = _chat(http, endpoint.base_url, max_tokens=1)
                statuses[r.status_code] += 1
                engines[r.headers.get("x-nexa-engine")] += 1

    traffic = threading.Thread(target=live_traffic, daemon=True)
    traffic.start()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        deploying = pool.submit(_materialize_deployment, endpoint, "b", endpoint.b, "promote", policy_file)
        try:
            deadline = time.monotonic() + 300
            while (running := client.status()["canary"]) is None and not deploying.done():
                assert time.monotonic() < deadline, endpoint.log_tail()
                time.sleep(0.2)
            assert running is not None, deploying.result()
            assert running["checkpoint_id"] == "b" and running["share"] == 0.5
            with pytest.raises(SwitchFailed, match="a canary of b runs"):
                client.canary(str(endpoint.b), "b", policy=policy)
            result = deploying.result(timeout=600)
        finally:
            stop.set()
            traffic.join(timeout=60)
    assert result.success
    status = client.status()
    assert status["last_canary"]["verdict"] == "promote", status
    assert status["checkpoint_id"] == "b" and endpoint.registry.current().checkpoint_id == "b"
    (deployed,) = [
        m
        for m in result.asset_materializations_for_node("model_deployment")
        if m.asset_key == dg.AssetKey("model_deployment")
    ]
    meta = {k: v.value for k, v in deployed.metadata.items()}
    assert (meta["checkpoint_served"], meta["previous_checkpoint"]) == ("b", "a")
    assert endpoint.registry.current().mlflow_version == meta["mlflow_model_version"].split("/")[-1]
    assert set(statuses) == {200} and set(engines) == {"blue", "green"}, (statuses, engines)
    # the engines' real answers were kept by HAProxy, read and scored by the reward on both backends
    quality = re.search(r"quality: .*?n = (\d+) stable, (\d+) canary", status["last_canary"]["reason"])
    assert quality is not None and min(map(int, quality.groups())) > 0, status["last_canary"]
    print(
        f"canary promoted through model_deployment after {sum(statuses.values())} live requests: {dict(engines)}; "
        f"{status['last_canary']['reason']}"
    )
    endpoint.registry.rollback()
    endpoint.wait_serving("a")


def _freeze_answer_book(root: Path) -> str:
    """An RL eval set whose prompts include the live traffic's (``_chat``'s), with answers the tiny models never
    give: both backends' answers are checkable and score 0."""
    items = [
        {
            "item_id": f"topic:doc{i}",
            "doc_id": f"doc{i}",
            "task": "topic",
            "prompt": prompt,
            "answer": "sequence",
            "reference": "sequence",
            "choices": ["sequence", "mapping"],
        }
        for i, prompt in enumerate(["What is a list?", "What is a dict?"])
    ]
    return freeze_rl_eval_set(items, str(root), 1, {}, log=lambda _: None)["prompts_path"]


def _policy_with_canary(tmp_path: Path, canary: dict) -> Path:
    """The repo's promotion policy with ``canary`` set, as a file of the test's."""
    import yaml

    path = tmp_path / "promotion.yaml"
    repo_policy = yaml.safe_load((REPO_ROOT / "configs" / "promotion.yaml").read_text())
    path.write_text(yaml.safe_dump({**repo_policy, "canary": canary}))
    return path


def test_a_canary_undecided_at_its_time_limit_is_rolled_back_and_nothing_is_deployed(
    endpoint: Endpoint, tmp_path: Path
) -> None:
    """``model_deployment`` with a canary and no traffic: the service's runner rolls it back at its time limit ("not
    enough traffic"), and the deployment is a recorded decision, not a failure: the run succeeds, nothing is
    materialized, its outcome says rolled back with the reason, A still serves and the pointer names A."""
    from nexa_dagster.core.serving.outcomes import read_outcome

    policy = {"share": 0.5, "max_failure_increase": 0.2, "max_slow_increase": None, "max_quality_drop": None}
    result = _materialize_deployment(
        endpoint, "b", endpoint.b, "promote", _policy_with_canary(tmp_path, {**policy, "max_duration_s": 5})
    )
    assert result.success
    assert not [
        m
        for m in result.asset_materializations_for_node("model_deployment")
        if m.asset_key == dg.AssetKey("model_deployment")
    ]
    status = endpoint.client().status()
    assert status["last_canary"]["verdict"] == "roll back", status
    assert status["checkpoint_id"] == "a" and endpoint.registry.current().checkpoint_id == "a"
    outcome = read_outcome(Path(endpoint.env["NEXA_RESULTS_ROOT"]) / "deployments" / "b")
    assert outcome is not None and outcome["outcome"] == "rolled back", outcome
    assert outcome["reason"] == status["last_canary"]["reason"] and outcome["production_after"] == "a"


def test_a_service_killed_mid_canary_restarts_serving_production_with_the_canary_rolled_back(
    endpoint: Endpoint,
) -> None:
    """kill -9 of the service while B is a canary beside A: the canary's engine dies with it; started again, the
    service serves the production pointer's A, and the canary's state says it was rolled back and why (a canary
    never left half-promoted, nor running with no engine)."""
    from nexa_dagster.core.serving.canary_store import load as load_canary

    policy = {"share": 0.5, "max_failure_increase": 0.01, "max_slow_increase": None, "max_quality_drop": None}
    endpoint.client().canary(str(endpoint.b), "b", policy=policy)  # a tight limit: undecided for a while
    assert load_canary(endpoint.serving_dir).running
    assert endpoint.process is not None
    endpoint.process.kill()
    endpoint.process.wait(timeout=30)
    endpoint.start()  # waits until it serves the pointer's checkpoint, a
    canary = load_canary(endpoint.serving_dir)
    assert canary.verdict == "roll back" and "restarted while the canary ran" in canary.reason
    assert endpoint.registry.current().checkpoint_id == "a"
    status = endpoint.client().status()
    assert status["checkpoint_id"] == "a" and status["canary"] is None
    with httpx.Client(timeout=60.0, headers=AUTH) as http:
        assert {_chat(http, endpoint.base_url).headers["x-nexa-engine"] for _ in range(6)} == {
            status["colour"]
        }


def test_a_person_stops_a_canary_and_the_sensor_in_a_real_daemon_shows_it_across_the_daemon_s_kill(
    endpoint: Endpoint, tmp_path: Path
) -> None:
    """Issue 50's sensor and stop on the real service and a real ``dagster-daemon``: B a canary beside A;
    ``canary_sensor``, running in the daemon (turned on as an operator does, the other automation off), observes it
    on ``model_deployment``'s partition b (share, stable, figures); the daemon is killed with SIGKILL and started
    again, and its next tick, with the cursor Dagster kept, reports nothing again (no traffic: the same figures);
    ``stop_canary_job`` (a real Dagster run) stops it: every new request on A's colour, B's engine stopped, the
    state file and the status saying "roll back, stopped by a person: ..."; the restarted daemon records that
    decision once (its key in the kept cursor). A stop with no canary: 409, nothing changes; an empty reason: 400."""
    from nexa_dagster.core.serving.canary_store import load as load_canary
    from nexa_dagster.jobs.canary import stop_canary_job
    from nexa_dagster.resources.storage import StorageResource

    client = endpoint.client()
    with pytest.raises(SwitchFailed, match="no canary runs"):
        client.stop_canary("nothing runs")
    assert client._call("POST", "/canary/stop", {"reason": " "})[0] == 400
    home = tmp_path / "dagster-home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    workspace = home / "workspace.yaml"
    workspace.write_text("load_from:\n  - python_module: nexa_dagster.definitions\n")
    env = {**endpoint.env, "DAGSTER_HOME": str(home), "NEXA_AUTOMATION": "off"}
    bin_dir = Path(sys.executable).parent
    started = subprocess.run(
        [str(bin_dir / "dagster"), "sensor", "start", "canary_sensor", "-w", str(workspace)],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-3000:]
    policy = {"share": 0.5, "max_failure_increase": 0.01, "max_slow_increase": None, "max_quality_drop": None}
    client.canary(str(endpoint.b), "b", policy=policy)  # a tight limit and no traffic: undecided
    log = tmp_path / "daemon.log"

    def daemon() -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            return subprocess.Popen(
                [str(bin_dir / "dagster-daemon"), "run", "-w", str(workspace)],
                env=env,
                cwd=REPO_ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    with dg.DagsterInstance.from_config(str(home)) as instance:
        instance.add_dynamic_partitions("checkpoints", ["b"])

        def observed() -> list[dict]:
            records = instance.fetch_observations(dg.AssetKey("model_deployment"), limit=50).records
            events = [r.asset_observation for r in records if r.asset_observation is not None]
            return [{"partition": e.partition, **{k: v.value for k, v in e.metadata.items()}} for e in events]

        def sensor_state() -> Any:
            (state,) = [s for s in instance.all_instigator_state() if s.name == "canary_sensor"]
            return state

        def ticks() -> int:
            state = sensor_state()
            return len(instance.get_ticks(state.instigator_origin_id, state.selector_id))

        def kept_cursor() -> dict:
            return json.loads(sensor_state().instigator_data.cursor or "{}")

        def wait(what: str, done: Callable[[], bool], timeout_s: float = 180) -> None:
            deadline = time.monotonic() + timeout_s
            while not done():
                assert time.monotonic() < deadline, f"{what}:\n{log.read_text(errors='replace')[-3000:]}"
                time.sleep(0.5)

        first = daemon()
        try:
            wait("the daemon's sensor observes the running canary", lambda: len(observed()) >= 1)
            (running,) = observed()
            assert (running["partition"], running["canary_state"], running["share"]) == ("b", "running", 0.5)
            assert running["stable"] == "a" and set(running["figures"]) == {"failed"}
            # killed once the tick is over: Dagster stores a tick's events before its cursor, so a daemon killed in
            # between reports that check again (at least once; the alias move is idempotent)
            wait("the tick's cursor is kept", lambda: kept_cursor().get("check") is not None)
        finally:
            os.killpg(first.pid, signal.SIGKILL)  # the daemon and the code server it started, as a lost node
            first.wait(timeout=30)
        before = ticks()
        second = daemon()
        try:
            wait("the restarted daemon ticks", lambda: ticks() > before)
            assert observed() == [running]  # the kept cursor: the same check is not reported again
            stopped = stop_canary_job.execute_in_process(
                run_config={"ops": {"stop_canary": {"config": {"reason": "a test stops it"}}}},
                resources={
                    "storage": StorageResource(
                        data_root=endpoint.env["NEXA_DATA_ROOT"],
                        results_root=endpoint.env["NEXA_RESULTS_ROOT"],
                    )
                },
                instance=instance,
            )
            assert stopped.success
            status = client.status()
            assert status["canary"] is None and status["checkpoint_id"] == "a", status
            assert status["last_canary"]["reason"] == "stopped by a person: a test stops it"
            saved = load_canary(endpoint.serving_dir)
            assert (saved.verdict, saved.reason) == ("roll back", "stopped by a person: a test stops it")
            assert endpoint.registry.current().checkpoint_id == "a" and len(_engines(endpoint)) == 1
            with httpx.Client(timeout=60.0, headers=AUTH) as http:
                assert {_chat(http, endpoint.base_url).headers["x-nexa-engine"] for _ in range(6)} == {
                    status["colour"]
                }
            wait("the decision is observed", lambda: len(observed()) == 2)
            # as above: the tick's events are stored before its cursor; kill after the cursor (the clean-clone
            # suite once killed in between, and the decision's key was not in the cursor yet)
            wait(
                "the tick's cursor keeps the decision",
                lambda: any("a test stops it" in key for key in kept_cursor().get("decided", [])),
            )
        finally:
            os.killpg(second.pid, signal.SIGKILL)
            second.wait(timeout=30)
        decided = observed()[0]  # newest first
        assert (
            decided["partition"] == "b"
            and decided["verdict"] == "roll back"
            and decided["stopped_by_a_person"]
        )
        assert "production_alias" not in decided
        # recorded once: its key is in the cursor Dagster kept (watch() reports no key it holds: unit-tested)
        assert any("stopped by a person: a test stops it" in key for key in kept_cursor()["decided"])


def test_kill_9_of_the_engine_restarts_it(endpoint: Endpoint) -> None:
    status = endpoint.client().status()
    os.kill(status["engine_pid"], signal.SIGKILL)
    deadline = time.monotonic() + 180
    while (now := endpoint.client().status())["engine_restarts"] == status["engine_restarts"] or now[
        "engine_pid"
    ] == status["engine_pid"]:
        assert time.monotonic() < deadline, endpoint.log_tail()
        time.sleep(0.5)
    with httpx.Client(
        timeout=60.0, headers=AUTH
    ) as http:  # the endpoint answers again once the new engine is up
        while (code := _chat(http, endpoint.base_url).status_code) != 200:
            assert code == 503 and time.monotonic() < deadline, endpoint.log_tail()
            time.sleep(0.5)
    assert now["checkpoint_id"] == "a" and now["engine_restarts"] == status["engine_restarts"] + 1
    # HAProxy routes to the new engine as soon as it answers, a moment before the service's restart returns and
    # clears the error an earlier test left (a failed switch, say): wait for the restart to finish, not for a request
    while (last := endpoint.client().status()["last_error"]) is not None and "did not restart" not in last:
        assert time.monotonic() < deadline, endpoint.log_tail()
        time.sleep(0.2)
    assert last is None


def test_kill_9_of_the_service_then_a_restart_serves_production(endpoint: Endpoint) -> None:
    """Killed outright, the service takes HAProxy and the engine with it; started again, it serves the checkpoint
    the production pointer names (moved meanwhile, as a deployment would)."""
    assert endpoint.process is not None
    children = psutil.Process(endpoint.process.pid).children(recursive=True)
    assert descendants_matching(endpoint.process.pid, "haproxy")
    endpoint.process.kill()
    endpoint.process.wait(timeout=30)
    _, alive = psutil.wait_procs(children, timeout=60)
    assert not alive, [p.cmdline() for p in alive]
    endpoint.registry.promote(
        ProductionEntry(
            checkpoint_id="b", checkpoint_path=str(endpoint.b), metric="validation_loss", value=4.0
        )
    )
    endpoint.start()  # waits until it serves b
    with httpx.Client(timeout=60.0, headers=AUTH) as http:
        r = _chat(http, endpoint.base_url)
    assert r.status_code == 200 and endpoint.client().status()["checkpoint_id"] == "b"


def test_a_rollback_whose_service_dies_mid_switch_says_in_one_line_what_production_is(
    endpoint: Endpoint,
) -> None:
    """`nexa-dagster rollback` asks the service to switch back to A; the service is killed (kill -9) while the
    incoming engine starts. The command fails with one line saying where production stands (the pointer and the
    alias unchanged, the endpoint serving nothing), no traceback; a restarted service serves the pointer's model."""
    assert endpoint.process is not None
    if not endpoint.registry.state().history:  # run alone: something to roll back to first
        endpoint.registry.promote(
            ProductionEntry(checkpoint_id="b", checkpoint_path=str(endpoint.b), metric="eval_loss", value=4.0)
        )
        endpoint.wait_serving("b")
    current = endpoint.registry.current()
    service = psutil.Process(endpoint.process.pid)

    def engines() -> list[psutil.Process]:
        return engines_under(service.pid)

    deadline = time.monotonic() + 120
    while len(engines()) != 1:  # a switch just before (run alone) stops its old engine after routing
        assert time.monotonic() < deadline, endpoint.log_tail()
        time.sleep(0.2)
    rollback = subprocess.Popen(
        [sys.executable, "-m", "nexa_dagster.cli", "rollback"],
        cwd=REPO_ROOT,
        env={**os.environ, **endpoint.env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while len(engines()) < 2:  # until the incoming engine has started: the switch is under way
            assert rollback.poll() is None, rollback.communicate()
            assert time.monotonic() < deadline, endpoint.log_tail()
            time.sleep(0.05)
        children = service.children(recursive=True)
        endpoint.process.kill()
        endpoint.process.wait(timeout=30)
        psutil.wait_procs(children, timeout=60)
        out, err = rollback.communicate(timeout=300)
    finally:
        if rollback.poll() is None:
            rollback.kill()
    assert rollback.returncode == 1, (out, err)
    assert "Traceback" not in out + err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"rollback to {endpoint.registry.state().history[-1].checkpoint_id} failed"), err
    assert f"production is unchanged: the pointer still names {current.checkpoint_id}" in err, err
    from nexa_dagster.resources.tracking import TrackingResource

    alias = TrackingResource(data_root=endpoint.env["NEXA_DATA_ROOT"]).alias_version(MODEL, "production")
    said = (
        f"on version {alias[0]} ({alias[1]})" if alias else "not set"
    )  # set by the deployment test, if it ran
    assert f"the MLflow alias production is {said}" in err, err
    assert "the endpoint serves nothing: the serving service is gone" in err, err
    assert endpoint.registry.current().checkpoint_id == current.checkpoint_id
    endpoint.start()  # waits until it serves the pointer's checkpoint again
