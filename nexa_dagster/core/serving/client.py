"""How Dagster and the CLI reach a running serving service: ``service.json`` in the serving directory says
where its control API listens; ``switch`` asks it to serve another checkpoint and waits for the outcome."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from nexa_dagster import settings
from nexa_dagster.core.serving import access

SERVICE_FILE = "service.json"
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class SwitchFailed(RuntimeError):
    """The service did not switch (the new checkpoint did not start or failed its smoke test); the old one
    keeps serving. The message is the service's reason."""


class ControlRefused(RuntimeError):
    """The control API refused the call: no token, or not its token. Not an ``OSError``: a service that refuses is
    there, and must not be mistaken for no service (then a deployment would go around it)."""


class SwitchResult(BaseModel):
    """What one deployment did: which checkpoint serves now, instead of which, since when, and its smoke answer."""

    checkpoint_id: str
    checkpoint_path: str
    previous_checkpoint_id: str | None = None
    endpoint: str | None = None  # the stable base URL; None when no serving service runs (temporary engine)
    model_name: str
    colour: str | None = None
    switched_at: str
    switch_s: float = 0.0  # from the request to traffic on the new engine (engine start, smoke test, drain)
    drain_s: float = 0.0
    smoke_response: str = ""
    smoke_latency_s: float = 0.0
    engine: str = ""


class ServingServiceClient:
    """The control API of one service, called with its token (``access.py``: configured, or the one the service
    issued in its serving directory)."""

    def __init__(self, control_url: str, base_url: str, pid: int, token: str | None = None) -> None:
        self.control_url, self.base_url, self.pid = control_url.rstrip("/"), base_url, pid
        self._token = token  # never in a repr, a log line or a result

    @classmethod
    def find(cls, serving_dir: str | Path) -> ServingServiceClient | None:
        """The service of this data root when one runs (its file exists, its process lives and it answers).

        In containers (docker compose, Kubernetes) the service runs elsewhere: ``NEXA_SERVING_CONTROL_URL`` names
        its control API (e.g. ``http://serving:8001``) and ``NEXA_SERVING_URL`` its endpoint.
        """
        if url := settings.SERVING_CONTROL_URL.get():
            remote = cls(url, settings.SERVING_URL.get(), 0, access.configured_control_token())
            remote.status()  # a named service that does not answer is an error, not "no service"
            return remote
        path = Path(serving_dir) / SERVICE_FILE
        try:
            facts = json.loads(path.read_text())
            os.kill(int(facts["pid"]), 0)
        except (OSError, ValueError, KeyError):
            return None
        client = cls(
            facts["control_url"],
            facts["base_url"],
            int(facts["pid"]),
            access.local_control_token(Path(serving_dir)),
        )
        try:
            client.status()
        except OSError:
            return None
        return client

    def _call(
        self, method: str, route: str, body: dict[str, Any] | None = None, timeout_s: float = 10.0
    ) -> tuple[int, dict[str, Any]]:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"content-type": "application/json"}
        if self._token:
            headers[access.CONTROL_TOKEN_HEADER] = access.bearer(self._token)
        request = urllib.request.Request(self.control_url + route, data=data, method=method, headers=headers)
        try:
            with _NO_PROXY.open(request, timeout=timeout_s) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def status(self) -> dict[str, Any]:
        code, answer = self._call("GET", "/status")
        if code == 401:
            raise ControlRefused(f"the serving service at {self.control_url} refused: {answer.get('error')}")
        return answer

    def switch(self, checkpoint_path: str, checkpoint_id: str, timeout_s: float = 900.0) -> SwitchResult:
        """Serve ``checkpoint_path`` instead of what is served now; returns once traffic is on it."""
        code, answer = self._call(
            "POST",
            "/switch",
            {"checkpoint_path": checkpoint_path, "checkpoint_id": checkpoint_id},
            timeout_s=timeout_s,
        )
        if code != 200:
            raise SwitchFailed(answer.get("error") or f"the serving service answered HTTP {code}: {answer}")
        return SwitchResult.model_validate(answer)

    def wait_canary(
        self, checkpoint_id: str, say: Callable[[str], None], timeout_s: float, poll_s: float = 2.0
    ) -> dict[str, Any]:
        """Follow the running canary of ``checkpoint_id`` until the service's runner decides it; each new check
        said once (its figures so far). Returns the decision (``last_canary``: verdict, reason, decided_at)."""
        deadline, said = time.monotonic() + timeout_s, None
        while True:
            status = self.status()
            running = status.get("canary")
            if running is None:
                decided = status.get("last_canary") or {}
                if decided.get("checkpoint_id") != checkpoint_id:
                    raise SwitchFailed(f"the canary of {checkpoint_id} ended without a decision: {status}")
                return decided
            if running.get("last_check") and running["last_check"] != said:
                said = running["last_check"]
                say(f"canary {checkpoint_id} on {running['share']:.0%} of the requests: {said}")
            if time.monotonic() > deadline:
                raise SwitchFailed(f"the canary of {checkpoint_id} was not decided in {timeout_s:.0f} s")
            time.sleep(poll_s)

    def canary(
        self,
        checkpoint_path: str,
        checkpoint_id: str,
        policy: dict[str, Any] | None = None,
        entry: dict[str, Any] | None = None,
        timeout_s: float = 900.0,
        answer_book: str | None = None,
    ) -> dict[str, Any]:
        """Start ``checkpoint_path`` as a canary beside what is served (``policy``: ``CanaryPolicy``'s fields;
        ``entry``: the production pointer's entry if it is promoted; ``answer_book``: the checkable prompts its
        live answers are scored on, ``live_quality``); returns once it takes its share."""
        code, answer = self._call(
            "POST",
            "/canary",
            {
                "checkpoint_path": checkpoint_path,
                "checkpoint_id": checkpoint_id,
                "policy": policy,
                "entry": entry,
                "answer_book": answer_book,
            },
            timeout_s=timeout_s,
        )
        if code != 200:
            raise SwitchFailed(answer.get("error") or f"the serving service answered HTTP {code}: {answer}")
        return answer

    def stop_canary(self, reason: str, timeout_s: float = 300.0) -> dict[str, Any]:
        """Roll the running canary back now (a person's call, ``reason`` recorded as "stopped by a person: <reason>"):
        returns once every new request goes to the stable model and the canary's engine stopped, with the decision
        (``last_canary``). ``SwitchFailed`` when no canary runs, or when it was decided before the stop."""
        code, answer = self._call("POST", "/canary/stop", {"reason": reason}, timeout_s=timeout_s)
        if code == 401:
            raise ControlRefused(f"the serving service at {self.control_url} refused: {answer.get('error')}")
        if code != 200:
            raise SwitchFailed(answer.get("error") or f"the serving service answered HTTP {code}: {answer}")
        return answer
