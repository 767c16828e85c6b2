"""The LLM endpoint resource: one way to reach a model, whatever serves it.

``backend`` picks what answers: ``local`` (in-process transformers on a local directory), ``managed`` (start
``vllm serve``/``transformers serve`` on a local directory for the step, stop it afterwards) or ``openai`` (any
OpenAI-compatible URL: a hosted API, a ``vllm serve`` on a GPU node). Pass secrets with
``api_key=dagster.EnvVar("NEXA_TEACHER_API_KEY")``; ``describe()`` (what goes into metadata) never includes them.
"""

from __future__ import annotations

import logging
import tempfile
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dagster as dg
from pydantic import Field

from nexa_dagster.core.config import resolve_path
from nexa_dagster.core.llm.base import LLMClient

if TYPE_CHECKING:
    from nexa_dagster.core.llm.managed_server import ManagedServer

BACKENDS = ("local", "managed", "openai")


def _safe_url(url: str) -> str:
    """``base_url`` without user:password or query string, which may carry credentials."""
    if not url:
        return url
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


class LLMResource(dg.ConfigurableResource):
    """Configuration of a model endpoint; ``get_client()`` turns it into an ``LLMClient`` for one step."""

    backend: str = Field(default="local", description="local | managed | openai")
    model: str = Field(default="", description="local model directory (local/managed) or served model name "
                                                 "(openai; empty = the first model the server lists)")
    base_url: str = Field(default="", description="OpenAI-compatible base URL, e.g. http://host:8000/v1 (openai)")
    api_key: str = Field(default="", description="API key; pass dagster.EnvVar(...), never a literal")
    max_concurrency: int = Field(default=8, ge=1, description="concurrent requests (openai, managed)")
    timeout_s: float = Field(default=120.0, gt=0, description="per-request timeout (openai, managed)")
    max_retries: int = Field(default=4, ge=0, description="retries with backoff on 429/5xx/timeouts (openai, managed)")
    batch_size: int = Field(default=16, ge=1, description="generate() batch size (local)")
    continuous_batching: bool | None = Field(
        default=True, description="managed `transformers serve`: batch concurrent requests (measured 3-4x the "
        "one-at-a-time throughput at 8 in flight on a 2-core CPU, see bench/generation.py); False: off, "
        "None: on only on a GPU")
    usd_per_1m_input_tokens: float = Field(default=0.0, ge=0, description="price of prompt tokens (0: unknown)")
    usd_per_1m_output_tokens: float = Field(default=0.0, ge=0, description="price of generated tokens (0: unknown)")

    def describe(self) -> dict[str, Any]:
        """What is safe to show in metadata and logs (never the key)."""
        return {"backend": self.backend, "model": self.model, "base_url": _safe_url(self.base_url),
                "api_key_set": bool(self.api_key), "max_concurrency": self.max_concurrency,
                "max_retries": self.max_retries, "timeout_s": self.timeout_s}

    @property
    def priced(self) -> bool:
        return self.usd_per_1m_input_tokens > 0 or self.usd_per_1m_output_tokens > 0

    def managed_server(self, model_dir: str | Path, log_dir: str | Path, logger: logging.Logger | None = None,
                       device: str = "auto") -> ManagedServer:
        """The (not yet started) server the ``managed`` backend runs: ``continuous_batching`` is passed as it is,
        so ``False`` stays off even on a GPU, where ``None`` (auto) would turn it on."""
        from nexa_dagster.core.llm.managed_server import ManagedServer

        return ManagedServer(model_dir, log_dir, logger=logger, device=device,
                             continuous_batching=self.continuous_batching)

    @contextmanager
    def get_client(self, log: logging.Logger | None = None) -> Iterator[LLMClient]:
        """The client for this configuration, released (model freed, server stopped) when the block exits.

        ``log`` is a logger such as ``context.log``; it hears which backend starts and, for ``managed``, when the
        server is healthy.
        """
        logger = log or logging.getLogger(__name__)
        if self.backend not in BACKENDS:
            raise ValueError(f"LLMResource.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "openai":
            if not self.base_url:
                raise ValueError("LLMResource(backend='openai') needs base_url")
            from nexa_dagster.core.llm.openai_compat import OpenAICompatibleClient

            logger.info(f"LLM backend openai at {_safe_url(self.base_url)} (model {self.model or 'first listed'})")
            with OpenAICompatibleClient(self.base_url, self.model, self.api_key, self.max_concurrency,
                                        self.timeout_s, self.max_retries) as client:
                yield client
            return
        if not self.model:
            raise ValueError(f"LLMResource(backend={self.backend!r}) needs model (a local model directory)")
        from nexa_dagster.core.model_identity import model_fingerprint
        from nexa_dagster.core.tiny_model import ensure_model

        path = ensure_model(resolve_path(self.model))
        if self.backend == "local":
            from nexa_dagster.core.llm.local import LocalTransformersClient

            logger.info(f"LLM backend local transformers on {path} (batch size {self.batch_size})")
            with LocalTransformersClient(path, batch_size=self.batch_size) as client:
                yield client
            return
        from nexa_dagster.core.llm.openai_compat import OpenAICompatibleClient

        with tempfile.TemporaryDirectory(prefix="nexa-serve-") as logs, self.managed_server(path, logs, logger) as server:
            logger.info(f"LLM backend managed {server.engine} server on {path} at {server.base_url}, "
                        f"healthy after {server.ready_s:.1f} s")
            with OpenAICompatibleClient(server.base_url, server.model_name, "", self.max_concurrency,
                                        self.timeout_s, self.max_retries) as client:
                # served under its directory's name, which says where it lies, not what it is
                client.identity_override = model_fingerprint(path)
                yield client
