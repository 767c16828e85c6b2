"""Serving: bring a checkpoint up behind an OpenAI-compatible server, prove it answers, record a manifest.

The manifest is what a person (or a later gated-promotion step) needs to trust a deployment: which engine, how
long it took to become healthy, what a real request returned and how fast.
"""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

from pydantic import BaseModel, Field

from nexa_dagster.core import storage
from nexa_dagster.core.llm.base import SamplingParams
from nexa_dagster.core.llm.managed_server import ManagedServer
from nexa_dagster.core.llm.openai_compat import OpenAICompatibleClient

SMOKE_PROMPT = "In one sentence, what does a Python list comprehension do?"


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


class DeploymentManifest(BaseModel):
    checkpoint_id: str
    checkpoint_dir: str
    engine: str
    base_url: str
    model_name: str
    started_at: str
    ready_s: float = Field(ge=0)
    smoke_prompt: str
    smoke_response: str
    smoke_latency_s: float = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    stopped_at: str
    status: str


def deploy_and_smoke(checkpoint_dir: str | Path, checkpoint_id: str, work_dir: str | Path,
                     prompt: str = SMOKE_PROMPT, engine: str = "auto", max_tokens: int = 32) -> DeploymentManifest:
    """Start the server, send one chat request, stop the server, write ``deployment.json`` atomically."""
    work_dir = Path(work_dir)
    started = _now()
    with ManagedServer(checkpoint_dir, work_dir, engine=engine) as server:
        client = OpenAICompatibleClient(server.base_url, model=server.model_name, max_retries=2)
        t0 = time.perf_counter()
        answer = client.chat([{"role": "user", "content": prompt}], SamplingParams(max_tokens=max_tokens))
        latency = time.perf_counter() - t0
        client.close()
        manifest = DeploymentManifest(
            checkpoint_id=checkpoint_id, checkpoint_dir=str(checkpoint_dir), engine=server.engine,
            base_url=server.base_url, model_name=server.model_name, started_at=started, ready_s=server.ready_s,
            smoke_prompt=prompt, smoke_response=answer.text, smoke_latency_s=latency,
            completion_tokens=answer.completion_tokens, stopped_at="", status="",
        )
    manifest.stopped_at = _now()
    manifest.status = "ok" if answer.completion_tokens > 0 else "empty_response"
    storage.write_json(manifest.model_dump(), work_dir / "deployment.json")
    return manifest
