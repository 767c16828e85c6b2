"""The serving service: one stable OpenAI-compatible URL that always answers with the production checkpoint.

Shape: HAProxy listens on the stable port and routes to one of two engine processes, ``blue`` and ``green``
(``transformers serve`` on a CPU host, ``vllm serve`` on a GPU host), each serving its checkpoint under the stable
model name (``nexa-moe``). A switch (a promotion, a rollback) starts the new checkpoint on the idle colour, waits
for its health and a smoke request whose answer must be text, then routes new requests to it while the old
colour drains (its requests in flight finish), and only then stops the old engine. A checkpoint that does not
start or fails its smoke test is stopped and the old one keeps serving; the switch fails with the reason.

The service supervises the serving engine (an engine that dies is restarted on its port) and follows the
production pointer: a pointer that moves (a deployment or a rollback while the service was busy, by hand) is
switched to. Its control API (on loopback unless told otherwise: a container's network), every route behind its
token: ``GET /status``, ``GET /v1/models``, ``POST /switch``. The public routes (``/v1/models`` and the public
status, behind the API key) reach it from HAProxy on a Unix socket of their own; the engines too listen on Unix
sockets, in a folder only the service's user may enter: no port of the service answers without a secret
(docs/security.md). SIGHUP re-reads the API key file: the keys it holds are the valid ones from then on, without a
restart or a closed connection. ``service.json`` in the serving directory says where it listens.

Every engine is started and stopped by the main thread: the engines are told to die with the thread that
started them (``PR_SET_PDEATHSIG``), so a ``kill -9`` of the service leaves no engine and no HAProxy behind,
and the control API's request threads hand their work to the main thread through a queue.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import json
import logging
import os
import queue
import signal
import socketserver
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from nexa_dagster import settings
from nexa_dagster.core.common import storage
from nexa_dagster.core.evaluation.promotion import ProductionEntry, ProductionRegistry
from nexa_dagster.core.llm.base import LLMError
from nexa_dagster.core.llm.managed_server import ManagedServer
from nexa_dagster.core.serving import access
from nexa_dagster.core.serving.canary import STOPPED, CanaryPolicy, CanaryState
from nexa_dagster.core.serving.canary_runner import CanaryRunner
from nexa_dagster.core.serving.canary_store import Canary, CanaryStateError
from nexa_dagster.core.serving.canary_store import load as load_canary
from nexa_dagster.core.serving.canary_store import save as save_canary
from nexa_dagster.core.serving.client import SERVICE_FILE, SwitchFailed, SwitchResult
from nexa_dagster.core.serving.haproxy import (
    COLOURS,
    PUBLIC_STATUS,
    HAProxyRouter,
    RouterError,
    socket_dir,
)
from nexa_dagster.core.serving.live_quality import AnswerBook, AnswerBookError
from nexa_dagster.core.serving.smoke import now_utc, smoke_request

log = logging.getLogger(__name__)
# HAProxy's request lines, in the engines' private socket folder (a canary reads it)
REQUEST_LOG = "requests.sock"


@dataclass
class ServedEngine:
    colour: str
    checkpoint_id: str
    checkpoint_path: str
    engine: ManagedServer
    since: str = field(default_factory=now_utc)


class ServiceAlreadyRunning(RuntimeError):
    pass


def default_loading_threads() -> int:
    """Half the cores (at least one): the other half stays with the engine that serves while one loads."""
    return max(1, (os.cpu_count() or 2) // 2)


def _refuse_open_listeners(
    host: str, control_host: str, api_keys: Sequence[str] | None, control_token: str | None
) -> None:
    """Off loopback, the endpoint needs a key and the control API a configured token (SecretMissing otherwise)."""
    if not api_keys and not access.is_loopback(host):
        raise access.SecretMissing(
            f"the endpoint would listen on {host} with no API key: write one to a file (mode 600) and set "
            f"NEXA_SERVING_API_KEY_FILE (clients send it as `Authorization: Bearer <key>`; make one with "
            f"{access.MAKE_ONE})"
        )
    if control_token is None and not access.is_loopback(control_host):
        raise access.SecretMissing(
            f"the control API would listen on {control_host} with no token of its own: set "
            "NEXA_SERVING_CONTROL_TOKEN_FILE for the service and the pipeline"
        )


class ServingService:
    """``ServingService(serving_dir, pointer, port=8000).run()`` serves until SIGTERM/SIGINT.

    ``continuous_batching``: a ``transformers serve`` engine batches the requests in flight (True, the default, on
    every device: live traffic is concurrent; SmolLM2-135M-Instruct under four clients on the idle 2-core CPU
    served 1.71x the requests a second, p50 1.63 against 2.99 s, and the same at one client, with 0.87 GB more
    memory, ``bench/serving_batching.py``); False answers one at a time (its KV cache's memory, 5 % of a CPU host's,
    stays free); None: ``ManagedServer``'s default, a GPU only. vLLM batches whatever this says.
    """

    # a canary beside the served model (core/serving/canary_runner.py): its runner, its engine, the last outcome
    canary_runner: CanaryRunner | None = None
    canary_engine: ServedEngine | None = None
    last_canary: dict[str, Any] | None = None

    def __init__(
        self,
        serving_dir: str | Path,
        production_pointer: str,
        port: int,
        model_name: str = "nexa-moe",
        engine: str = "auto",
        startup_timeout_s: float = 300.0,
        poll_s: float = 0.5,
        drain_timeout_s: float = 120.0,
        host: str = "127.0.0.1",
        control_port: int = 0,
        logger: logging.Logger | None = None,
        api_keys: Sequence[str] | None = None,
        control_token: str | None = None,
        control_host: str = "127.0.0.1",
        reload_api_keys: Callable[[], list[str]] | None = None,
        checkpoint_roots: Sequence[Path] | None = None,
        loading_nice: int = 10,
        loading_threads: int | None = None,
        canary_check_s: float = 2.0,
        judge: Any = None,
        continuous_batching: bool | None = True,
    ) -> None:
        self.dir = Path(serving_dir)
        # who gets in (access.py): the endpoint's keys (none: open, loopback only; SIGHUP asks reload_api_keys for
        # the valid ones), the control API's token (None: a fresh one at each start, in <serving_dir>/control-token),
        # where checkpoints may be loaded from (None: anywhere, for a caller that checked)
        _refuse_open_listeners(host, control_host, api_keys, control_token)
        self.api_keys, self.control_token = list(api_keys or []), control_token
        self.reload_api_keys = reload_api_keys
        # when the valid keys last changed (microseconds: two reloads in one second are told apart) and how many
        # times they did: what a rotation script waits on (GET /status)
        self.keys_loaded_at, self.keys_reloads = now_utc("microseconds"), 0
        self._reload_requested = threading.Event()
        self.checkpoint_roots = list(checkpoint_roots) if checkpoint_roots is not None else None
        # an engine that loads while another serves: a lower CPU priority and fewer OpenMP threads until it passed
        # its smoke test (then its priority is raised to the normal one), so that the serving engine keeps its pace
        self.loading_nice = loading_nice
        self.loading_threads = loading_threads if loading_threads is not None else default_loading_threads()
        # the endpoint's host (0.0.0.0 in a container); the control API's (in a container: the compose network)
        self.host, self.control_host, self.control_port = host, control_host, control_port
        self.pointer = production_pointer
        self.port, self.model_name, self.engine_kind = port, model_name, engine
        self.continuous_batching = continuous_batching  # the class docstring
        self.startup_timeout_s, self.poll_s, self.drain_timeout_s = startup_timeout_s, poll_s, drain_timeout_s
        self.log = logger or log
        self.engine_sockets: dict[str, Path] = {}  # set at start, in socket_dir (private)
        self.active: ServedEngine | None = None
        self.previous_checkpoint_id: str | None = None
        self.last_switch: dict[str, Any] | None = None
        self.last_error: str | None = None
        self.engine_restarts = 0
        self._tasks: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = queue.Queue()
        self._stopping = threading.Event()
        self._seen_pointer: str | None = None
        self.router: HAProxyRouter | None = None
        self._http: ThreadingHTTPServer | None = None
        self.canary_check_s, self.judge = canary_check_s, judge  # a canary's check period; its answers' judge

    @property
    def api_key(self) -> str | None:
        """The first valid key (what the start message's example sends), or None for an open endpoint."""
        return self.api_keys[0] if self.api_keys else None

    @property
    def base_url(self) -> str:
        """The endpoint as a client on this host reaches it (the host it binds, unless that is every address)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}/v1"

    # -- life cycle ----------------------------------------------------------------------------------------------
    def run(self, ready: Callable[[ServingService], None] | None = None) -> None:
        """Serve the production checkpoint, then follow switches and supervise the engine until stopped."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with self._exclusive(), contextlib.ExitStack() as stack:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self._stopping.set())
            signal.signal(signal.SIGHUP, lambda *_: self._reload_requested.set())
            if self.control_token is None:
                self.control_token = access.issue_control_token(self.dir)
                stack.callback(lambda: (self.dir / access.TOKEN_FILE).unlink(missing_ok=True))
            sockets = socket_dir(self.dir)
            self.engine_sockets = {c: sockets / f"{c}.sock" for c in COLOURS}
            self._http = self._serve_http(
                ThreadingHTTPServer((self.control_host, self.control_port), _control_handler(self)), stack
            )
            public_socket = sockets / "public.sock"
            public_socket.unlink(missing_ok=True)
            self._serve_http(_UnixHTTPServer(str(public_socket), _control_handler(self, public=True)), stack)
            stack.callback(lambda: public_socket.unlink(missing_ok=True))
            self.router = HAProxyRouter(
                self.dir / "router",
                self.port,
                self.engine_sockets,
                public_socket,
                host=self.host,
                logger=self.log,
                api_keys=self.api_keys,
                request_log=sockets / REQUEST_LOG,
            ).start()
            stack.callback(self.router.stop)
            stack.callback(self._stop_engine)
            self._settle_canary()  # one recorded as running lost its engine with the last service
            self._follow_pointer()  # serve what is in production now
            control_host = "127.0.0.1" if self.control_host in ("0.0.0.0", "::", "") else self.control_host
            storage.write_json(
                {
                    "pid": os.getpid(),
                    "base_url": self.base_url,
                    "model_name": self.model_name,
                    "control_url": f"http://{control_host}:{self._http.server_address[1]}",
                    "started_at": now_utc(),
                },
                self.dir / SERVICE_FILE,
            )
            stack.callback(lambda: (self.dir / SERVICE_FILE).unlink(missing_ok=True))
            self.log.info(
                "serving %s at %s (checkpoint %s)",
                self.model_name,
                self.base_url,
                self.active.checkpoint_id if self.active else "none yet",
            )
            if ready:
                ready(self)
            while not self._stopping.is_set():
                self._run_tasks(timeout_s=self.poll_s)
                if self._reload_requested.is_set():
                    self._reload_requested.clear()
                    self.reload_keys()
                self._tick()

    def stop(self) -> None:
        self._stopping.set()

    def _tick(self) -> None:
        """Between tasks: an engine that died restarted, a decided canary ended, a moved pointer followed."""
        self._supervise()
        self._follow_canary()
        self._follow_pointer()

    @staticmethod
    def _serve_http(server: socketserver.BaseServer, stack: contextlib.ExitStack) -> Any:
        server.daemon_threads = True  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, name="control-api", daemon=True).start()
        stack.callback(server.shutdown)
        return server

    def reload_keys(self) -> bool:
        """Make the key file's keys the valid ones (SIGHUP): during a rotation the file holds the old key and the
        new one, both valid, then the new one alone. A file that cannot be read, or holds a weak key, changes
        nothing (the keys valid before stay valid) and says why in the log. Main thread only."""
        if self.reload_api_keys is None or self.router is None:
            self.log.warning(
                "SIGHUP: this service was given its keys directly, it has no key file to re-read"
            )
            return False
        try:
            keys = self.reload_api_keys()
            added, removed = self.router.set_keys(keys)
        except (access.SecretMissing, RouterError, OSError) as e:
            self.log.error("SIGHUP: the API keys were not changed, the ones before stay valid: %s", e)
            return False
        self.api_keys, self.keys_loaded_at = keys, now_utc("microseconds")
        self.keys_reloads += 1
        self.log.info("SIGHUP: %d API key(s) valid now (%d added, %d removed)", len(keys), added, removed)
        return True

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        with open(self.dir / "service.lock", "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ServiceAlreadyRunning(
                    f"a serving service already runs for {self.dir} (see {self.dir / SERVICE_FILE})"
                ) from None
            yield

    def _run_tasks(self, timeout_s: float) -> None:
        try:
            task, future = self._tasks.get(timeout=timeout_s)
        except queue.Empty:
            return
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(task())
            except BaseException as e:  # handed to the waiting request thread
                future.set_exception(e)

    def submit(self, task: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run ``task`` on the main thread (the one that owns the engines); any thread may call this."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._tasks.put((task, future))
        return future

    # -- the engine ----------------------------------------------------------------------------------------------
    def _supervise(self) -> None:
        """An engine that died (killed, crashed) is restarted on its port; HAProxy keeps routing to that port."""
        served = self.active
        if served is None or served.engine.process is None or served.engine.process.poll() is None:
            return
        code = served.engine.process.returncode
        self.engine_restarts += 1
        self.log.warning(
            "the %s engine (%s) exited with code %s; restarting it", served.colour, served.checkpoint_id, code
        )
        served.engine.stop()
        try:
            served.engine.start()
            self.last_error = None
        except (LLMError, OSError) as e:
            self.last_error = (
                f"the engine of {served.checkpoint_id} exited with code {code} and did not restart: {e}"
            )
            self.log.error(self.last_error)

    def _stop_engine(self) -> None:
        if self.canary_runner is not None:
            self.canary_runner.stop()  # its state stays saved: the next start settles it
        if self.canary_engine is not None:
            self.canary_engine.engine.stop()
        if self.active is not None:
            self.active.engine.stop()

    def _follow_pointer(self) -> None:
        try:
            current = ProductionRegistry(self.pointer).current()
        except (OSError, ValueError) as e:
            self.log.warning("cannot read the production pointer %s: %s", self.pointer, e)
            return
        key = f"{current.checkpoint_id}:{current.checkpoint_path}" if current else None
        if current is None or key == self._seen_pointer:
            return
        self._seen_pointer = key
        if self.active is not None and self.active.checkpoint_path == str(Path(current.checkpoint_path)):
            return
        self.log.info("the production pointer names %s: switching to it", current.checkpoint_id)
        try:
            self.switch(current.checkpoint_path, current.checkpoint_id)
        except SwitchFailed as e:
            self.log.error("%s", e)

    def switch(self, checkpoint_path: str, checkpoint_id: str) -> SwitchResult:
        """Blue/green: start ``checkpoint_path`` on the idle colour, smoke-test it, route to it, drain the old one.

        Main thread only (``submit`` it from elsewhere). Raises ``SwitchFailed`` with the reason, leaving the old
        checkpoint serving, when the new one does not start or does not answer with text.
        """
        t0 = time.perf_counter()
        old = self.active
        if old is not None and old.checkpoint_path == checkpoint_path and old.checkpoint_id == checkpoint_id:
            return self._result(old, old.checkpoint_id, t0, 0.0, "", 0.0)  # already serving it
        if self.canary_runner is not None:
            return self._failed(checkpoint_id, f"{checkpoint_id} refused: {self._canary_running()}")
        colour = COLOURS[0] if old is None or old.colour == COLOURS[1] else COLOURS[1]
        engine, smoke = self._ready_engine(colour, checkpoint_path, checkpoint_id)
        assert self.router is not None
        drain_s = self.router.route_to(colour, self.drain_timeout_s)
        self.active = ServedEngine(colour, checkpoint_id, checkpoint_path, engine)
        self.previous_checkpoint_id = old.checkpoint_id if old else None
        if old is not None:
            old.engine.stop()
        self.last_error = None
        result = self._result(
            self.active, self.previous_checkpoint_id, t0, drain_s, smoke.text, smoke.latency_s
        )
        self.last_switch = result.model_dump()
        self.log.info(
            "now serving %s on %s (was %s), switch took %.1f s",
            checkpoint_id,
            colour,
            self.previous_checkpoint_id,
            result.switch_s,
        )
        return result

    def _ready_engine(
        self, colour: str, checkpoint_path: str, checkpoint_id: str
    ) -> tuple[ManagedServer, Any]:
        """``checkpoint_path`` started on ``colour`` beside the served engine, smoke-tested, at the normal priority:
        what a switch and a canary both route to, from the allowed folders only. Raises ``SwitchFailed`` (the served
        model keeps serving)."""
        if self.checkpoint_roots is not None and (
            refused := access.outside_roots(checkpoint_path, self.checkpoint_roots)
        ):
            return self._failed(checkpoint_id, f"{checkpoint_id} refused, {self._still_serving()}: {refused}")
        serving = self.active.engine if self.active is not None else None
        try:
            engine = self._start_engine(colour, checkpoint_path, serving)
        except (LLMError, ValueError, OSError) as e:
            return self._failed(checkpoint_id, f"{checkpoint_id} did not start, {self._still_serving()}: {e}")
        smoke = smoke_request(
            engine.base_url, engine.model_name, timeout_s=60.0, max_retries=1, uds=engine.socket_path
        )
        if not smoke.ok:
            tail = engine.log_tail(10)
            engine.stop()
            return self._failed(
                checkpoint_id,
                f"{checkpoint_id} failed its smoke test, {self._still_serving()}: "
                f"{smoke.problem}" + (f"\nengine log tail:\n{tail}" if not smoke.text else ""),
            )
        # it passed: it takes traffic at the normal priority
        if engine.nice and (problems := engine.renice(0)):
            self.log.warning(
                "the %s engine keeps part of its loading priority (nice +%d): %s",
                colour,
                engine.nice,
                "; ".join(problems[:3]),
            )
        return engine, smoke

    # -- a canary ------------------------------------------------------------------------------------------------
    def start_canary(
        self,
        checkpoint_path: str,
        checkpoint_id: str,
        policy: CanaryPolicy,
        entry: dict[str, Any] | None = None,
        answer_book: str | None = None,
    ) -> dict[str, Any]:
        """``checkpoint_path`` on the idle colour beside the served model, taking ``policy.share`` of the requests
        until its runner decides (``_follow_canary`` then ends it). ``entry``: the production pointer's entry to
        write if it is promoted; ``answer_book``: the checkable prompts whose live answers the verifiable reward
        scores (``live_quality``; others go to the service's judge, if it has one). Main thread only; raises
        ``SwitchFailed`` before anything changes when no model is served, a canary already runs, it watches
        quality with nothing to score answers with, or the checkpoint does not start or pass its smoke test."""
        if self.active is None:
            self._failed(
                checkpoint_id, f"{checkpoint_id}: no canary without a served model to compare it with"
            )
        assert self.active is not None and self.router is not None
        if self.canary_runner is not None:
            self._failed(checkpoint_id, f"{checkpoint_id} refused: {self._canary_running()}")
        book = self._answer_book(checkpoint_id, policy, answer_book)  # refused before an engine starts
        colour = next(c for c in COLOURS if c != self.active.colour)
        engine, _ = self._ready_engine(colour, checkpoint_path, checkpoint_id)
        state = CanaryState.start(self.active.checkpoint_id, checkpoint_id, policy, time.time())
        canary = Canary(self.active.colour, colour, policy, state, entry=entry)
        try:
            runner = CanaryRunner(
                self.router,
                self.dir,
                socket_dir(self.dir) / REQUEST_LOG,
                self.canary_check_s,
                answer_book=book,
                judge=self.judge,
            ).start(canary)
        except (CanaryStateError, RouterError) as e:
            engine.stop()
            self._failed(checkpoint_id, f"{checkpoint_id}: no canary, {self._still_serving()}: {e}")
        self.canary_runner = runner
        self.canary_engine = ServedEngine(colour, checkpoint_id, checkpoint_path, engine)
        self.log.info(
            "canary %s on %s: %.0f%% of requests beside %s",
            checkpoint_id,
            colour,
            100 * policy.share,
            self.active.checkpoint_id,
        )
        return {
            "canary": checkpoint_id,
            "colour": colour,
            "stable": self.active.checkpoint_id,
            "share": policy.share,
        }

    def _answer_book(self, checkpoint_id: str, policy: CanaryPolicy, path: str | None) -> AnswerBook | None:
        """The answer book a canary that watches quality scores checkable answers with; refused (``SwitchFailed``)
        when it cannot be read, or when there is neither a book nor a judge: such a canary could never be
        promoted."""
        if "quality" not in policy.figures():
            return None
        try:
            book = AnswerBook.load(path) if path else None
        except AnswerBookError as e:
            self._failed(checkpoint_id, f"{checkpoint_id}: no canary: {e}")
        if book is None and self.judge is None:
            self._failed(
                checkpoint_id,
                f"{checkpoint_id}: the canary watches quality (max_quality_drop) but nothing can score live "
                "answers: give it an answer book (the frozen RL eval set's prompts.jsonl) or serve with a judge "
                "(NEXA_JUDGE_URL), or max_quality_drop: null",
            )
        return book

    def _canary_running(self) -> str:
        canary = self.canary_runner.canary if self.canary_runner is not None else None
        return f"a canary of {canary.state.canary_id if canary else '?'} runs: wait for its decision"

    def _follow_canary(self) -> None:
        """A decided canary ends here, on the main thread: promoted, its engine is the served one (the old one
        stops) and the production pointer names it; rolled back, its engine stops."""
        runner, engine = self.canary_runner, self.canary_engine
        decision = runner.decision if runner is not None else None
        if runner is None or engine is None or decision is None or decision.verdict == "continue":
            return
        canary = runner.canary
        assert canary is not None
        if decision.verdict == "promote":
            old, self.active = self.active, engine
            self.previous_checkpoint_id = old.checkpoint_id if old else None
            if old is not None:
                old.engine.stop()
            self._promote_pointer(canary)
        else:
            engine.engine.stop()
        self.last_canary = {
            "checkpoint_id": engine.checkpoint_id,
            "verdict": decision.verdict,
            "reason": decision.reason,
            "decided_at": now_utc(),
            "started_at": canary.state.started_at,  # tells two canaries of one checkpoint apart
        }
        self.canary_runner = self.canary_engine = None
        self.log.info("canary %s: %s: %s", engine.checkpoint_id, decision.verdict, decision.reason)

    def stop_canary(self, reason: str) -> dict[str, Any]:
        """A person stops the running canary (``POST /canary/stop``): its runner routes every new request back to
        the stable colour and saves "roll back" with the reason "stopped by a person: <reason>", then it ends here
        as any rolled-back canary (its engine stops). Returns ``last_canary``. Main thread only; raises
        ``SwitchFailed`` when no canary runs, or when its runner decided before the stop (that verdict stands and
        the canary is ended by it)."""
        runner, engine = self.canary_runner, self.canary_engine
        if runner is None or engine is None:
            raise SwitchFailed("no canary runs: nothing to stop")
        decision = runner.stop_canary(reason)
        self._follow_canary()
        if decision.reason != f"{STOPPED}{reason}":
            raise SwitchFailed(
                f"the canary of {engine.checkpoint_id} was decided before the stop: {decision.verdict}: "
                f"{decision.reason}"
            )
        assert self.last_canary is not None
        return dict(self.last_canary)

    def _promote_pointer(self, canary: Canary) -> None:
        """The production pointer names a promoted canary (when the canary was given the pointer's entry)."""
        if canary.entry is None:
            return
        entry = ProductionEntry.model_validate(canary.entry)
        registry = ProductionRegistry(self.pointer)
        current = registry.current()
        if current is None or current.checkpoint_id != entry.checkpoint_id:
            registry.promote(entry)

    def _settle_canary(self) -> None:
        """At start: a canary recorded as running lost its engine with the last service, so it is recorded as
        rolled back (the stable model serves, as the pointer says); one recorded as promoted whose pointer move was
        cut short gets it now. An unreadable state file is logged by name and changes nothing."""
        try:
            canary = load_canary(self.dir)
        except CanaryStateError as e:
            self.log.error("%s; serving the production pointer's model", e)
            return
        if canary is None:
            return
        if canary.running:
            canary.verdict = "roll back"
            canary.reason = (
                "the serving service restarted while the canary ran: its engine stopped with the service; "
                "the production pointer's model serves"
            )
            save_canary(canary, self.dir)
            self.log.warning("canary %s: %s", canary.state.canary_id, canary.reason)
        elif canary.verdict == "promote":
            self._promote_pointer(canary)

    def _start_engine(
        self, colour: str, checkpoint_path: str, serving: ManagedServer | None
    ) -> ManagedServer:
        """``checkpoint_path`` in an engine of ``colour``, on its private socket, healthy (raises otherwise)."""
        engine = ManagedServer(
            checkpoint_path,
            self.dir / "engines" / colour,
            engine=self.engine_kind,
            socket_path=self.engine_sockets[colour],
            startup_timeout_s=self.startup_timeout_s,
            served_model_name=self.model_name,
            continuous_batching=self.continuous_batching,
            logger=self.log,
            **self._engine_resources(serving),
        )
        return engine.start(attempts=1)

    def _engine_resources(self, serving: ManagedServer | None) -> dict[str, Any]:
        """What an engine starts with beyond the engine's thread policy (``settings.thread_policy("engine")``:
        idle OpenMP threads that sleep rather than spin, which would take the CPU from the other engine and from
        the HTTP threads of their own): while ``serving`` serves, a priority ``loading_nice`` below it and
        ``loading_threads`` OpenMP threads (an OpenMP pool is sized when the engine starts). Below it, not below
        the service: an engine whose priority could not be raised back (no ``CAP_SYS_NICE``) still serves ahead
        of the next one loading."""
        env: dict[str, str] = {}
        if serving is None:
            return {"extra_env": env, "own_session": False}
        if self.loading_threads > 0:  # OpenMP's, MKL's and OpenBLAS's counts, the engine's wait policy
            engine = settings.thread_policy("engine")
            env.update(replace(engine, threads=self.loading_threads).env())
        # in the service's session: with autogroups the engines yield to each other, not to every other session
        return {"extra_env": env, "nice": min(19, serving.nice + self.loading_nice), "own_session": False}

    def _still_serving(self) -> str:
        return f"{self.active.checkpoint_id} keeps serving" if self.active else "nothing is served"

    def _failed(self, checkpoint_id: str, reason: str) -> SwitchResult:
        self.last_error = reason
        self.last_switch = {"checkpoint_id": checkpoint_id, "failed_at": now_utc(), "error": reason}
        raise SwitchFailed(reason)

    def _result(
        self,
        served: ServedEngine,
        previous: str | None,
        t0: float,
        drain_s: float,
        smoke: str,
        smoke_latency_s: float,
    ) -> SwitchResult:
        return SwitchResult(
            checkpoint_id=served.checkpoint_id,
            checkpoint_path=served.checkpoint_path,
            previous_checkpoint_id=previous,
            endpoint=self.base_url,
            model_name=self.model_name,
            colour=served.colour,
            switched_at=served.since,
            switch_s=time.perf_counter() - t0,
            drain_s=drain_s,
            smoke_response=smoke,
            smoke_latency_s=smoke_latency_s,
            engine=served.engine.engine,
        )

    # -- what the control API reports ----------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        served = self.active
        return {
            "endpoint": self.base_url,
            "model": self.model_name,
            "checkpoint_id": served.checkpoint_id if served else None,
            "checkpoint_path": served.checkpoint_path if served else None,
            "colour": served.colour if served else None,
            "engine": served.engine.engine if served else None,
            "engine_pid": served.engine.pid if served else None,
            "engine_socket": served.engine.socket_path
            if served
            else None,  # the engine itself (this user only)
            "serving_since": served.since if served else None,
            "previous_checkpoint_id": self.previous_checkpoint_id,
            "engine_restarts": self.engine_restarts,
            "last_switch": self.last_switch,
            "last_error": self.last_error,
            "canary": self._canary_status(),
            "last_canary": self.last_canary,
            "service_pid": os.getpid(),
            "api_keys": len(self.api_keys),  # how many keys are valid (two during a rotation), never the keys
            "api_keys_loaded_at": self.keys_loaded_at,
            "api_keys_reloads": self.keys_reloads,  # successful reloads since the start
        }

    def _canary_status(self) -> dict[str, Any] | None:
        """The running canary: what serves beside what, its share and its figures so far (the last check's)."""
        runner, engine = self.canary_runner, self.canary_engine
        if runner is None or engine is None or runner.canary is None:
            return None
        decision = runner.decision
        return {
            "checkpoint_id": engine.checkpoint_id,
            "colour": engine.colour,
            "share": runner.canary.policy.share,
            "since": engine.since,
            "last_check": decision.reason if decision else None,
            # every kept answer: scored by the reward or the judge per arm, unscored, dropped (scorer behind)
            "answers": dict(runner.scorer.counts) if runner.scorer is not None else None,
            **(decision.metadata() if decision else {}),
        }

    def public_status(self) -> dict[str, Any]:
        """What anyone holding the API key may know (``GET /status`` through the public port): what is served and
        since when; no path, process id, internal URL or error text."""
        served = self.active
        return {
            "model": self.model_name,
            "checkpoint_id": served.checkpoint_id if served else None,
            "serving_since": served.since if served else None,
        }

    def models(self) -> dict[str, Any]:
        served = self.active
        data = (
            []
            if served is None
            else [
                {
                    "id": self.model_name,
                    "object": "model",
                    "owned_by": "nexa-dagster",
                    "created": int(Path(served.checkpoint_path).stat().st_mtime)
                    if Path(served.checkpoint_path).exists()
                    else 0,
                    "checkpoint_id": served.checkpoint_id,
                }
            ]
        )
        return {"object": "list", "data": data}


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """The control API's public routes on a Unix socket, for HAProxy alone (its folder is private)."""


def _control_handler(service: ServingService, public: bool = False) -> type[BaseHTTPRequestHandler]:
    """The control API's handler: on its TCP port every route wants the control token; ``public``: the routes
    HAProxy forwards once the API key was checked (the model list, the public status), on the private socket."""
    return type("ControlAPI", (_ControlAPI,), {"service": service, "public": public})


class _ControlAPI(BaseHTTPRequestHandler):
    """``GET /status``, ``GET /v1/models`` and ``POST /switch`` (JSON, with the control token); on the public
    socket ``GET /v1/models`` and ``GET /public/status`` only."""

    service: ServingService
    public: bool

    def address_string(self) -> str:  # a Unix socket's peer has no address
        return str(self.client_address[0]) if self.client_address else "unix"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        self.service.log.debug("control API: " + format, *args)

    def _send(self, code: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _authorized(self) -> bool:
        """The control token is required (401 otherwise); the caller is told which header carries it."""
        assert self.service.control_token is not None
        given = self.headers.get(access.CONTROL_TOKEN_HEADER)
        if access.same_secret(given, access.bearer(self.service.control_token)):
            return True
        said = (
            "no control token: send `Authorization: Bearer <token>`"
            if given is None
            else "wrong control token"
        )
        where = " (NEXA_SERVING_CONTROL_TOKEN_FILE, or <serving dir>/control-token on the service's host)"
        self._send(401, {"error": said + where})
        return False

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        path, service = self.path.split("?")[0], self.service
        if not self.public and not self._authorized():
            return
        if path == PUBLIC_STATUS:  # HAProxy's rewrite of the public port's /status
            self._send(200, service.public_status())
        elif path == "/status" and not self.public:
            self._send(200, service.status())
        elif path == "/v1/models":
            self._send(200, service.models())
        elif path.startswith("/v1/models/"):
            found = [m for m in service.models()["data"] if m["id"] == path.rsplit("/", 1)[1]]
            self._send(200, found[0]) if found else self._send(404, {"error": {"message": "no such model"}})
        else:
            self._send(404, {"error": f"no route {path}"})

    def do_POST(self) -> None:  # noqa: N802
        if self.public:
            self._send(404, {"error": f"no route {self.path}"})
        elif not self._authorized():
            return
        elif self.path == "/switch":
            self._switch()
        elif self.path == "/canary":
            self._canary()
        elif self.path == "/canary/stop":
            self._canary_stop()
        else:
            self._send(404, {"error": f"no route {self.path}"})

    def _canary_stop(self) -> None:
        """``POST /canary/stop``, ``{"reason": "..."}``: a person rolls the running canary back; 409 when none runs."""
        try:
            body = self._json_body()
            reason = str(body.get("reason") or "").strip() if isinstance(body, dict) else ""
        except ValueError:  # not JSON
            reason = ""
        if not reason:
            self._send(
                400, {"error": 'POST /canary/stop wants JSON with a non-empty reason: {"reason": "..."}'}
            )
            return
        service = self.service
        self._on_main_thread(lambda: service.stop_canary(reason))

    def _json_body(self) -> dict[str, Any]:
        return json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")

    def _on_main_thread(self, task: Callable[[], dict[str, Any]]) -> None:
        """``task`` on the service's main thread (it owns the engines); its answer, 409 with the reason when it was
        refused (the served model keeps serving), 500 for anything else."""
        service = self.service
        try:
            answer = service.submit(task).result()
        except SwitchFailed as e:
            self._send(409, {"error": str(e)})
            return
        except Exception as e:  # noqa: BLE001 - reported to the caller, the service keeps serving
            self._send(500, {"error": f"{type(e).__name__}: {e}"})
            return
        self._send(200, answer)

    def _canary(self) -> None:
        try:
            body = self._json_body()
            path, checkpoint_id = str(body["checkpoint_path"]), str(body["checkpoint_id"])
            policy = CanaryPolicy.model_validate(body.get("policy") or {})
            entry, answer_book = body.get("entry"), body.get("answer_book")
            if entry is not None:
                ProductionEntry.model_validate(entry)
        except (ValueError, KeyError) as e:  # pydantic's ValidationError is a ValueError
            self._send(
                400,
                {"error": f"POST /canary wants JSON with checkpoint_path, checkpoint_id, policy, entry: {e}"},
            )
            return
        service = self.service
        self._on_main_thread(lambda: service.start_canary(path, checkpoint_id, policy, entry, answer_book))

    def _switch(self) -> None:
        try:
            body = self._json_body()
            path, checkpoint_id = str(body["checkpoint_path"]), str(body["checkpoint_id"])
        except (ValueError, KeyError) as e:
            self._send(400, {"error": f"POST /switch wants JSON with checkpoint_path and checkpoint_id: {e}"})
            return
        service = self.service
        self._on_main_thread(lambda: service.switch(path, checkpoint_id).model_dump())
