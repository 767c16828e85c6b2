"""The LLM endpoint resources: one way to reach a model, one class per thing that serves it.

``LocalLLM`` (in-process transformers on a local directory), ``ManagedLLM`` (start ``vllm serve``/``transformers
serve`` on a local directory for the step, stop it afterwards) and ``OpenAILLM`` (any OpenAI-compatible URL: a
hosted API, a ``vllm serve`` on a GPU node) each take only their own fields (``extra="forbid"``), so a ``base_url``
given to the local backend is an error where the resource is built, not a setting silently ignored. Assets ask for
the abstract ``LLMResource``. Pass secrets with ``api_key=dagster.EnvVar("NEXA_TEACHER_API_KEY")``; ``describe()``
(what goes into metadata) never includes them. ``llm_resource`` builds one from pipeline.yaml and the environment.
"""

from __future__ import annotations

import abc
import logging
import tempfile
import urllib.parse
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, Literal

import dagster as dg
from pydantic import ConfigDict, Field, ValidationError

from nexa_dagster import settings as env_settings
from nexa_dagster.core.common.artifacts import require_model_dir
from nexa_dagster.core.common.config import ConfigError, explain, resolve_path
from nexa_dagster.core.llm.base import LLMClient
from nexa_dagster.core.llm.local import LocalTransformersClient
from nexa_dagster.core.llm.managed_server import ManagedServer, choose_engine
from nexa_dagster.core.llm.model_identity import model_fingerprint
from nexa_dagster.core.llm.openai_compat import OpenAICompatibleClient

logger = logging.getLogger(__name__)


def _safe_url(url: str) -> str:
    """``base_url`` without user:password or query string, which may carry credentials."""
    if not url:
        return url
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


class LLMResource(dg.ConfigurableResource, abc.ABC):
    """A model endpoint; ``get_client()`` turns it into an ``LLMClient`` for one step. Subclasses: one per backend."""

    model_config = ConfigDict(extra="forbid")  # a field of another backend is an error, not ignored

    backend: ClassVar[str]

    model: str = Field(
        default="",
        description="local model directory (local/managed) or served model name "
        "(openai; empty = the first model the server lists)",
    )

    def for_model(self, path: str) -> LLMResource:
        """This endpoint for ``path`` when it names no model of its own (the preference stage's policy: the
        production checkpoint of the moment); a served model (``openai``) or a configured one stays as it is."""
        if self.model or self.backend == "openai":
            return self
        return type(self)(**{**self.model_dump(), "model": path})

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """What is safe to show in metadata and logs (never the key)."""

    @abc.abstractmethod
    @contextmanager
    def get_client(self, log: logging.Logger | None = None) -> Iterator[LLMClient]:
        """The client for this configuration, released (model freed, server stopped) when the block exits.

        ``log`` is a logger such as ``context.log``; it hears which backend starts and, for ``managed``, when the
        server is healthy.
        """

    def where(self) -> str:
        """The endpoint as an error message names it: the URL, or the model directory."""
        return self.model

    def batch(self) -> int:
        """Requests answered together by ``stream_chat``: only the in-process engine batches; the HTTP clients
        keep ``max_concurrency`` requests in flight whatever the chunk."""
        return 16

    def price_per_1m_tokens(self) -> tuple[float, float] | None:
        """(input, output) USD per million tokens where a price is configured, else None."""
        return None

    def _local_model(self) -> Path:
        if not self.model:
            raise ValueError(f"{type(self).__name__} needs model (a local model directory)")
        return require_model_dir(resolve_path(self.model), f"{type(self).__name__} model")


class LocalLLM(LLMResource):
    """In-process ``transformers`` on a local directory: batched generation and the log-probabilities the judge
    reads its score from (which ``transformers serve`` does not return)."""

    backend: ClassVar[str] = "local"

    batch_size: int = Field(default=16, ge=1, description="generate() batch size")

    def describe(self) -> dict[str, Any]:
        return {"backend": self.backend, "model": self.model, "batch_size": self.batch_size}

    def batch(self) -> int:
        return self.batch_size

    @contextmanager
    def get_client(self, log: logging.Logger | None = None) -> Iterator[LLMClient]:
        path = self._local_model()
        (log or logger).info(f"LLM backend local transformers on {path} (batch size {self.batch_size})")
        with LocalTransformersClient(path, batch_size=self.batch_size) as client:
            yield client


class _HTTPLLM(LLMResource, abc.ABC):
    """What the two backends reached over HTTP share: concurrency, timeout, retries."""

    max_concurrency: int = Field(default=8, ge=1, description="concurrent requests")
    timeout_s: float = Field(default=120.0, gt=0, description="per-request timeout")
    max_retries: int = Field(default=4, ge=0, description="retries with backoff on 429/5xx/timeouts")

    def _http(self) -> dict[str, Any]:
        return {
            "max_concurrency": self.max_concurrency,
            "max_retries": self.max_retries,
            "timeout_s": self.timeout_s,
        }


class ManagedLLM(_HTTPLLM):
    """``vllm serve`` (vLLM installed for this host, ``make vllm``, and able to run the model) or ``transformers
    serve`` started on a local directory for the step, reached over HTTP (vLLM: on a Unix socket of the step's own,
    no TCP port), and stopped (the whole process group) when the step ends. On vLLM the client's ``sample`` gives
    ``n`` answers with their tokens' log-probabilities, and the judge reads its score from log-probabilities."""

    backend: ClassVar[str] = "managed"

    engine: Literal["auto", "vllm", "transformers"] = Field(
        default="auto",
        description="auto: vLLM where it is installed and runs the model (not the tiny preset's head size 16 on "
        "a CPU), else transformers serve; vllm: vLLM or an error saying why not",
    )

    continuous_batching: bool | None = Field(
        default=True,
        description="`transformers serve`: batch concurrent requests (measured 3-4x the "
        "one-at-a-time throughput at 8 in flight on a 2-core CPU, see bench/generation.py); False: off, "
        "None: on only on a GPU",
    )

    startup_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="how long the engine may take to answer /health (a vLLM engine on a 2-core CPU shared with a "
        "test suite took 174-269 s at load 10-14; about 40 s at load 3)",
    )

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "model": self.model,
            **self._http(),
            "continuous_batching": self.continuous_batching,
            "engine": self.engine,
        }

    def managed_server(
        self,
        model_dir: str | Path,
        log_dir: str | Path,
        logger: logging.Logger | None = None,
        device: str = "auto",
    ) -> ManagedServer:
        """The (not yet started) server: ``continuous_batching`` is passed as it is, so ``False`` stays off even
        on a GPU, where ``None`` (auto) would turn it on. A vLLM engine listens on ``<log_dir>/engine.sock``."""
        engine = choose_engine(model_dir, self.engine)
        return ManagedServer(
            model_dir,
            log_dir,
            engine=engine,
            logger=logger,
            device=device,
            continuous_batching=self.continuous_batching,
            startup_timeout_s=self.startup_timeout_s,
            socket_path=Path(log_dir) / "engine.sock" if engine == "vllm" else None,
        )

    @contextmanager
    def get_client(self, log: logging.Logger | None = None) -> Iterator[LLMClient]:

        path, log = self._local_model(), log or logger
        with (
            tempfile.TemporaryDirectory(prefix="nexa-serve-") as logs,
            self.managed_server(path, logs, log) as server,
        ):
            log.info(
                f"LLM backend managed {server.engine} server on {path} at {server.base_url}, "
                f"healthy after {server.ready_s:.1f} s"
            )
            with OpenAICompatibleClient(
                server.base_url,
                server.model_name,
                "",
                self.max_concurrency,
                self.timeout_s,
                self.max_retries,
                uds=server.socket_path,
            ) as client:
                # served under its directory's name, which says where it lies, not what it is
                client.identity_override = model_fingerprint(path)
                yield client


class OpenAILLM(_HTTPLLM):
    """Any OpenAI-compatible URL through the ``openai`` client (a hosted API, a ``vllm serve`` on a GPU node)."""

    backend: ClassVar[str] = "openai"

    base_url: str = Field(description="OpenAI-compatible base URL, e.g. http://host:8000/v1")
    api_key: str = Field(default="", description="API key; pass dagster.EnvVar(...), never a literal")
    api_key_file: str = Field(
        default="",
        description="a file holding the API key (NEXA_<ROLE>_API_KEY_FILE), read when a client is opened: the "
        "key is then in no environment and no config",
    )
    usd_per_1m_input_tokens: float = Field(
        default=0.0, ge=0, description="price of prompt tokens (0: unknown)"
    )
    usd_per_1m_output_tokens: float = Field(
        default=0.0, ge=0, description="price of generated tokens (0: unknown)"
    )

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "model": self.model,
            "base_url": _safe_url(self.base_url),
            "api_key_set": bool(self.api_key or self.api_key_file),
            **self._http(),
        }

    def where(self) -> str:
        return _safe_url(self.base_url)

    def price_per_1m_tokens(self) -> tuple[float, float] | None:
        prices = (self.usd_per_1m_input_tokens, self.usd_per_1m_output_tokens)
        return prices if any(prices) else None

    @contextmanager
    def get_client(self, log: logging.Logger | None = None) -> Iterator[LLMClient]:
        if not self.base_url:
            raise ValueError("OpenAILLM needs base_url")
        (log or logger).info(
            f"LLM backend openai at {_safe_url(self.base_url)} (model {self.model or 'first listed'})"
        )
        with OpenAICompatibleClient(
            self.base_url, self.model, self.key(), self.max_concurrency, self.timeout_s, self.max_retries
        ) as client:
            yield client

    def key(self) -> str:
        """The API key: ``api_key``, else the content of ``api_key_file`` (an unreadable file is an error naming
        it)."""
        if self.api_key or not self.api_key_file:
            return self.api_key
        return env_settings.read_secret_file("api_key_file (NEXA_<ROLE>_API_KEY_FILE)", self.api_key_file)


def _api_key(role: str) -> dict[str, Any]:
    """The openai backend's key setting: ``NEXA_<ROLE>_API_KEY_FILE``'s path (checked readable now, when the code
    location loads: an error names the variable and the file), else ``dagster.EnvVar("NEXA_<ROLE>_API_KEY")``."""
    key, key_file = (
        env_settings.llm_variable(role, "API_KEY"),
        env_settings.llm_variable(role, "API_KEY_FILE"),
    )
    if not key_file.is_set():
        return {"api_key": dg.EnvVar(key.name)}
    if key.is_set():
        raise ConfigError(f"{key.name} and {key_file.name} are both set: keep one (the file)")
    try:
        env_settings.secret_from_file(key_file)
    except env_settings.SecretUnreadable as e:
        raise ConfigError(str(e)) from None
    return {"api_key_file": key_file.get()}


BACKENDS: dict[str, type[LLMResource]] = {cls.backend: cls for cls in (LocalLLM, ManagedLLM, OpenAILLM)}


def llm_resource(
    role: str, settings: dict[str, Any], where: str, default_model: str, env: Mapping[str, str] | None = None
) -> LLMResource:
    """The ``role`` (teacher, judge) endpoint: ``settings`` (pipeline.yaml's ``<role>_llm``, found at ``where``)
    under the environment's ``NEXA_<ROLE>_BACKEND`` / ``_MODEL`` / ``_URL``; ``openai`` reads its key through
    ``dagster.EnvVar("NEXA_<ROLE>_API_KEY")``. Checked here, when the code location loads: an unknown backend or a
    field the chosen backend does not have is a ``ConfigError`` naming the variable or key it came from."""
    env = env_settings.environ() if env is None else env
    prefix = f"NEXA_{role.upper()}_"
    origin = {key: f"{where}.{key}" for key in settings}
    settings = dict(settings)
    for key, variable in (("backend", "BACKEND"), ("model", "MODEL"), ("base_url", "URL")):
        if env.get(prefix + variable):
            settings[key], origin[key] = env[prefix + variable], prefix + variable
    if "api_key" in settings:
        raise ConfigError(
            f"{origin['api_key']}: never a key in a configuration file: set {prefix}API_KEY_FILE (a file holding "
            f"it, a Docker or Kubernetes secret) or {prefix}API_KEY (read through dagster.EnvVar by the openai backend)"
        )
    backend = settings.pop("backend", "local")
    cls = BACKENDS.get(str(backend))
    if cls is None:
        raise ConfigError(
            f"{origin.get('backend', prefix + 'BACKEND')}: unknown LLM backend {backend!r}; one of "
            f"{', '.join(BACKENDS)}"
        )
    known = sorted(cls.model_fields)
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise ConfigError(
            f"{origin[unknown[0]]}: {unknown[0]} is not a setting of the {backend} backend "
            f"({cls.__name__}: {', '.join(known)})"
        )
    if cls is OpenAILLM:
        settings.update(_api_key(role))
        if not settings.get("base_url"):
            raise ConfigError(f"{prefix}URL: the openai backend needs base_url (the OpenAI-compatible URL)")
    else:
        settings.setdefault("model", default_model)
    try:
        return cls(**settings)
    except ValidationError as e:
        lines = []
        for problem in explain(e, cls):  # "key: what is wrong", said where the key was set
            key, _, what = problem.partition(": ")
            lines.append(f"{origin.get(key.split('.')[0], f'{where}.{key}')}: {what}")
        raise ConfigError("\n".join(lines)) from None
