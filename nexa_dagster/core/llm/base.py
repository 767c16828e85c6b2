"""The interface every model backend implements (in-process ``transformers``, any OpenAI-compatible server).

Teacher generation, the judge, evaluation and the serving smoke test all talk to a model through
``LLMClient``; which engine answers is configuration (see ``nexa_dagster.resources.llm``).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypedDict


class ChatMessage(TypedDict):
    role: Literal["system", "user", "assistant"]
    content: str


class LLMError(RuntimeError):
    """A model call failed; the message names the endpoint (URL or model path) and the cause.

    ``status`` is the HTTP status of the last answer, if there was one. ``permanent`` says that asking again
    cannot help (a 4xx other than 408/409/429: bad key, unknown model, a rejected parameter): callers fail at once
    instead of re-asking, and a Dagster step does not retry it. A transient failure (429, 5xx, timeout, dropped
    connection) has already been retried by the client that raises it.
    """

    def __init__(self, message: str, *, status: int | None = None, permanent: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.permanent = permanent

    @property
    def endpoint_wide(self) -> bool:
        """A wrong key, no permission or an unknown model/URL (401/403/404): every request fails the same way, so
        a stage stops at once instead of recording one failed row per request. Other permanent errors (400: this
        prompt is too long, say) belong to the one request."""
        return self.permanent and self.status in (401, 403, 404)

    @property
    def rejected_request(self) -> bool:
        """The server understood the request and refused what it asks for (400/422): e.g. ``logprobs``."""
        return self.status in (400, 422)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class Completion:
    """One model answer, with what a data engineer needs to audit it later."""

    text: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    finish_reason: str | None = None
    reasoning: str | None = None  # chain-of-thought field when the engine returns one
    error: str | None = None  # set (and text empty) when the request failed after its retries


@dataclass
class Sample:
    """One of the ``n`` answers to a prompt, with each generated token and its log-probability under the engine
    (what pass@k, best-of-n and a policy-gradient step read; ``transformers serve`` returns neither ``n`` nor them).

    ``tokens`` are the engine's token strings, or ``token_id:<id>`` where the engine was asked for ids."""

    text: str
    tokens: list[str]
    logprobs: list[float]
    finish_reason: str | None = None


@dataclass
class Capabilities:
    """What the engine behind a client honours; the judge picks its scoring method from this."""

    logprobs: bool = False
    json_schema: bool = False
    engine: str = "unknown"
    extra: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ChatRequest:
    """One conversation and how to sample its answer (each generation of a prompt has its own seed)."""

    messages: Sequence[ChatMessage]
    params: SamplingParams


class LLMClient(abc.ABC):
    """A chat model reachable through the OpenAI-compatible API shape."""

    model_id: str
    # set when the served name does not say what the model is (a managed server names it after its directory)
    identity_override: str | None = None
    # how many requests the caller may usefully have in flight (HTTP clients: their semaphore; in-process: 1)
    max_concurrency: int = 1

    @property
    def identity(self) -> str:
        """What the model is, never where it lies: the key of its answers (``core.distillation.sample_key``).

        A served model's name, or the content fingerprint of a local directory (``core.model_identity``), so the
        same model in another checkout or data root gives the same sample ids and finds its stored answers.
        """
        return self.identity_override or self.model_id

    @abc.abstractmethod
    def capabilities(self) -> Capabilities: ...

    @abc.abstractmethod
    def chat(self, messages: Sequence[ChatMessage], params: SamplingParams) -> Completion:
        """One chat completion. Raises ``LLMError`` naming the endpoint when it cannot be reached."""

    def chat_many(
        self, conversations: Sequence[Sequence[ChatMessage]], params: SamplingParams
    ) -> list[Completion]:
        """Many chat completions, in order. Backends override this to batch or run requests concurrently."""
        return [self.chat(c, params) for c in conversations]

    def stream_chat(
        self, requests: Sequence[ChatRequest], chunk: int = 16
    ) -> Iterator[tuple[int, Completion]]:
        """Answers to ``requests`` as they complete, each with its index into ``requests``.

        This is what teacher generation consumes: every answer is stored durably the moment it arrives, so a killed
        run loses at most the requests that were in flight. The default answers chunks of requests that share
        sampling parameters with ``chat_many`` (one batched ``generate`` for the in-process backend); the HTTP
        client overrides it to keep ``max_concurrency`` requests in flight and yield in completion order.
        A request that fails comes back with ``error`` set, never as an exception.
        """
        groups: dict[SamplingParams, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(r.params, []).append(i)
        for params, indices in groups.items():
            for start in range(0, len(indices), max(1, chunk)):
                idx = indices[start : start + chunk]
                try:
                    answers = self.chat_many([requests[i].messages for i in idx], params)
                except LLMError as e:
                    answers = [Completion("", self.model_id, 0, 0, 0.0, error=str(e)) for _ in idx]
                yield from zip(idx, answers, strict=True)

    def chat_json(
        self, messages: Sequence[ChatMessage], schema: dict[str, object], name: str, params: SamplingParams
    ) -> Completion:
        """A chat completion whose decoding the engine constrains to the JSON ``schema`` (``response_format``).

        Raises ``NotImplementedError`` when the engine does not honour ``response_format``
        (``capabilities().json_schema`` is False).
        """
        raise NotImplementedError(f"{self.model_id}: this backend cannot constrain decoding to a JSON schema")

    @abc.abstractmethod
    def choice_logprobs(self, messages: Sequence[ChatMessage], choices: Sequence[str]) -> dict[str, float]:
        """Log-probability of each ``choice`` as the start of the assistant's answer to ``messages``.

        Raises ``NotImplementedError`` when the engine does not return log-probabilities
        (``capabilities().logprobs`` is False), so callers can fall back to another scoring method.
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the client holds (connections, a model in memory)."""

    def __enter__(self) -> LLMClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def expected_score(logprobs: dict[str, float]) -> float:
    """Expected value of a numeric score from the (renormalised) probabilities of its tokens.

    Reading the score from the distribution rather than from sampled text gives a valid, graded score even for a
    weak model that would never write a well-formed verdict.
    """
    if not logprobs:
        raise ValueError("no score-token log-probabilities to read a score from")
    top = max(logprobs.values())
    weights = {k: math.exp(v - top) for k, v in logprobs.items()}
    total = sum(weights.values())
    return sum(float(k) * w for k, w in weights.items()) / total
