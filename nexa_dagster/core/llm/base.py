"""The interface every model backend implements (in-process ``transformers``, any OpenAI-compatible server).

Teacher generation, the judge, evaluation and the serving smoke test all talk to a model through
``LLMClient``; which engine answers is configuration (see ``nexa_dagster.resources.llm``).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, TypedDict


class ChatMessage(TypedDict):
    role: Literal["system", "user", "assistant"]
    content: str


class LLMError(RuntimeError):
    """A model call failed; the message names the endpoint (URL or model path) and the cause."""


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
class Capabilities:
    """What the engine behind a client honours; the judge picks its scoring method from this."""

    logprobs: bool = False
    json_schema: bool = False
    engine: str = "unknown"
    extra: dict[str, str] = field(default_factory=dict)


class LLMClient(abc.ABC):
    """A chat model reachable through the OpenAI-compatible API shape."""

    model_id: str

    @abc.abstractmethod
    def capabilities(self) -> Capabilities: ...

    @abc.abstractmethod
    def chat(self, messages: Sequence[ChatMessage], params: SamplingParams) -> Completion:
        """One chat completion. Raises ``LLMError`` naming the endpoint when it cannot be reached."""

    def chat_many(self, conversations: Sequence[Sequence[ChatMessage]], params: SamplingParams) -> list[Completion]:
        """Many chat completions, in order. Backends override this to batch or run requests concurrently."""
        return [self.chat(c, params) for c in conversations]

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
