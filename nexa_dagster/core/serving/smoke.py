"""The smoke request: one greedy chat request to an engine, and a verdict on whether the answer is text.

``smoke_test_in_temporary_engine`` is the deployment check used when no serving service runs (a pipeline on a
laptop, the tests of the pipeline): it starts an engine on the checkpoint, sends the smoke request, stops the
engine and writes ``deployment.json``. That engine has no key (``transformers serve`` has none), so it gets no TCP
port either: a Unix socket in a folder only this user may enter, as the service's engines (docs/security.md). With a serving service running, the service sends the same request to the
new engine before it takes traffic (``service.ServingService.switch``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from nexa_dagster.core.common import storage
from nexa_dagster.core.common.spans import span
from nexa_dagster.core.llm.base import LLMError, SamplingParams
from nexa_dagster.core.llm.managed_server import ManagedServer, WarmInterpreter
from nexa_dagster.core.llm.openai_compat import OpenAICompatibleClient
from nexa_dagster.core.serving.answer_check import text_problem
from nexa_dagster.core.serving.haproxy import socket_dir

SMOKE_PROMPT = "In one sentence, what does a Python list comprehension do?"
MANIFEST_NAME = "deployment.json"


def now_utc(timespec: str = "seconds") -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec=timespec)


@dataclass
class SmokeAnswer:
    text: str
    completion_tokens: int
    latency_s: float
    problem: str | None  # None: the answer is text; else why the engine failed the smoke test

    @property
    def ok(self) -> bool:
        return self.problem is None


def smoke_request(
    base_url: str,
    model_name: str,
    prompt: str = SMOKE_PROMPT,
    max_tokens: int = 32,
    timeout_s: float = 120.0,
    max_retries: int = 2,
    uds: str | None = None,
) -> SmokeAnswer:
    """Send the smoke request (temperature 0: a checkpoint's answer is reproducible) and judge the answer."""
    t0 = time.perf_counter()
    with OpenAICompatibleClient(
        base_url, model=model_name, max_retries=max_retries, timeout_s=timeout_s, uds=uds
    ) as client:
        try:
            answer = client.chat(
                [{"role": "user", "content": prompt}], SamplingParams(max_tokens=max_tokens, temperature=0.0)
            )
        except LLMError as e:
            return SmokeAnswer("", 0, time.perf_counter() - t0, f"the smoke request failed: {e}")
    problem = text_problem(answer.text)
    return SmokeAnswer(answer.text, answer.completion_tokens, time.perf_counter() - t0, problem)


class DeploymentManifest(BaseModel):
    """One smoke test of one checkpoint in a temporary engine: the engine and what a real request got back."""

    checkpoint_id: str
    checkpoint_dir: str
    engine: str
    base_url: str
    model_name: str
    socket: str = Field("", description="the Unix socket the engine listened on (it had no TCP port)")
    started_at: str
    ready_s: float = Field(ge=0, description="seconds from process start to a healthy /health")
    smoke_prompt: str
    smoke_response: str
    smoke_latency_s: float = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    stopped_at: str
    status: str = Field(description="ok | not_text | failed")
    error: str | None = None
    log_path: str = ""


def _ask_temporary_engine(
    server: ManagedServer, prompt: str, max_tokens: int, request_timeout_s: float
) -> tuple[SmokeAnswer, str | None, dict[str, Any]]:
    """The smoke request to ``server``, an engine started for it on a Unix socket in a private folder (700), not a
    TCP port: the engine has no key, and any local process could reach a port of it; then the engine is stopped.

    Its spans (``core/common/spans.py``) split what the deployment pays for the engine, its start to healthy and
    its stop (fixed costs: ~10 s for the tiny model, most of a deployment without a serving service), from the
    request itself (work), for ``bench/pipeline_profile.py``."""
    assert server.socket_path is not None
    socket_path = Path(server.socket_path)
    say = server.log.info  # the caller's logger, else the engine module's
    try:
        with span(say, "fixed", "smoke_engine_start"):
            server.start()  # stops what it started when it fails
        try:
            with span(say, "work", "smoke_request"):
                answer = smoke_request(
                    server.base_url,
                    server.model_name,
                    prompt,
                    max_tokens,
                    request_timeout_s,
                    uds=server.socket_path,
                )
            error = answer.problem
            if error and not answer.text:
                error = f"{error}; server log tail:\n{server.log_tail(15)}"
            facts = {
                "engine": server.engine,
                "base_url": server.base_url,
                "model_name": server.model_name,
                "socket": str(socket_path),
                "ready_s": server.ready_s,
                "log_path": str(server.log_path),
            }
        finally:
            with span(say, "fixed", "smoke_engine_stop"):
                server.stop()
        return answer, error, facts
    finally:
        socket_path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # the folder too, when nothing else is in it
            socket_path.parent.rmdir()


def smoke_test_in_temporary_engine(
    checkpoint_dir: str | Path,
    checkpoint_id: str,
    work_dir: str | Path,
    prompt: str = SMOKE_PROMPT,
    engine: str = "auto",
    max_tokens: int = 32,
    startup_timeout_s: float = 300.0,
    request_timeout_s: float = 120.0,
    logger: logging.Logger | None = None,
    warm: WarmInterpreter | None = None,
    model_process: str = "fork",
) -> DeploymentManifest:
    """Start an engine, send the smoke request, stop the engine, write ``deployment.json`` atomically.

    ``warm``: a warm Python of this process the engine's server forks from (``ManagedServer._fork_from_warm``:
    its imports done, ~3.5 s of a ~8.7 s start for the tiny model); None, a fresh process. ``model_process``:
    how the engine starts its model's process (``ManagedServer``: "fork" where safe; "spawn", transformers' own).

    The manifest is written even when the smoke test fails (``status`` says how, ``error`` why) so that the
    failure can be read after the fact; an engine that never becomes healthy raises ``LLMError`` with its log tail.
    """
    work_dir = Path(work_dir)
    started = now_utc()
    server = ManagedServer(
        checkpoint_dir,
        work_dir,
        engine=engine,
        startup_timeout_s=startup_timeout_s,
        logger=logger,
        socket_path=socket_dir(work_dir) / "smoke.sock",
        warm=warm,
        model_process=model_process,
    )
    answer, error, facts = _ask_temporary_engine(server, prompt, max_tokens, request_timeout_s)
    status = "ok" if answer.ok else ("not_text" if answer.text else "failed")
    manifest = DeploymentManifest(
        checkpoint_id=checkpoint_id,
        checkpoint_dir=str(checkpoint_dir),
        started_at=started,
        smoke_prompt=prompt,
        smoke_response=answer.text,
        smoke_latency_s=answer.latency_s,
        completion_tokens=answer.completion_tokens,
        stopped_at=now_utc(),
        status=status,
        error=error,
        **facts,
    )
    storage.write_json(manifest.model_dump(), work_dir / MANIFEST_NAME)  # temp file + os.replace
    return manifest
