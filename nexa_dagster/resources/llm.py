"""The LLM endpoint resource: one way to reach a model, whatever serves it.

``backend`` picks what answers: ``local`` (in-process transformers on a local directory), ``managed`` (start
``vllm serve``/``transformers serve`` on a local directory for the step, stop it afterwards) or ``openai`` (any
OpenAI-compatible URL: a hosted API, a ``vllm serve`` on a GPU node). Pass secrets with
``api_key=dagster.EnvVar("NEXA_TEACHER_API_KEY")``; ``describe()`` (what goes into metadata) never includes them.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import dagster as dg
from pydantic import Field

from nexa_dagster.core.config import resolve_path
from nexa_dagster.core.llm.base import LLMClient

BACKENDS = ("local", "managed", "openai")


class LLMResource(dg.ConfigurableResource):
    backend: str = Field(default="local", description="local | managed | openai")
    model: str = Field(default="", description="local model directory (local/managed) or served model name")
    base_url: str = Field(default="", description="OpenAI-compatible base URL, e.g. http://host:8000/v1 (openai)")
    api_key: str = Field(default="", description="API key; pass dagster.EnvVar(...), never a literal")
    max_concurrency: int = 8
    timeout_s: float = 120.0
    max_retries: int = 4
    batch_size: int = 16

    def describe(self) -> dict[str, Any]:
        """What is safe to show in metadata and logs (never the key)."""
        return {"backend": self.backend, "model": self.model, "base_url": self.base_url,
                "api_key_set": bool(self.api_key)}

    @contextmanager
    def get_client(self) -> Iterator[LLMClient]:
        if self.backend not in BACKENDS:
            raise ValueError(f"LLMResource.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "openai":
            if not self.base_url:
                raise ValueError("LLMResource(backend='openai') needs base_url")
            from nexa_dagster.core.llm.openai_compat import OpenAICompatibleClient

            client = OpenAICompatibleClient(self.base_url, self.model, self.api_key, self.max_concurrency,
                                            self.timeout_s, self.max_retries)
            with client:
                yield client
            return
        if not self.model:
            raise ValueError(f"LLMResource(backend={self.backend!r}) needs model (a local model directory)")
        path = resolve_path(self.model)
        if self.backend == "local":
            from nexa_dagster.core.llm.local import LocalTransformersClient

            with LocalTransformersClient(path, batch_size=self.batch_size) as client:
                yield client
            return
        from nexa_dagster.core.llm.managed_server import ManagedServer
        from nexa_dagster.core.llm.openai_compat import OpenAICompatibleClient
        from nexa_dagster.core.tiny_model import ensure_model

        with (
            tempfile.TemporaryDirectory(prefix="nexa-serve-") as logs,
            ManagedServer(ensure_model(path), logs) as server,
            OpenAICompatibleClient(server.base_url, server.model_name, "", self.max_concurrency, self.timeout_s,
                                   self.max_retries) as client,
        ):
            yield client
