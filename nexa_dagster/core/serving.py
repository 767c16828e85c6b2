"""Serving: bring a checkpoint up behind an OpenAI-compatible server, prove it answers, record a manifest.

The manifest is what a person (or a later gated-promotion step) needs to trust a deployment: which engine, how
long it took to become healthy, what a real request returned and how fast. It is written even when the smoke
request fails (``status="failed"``, ``error`` set) so that the failure can be read after the fact; a server that
never becomes healthy raises ``LLMError`` with the last lines of its log instead.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from pathlib import Path

from pydantic import BaseModel, Field

from nexa_dagster.core import storage
from nexa_dagster.core.llm.base import LLMError, SamplingParams
from nexa_dagster.core.llm.managed_server import ManagedServer
from nexa_dagster.core.llm.openai_compat import OpenAICompatibleClient

SMOKE_PROMPT = "In one sentence, what does a Python list comprehension do?"
MANIFEST_NAME = "deployment.json"


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


class DeploymentManifest(BaseModel):
    """One deployment of one checkpoint: the server it ran on and what a real request got back."""

    checkpoint_id: str
    checkpoint_dir: str
    engine: str
    base_url: str
    model_name: str
    started_at: str
    ready_s: float = Field(ge=0, description="seconds from process start to a healthy /health")
    smoke_prompt: str
    smoke_response: str
    smoke_latency_s: float = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    stopped_at: str
    status: str = Field(description="ok | empty_response | failed")
    error: str | None = None
    log_path: str = ""


def deploy_and_smoke(checkpoint_dir: str | Path, checkpoint_id: str, work_dir: str | Path,
                     prompt: str = SMOKE_PROMPT, engine: str = "auto", max_tokens: int = 32,
                     startup_timeout_s: float = 300.0, request_timeout_s: float = 120.0,
                     logger: logging.Logger | None = None) -> DeploymentManifest:
    """Start the server, send one chat request, stop the server, write ``deployment.json`` atomically.

    The server log stays in ``work_dir`` beside the manifest. Greedy decoding (temperature 0) so that the smoke
    answer of a checkpoint is reproducible.
    """
    work_dir = Path(work_dir)
    started = _now()
    error: str | None = None
    text, tokens, latency = "", 0, 0.0
    with ManagedServer(checkpoint_dir, work_dir, engine=engine, startup_timeout_s=startup_timeout_s,
                       logger=logger) as server:
        with OpenAICompatibleClient(server.base_url, model=server.model_name, max_retries=2,
                                    timeout_s=request_timeout_s) as client:
            t0 = time.perf_counter()
            try:
                answer = client.chat([{"role": "user", "content": prompt}],
                                     SamplingParams(max_tokens=max_tokens, temperature=0.0))
                text, tokens = answer.text, answer.completion_tokens
            except LLMError as e:
                error = f"{e}; server log tail:\n{server.log_tail(15)}"
            latency = time.perf_counter() - t0
        facts = {"engine": server.engine, "base_url": server.base_url, "model_name": server.model_name,
                 "ready_s": server.ready_s, "log_path": str(server.log_path)}
    status = "failed" if error else ("ok" if tokens > 0 else "empty_response")
    manifest = DeploymentManifest(
        checkpoint_id=checkpoint_id, checkpoint_dir=str(checkpoint_dir), started_at=started, smoke_prompt=prompt,
        smoke_response=text, smoke_latency_s=latency, completion_tokens=tokens, stopped_at=_now(), status=status,
        error=error, **facts,
    )
    storage.write_json(manifest.model_dump(), work_dir / MANIFEST_NAME)  # temp file + os.replace
    return manifest
