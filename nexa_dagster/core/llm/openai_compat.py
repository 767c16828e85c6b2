"""Any OpenAI-compatible server (vLLM, ``transformers serve``, a hosted API) through the ``openai`` client.

Requests run concurrently up to ``max_concurrency``; each is retried with exponential backoff and jitter on the
failures worth retrying (429, 5xx, timeouts, dropped connections). A request that still fails comes back from
``chat_many`` as a ``Completion`` with ``error`` set, so one bad request never kills a partition, while ``chat``
raises ``LLMError`` naming the URL. The API key is held by the ``openai`` client only: it never appears in
errors, logs or ``repr`` (error texts are additionally scrubbed of it, in case a server echoes it back).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from nexa_dagster.core.llm.base import (
    Capabilities,
    ChatMessage,
    Completion,
    LLMClient,
    LLMError,
    SamplingParams,
)

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})
# A choice missing from the engine's top-k is less likely than every listed token; it gets the smallest listed
# log-probability minus this margin (one nat, ~e times less likely), an estimate rather than -inf so that
# ``expected_score`` stays defined and a choice that just missed the cut keeps a small weight.
MISSING_CHOICE_MARGIN = 1.0
TOP_LOGPROBS = 20  # the most the OpenAI API allows


class OpenAICompatibleClient(LLMClient):
    """Chat completions against ``base_url`` (``http://host:port/v1``) with retries and bounded concurrency.

    ``model`` defaults to the first id the server lists on ``GET /models`` (``transformers serve`` lists none for a
    model it was started with: pass the name then, as ``ManagedServer.model_name`` does).
    """

    def __init__(self, base_url: str, model: str = "", api_key: str = "", max_concurrency: int = 8,
                 timeout_s: float = 120.0, max_retries: int = 4, backoff_s: float = 0.5,
                 max_backoff_s: float = 30.0) -> None:
        import openai

        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.base_url = base_url.rstrip("/")
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.max_retries = max(0, max_retries)
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._secret = api_key  # only for scrubbing error texts; never printed
        # the openai client's own retries are off: ours back off with jitter and name the URL when they give up
        self._client = openai.OpenAI(base_url=self.base_url, api_key=api_key or "EMPTY", timeout=timeout_s,
                                     max_retries=0)
        self._capabilities: Capabilities | None = None
        self.model_id = model or self._first_model()

    def __repr__(self) -> str:
        return f"OpenAICompatibleClient(base_url={self.base_url!r}, model={self.model_id!r})"

    # -- errors and retries ---------------------------------------------------------------------------------
    def _scrub(self, text: str) -> str:
        return text.replace(self._secret, "***") if self._secret else text

    def _describe(self, exc: BaseException) -> str:
        import openai

        if isinstance(exc, openai.APIStatusError):
            text = f"HTTP {exc.status_code} from {self.base_url}: {str(exc.message)[:300]}"
        elif isinstance(exc, openai.APITimeoutError):
            text = f"timeout after {self.timeout_s:g} s talking to {self.base_url}"
        elif isinstance(exc, openai.APIConnectionError):
            cause: BaseException = exc
            while cause.__cause__ is not None:  # the innermost cause says "connection refused", "name unknown"
                cause = cause.__cause__
            text = f"cannot reach {self.base_url}: {type(cause).__name__}: {str(cause)[:200]}"
        else:
            text = f"{type(exc).__name__} from {self.base_url}: {str(exc)[:300]}"
        return self._scrub(text)

    @staticmethod
    def _retryable(exc: BaseException) -> bool:
        import openai

        if isinstance(exc, openai.APIStatusError):
            return exc.status_code in RETRYABLE_STATUS
        return isinstance(exc, openai.APITimeoutError | openai.APIConnectionError)

    def _delay(self, attempt: int) -> float:
        """Exponential backoff with jitter (0.5x-1.5x), so that many clients do not retry in lockstep."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** attempt) * (0.5 + random.random())

    def _call(self, fn: Callable[..., Any], **kwargs: Any) -> Any:
        """Call ``fn`` with retries; raise ``LLMError`` (naming the URL, never the key) when it keeps failing.

        The ``LLMError`` is raised outside the ``except`` block, so it carries no ``__context__``: the ``openai``
        exception holds the request (headers included) and must not travel into Dagster's error records.
        """
        message = ""
        for attempt in range(self.max_retries + 1):
            try:
                return fn(**kwargs)
            except Exception as exc:  # every failure becomes an LLMError below
                message = self._describe(exc)
                if not self._retryable(exc) or attempt == self.max_retries:
                    if attempt:
                        message += f" (after {attempt + 1} attempts)"
                    break
                delay = self._delay(attempt)
                log.warning("%s; retry %d/%d in %.2f s", message, attempt + 1, self.max_retries, delay)
                time.sleep(delay)
        raise LLMError(message)

    def _first_model(self) -> str:
        models = self._call(self._client.models.list)
        if not models.data:
            raise LLMError(f"{self.base_url} lists no model on GET /models; pass the model name explicitly")
        return models.data[0].id

    # -- the interface --------------------------------------------------------------------------------------
    def capabilities(self) -> Capabilities:
        """Probe once whether the engine honours ``logprobs`` (``transformers serve`` ignores it)."""
        if self._capabilities is None:
            resp = self._call(self._client.chat.completions.create, model=self.model_id,
                              messages=[{"role": "user", "content": "Say 1."}], max_tokens=1, logprobs=True,
                              top_logprobs=5, temperature=0.0)
            choice = resp.choices[0] if resp.choices else None
            has = bool(choice is not None and choice.logprobs is not None and choice.logprobs.content)
            self._capabilities = Capabilities(logprobs=has, json_schema=False, engine="openai-compatible",
                                              extra={"base_url": self.base_url, "model": self.model_id})
        return self._capabilities

    def chat(self, messages: Sequence[ChatMessage], params: SamplingParams) -> Completion:
        kwargs: dict[str, Any] = {"model": self.model_id, "messages": list(messages), "max_tokens": params.max_tokens,
                                  "temperature": params.temperature, "top_p": params.top_p}
        if params.seed is not None:
            kwargs["seed"] = params.seed
        t0 = time.perf_counter()
        resp = self._call(self._client.chat.completions.create, **kwargs)
        latency = time.perf_counter() - t0
        if not resp.choices:
            raise LLMError(f"{self.base_url} returned no choices for model {self.model_id!r}")
        choice = resp.choices[0]
        usage = resp.usage
        message = choice.message
        reasoning = getattr(message, "reasoning_content", None) or getattr(message, "reasoning", None)
        return Completion(
            text=(message.content or "").strip(), model=resp.model or self.model_id,
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
            latency_s=latency, finish_reason=choice.finish_reason, reasoning=reasoning,
        )

    def chat_many(self, conversations: Sequence[Sequence[ChatMessage]], params: SamplingParams) -> list[Completion]:
        """Concurrent ``chat`` calls, in order; a request that fails after its retries comes back with ``error``."""

        def one(messages: Sequence[ChatMessage]) -> Completion:
            t0 = time.perf_counter()
            try:
                return self.chat(messages, params)
            except Exception as e:  # a failed row is data, not a crash
                error = str(e) if isinstance(e, LLMError) else self._scrub(f"{type(e).__name__}: {e}")
                return Completion(text="", model=self.model_id, prompt_tokens=0, completion_tokens=0,
                                  latency_s=time.perf_counter() - t0, error=error)

        if not conversations:
            return []
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(conversations))) as pool:
            return list(pool.map(one, conversations))

    def choice_logprobs(self, messages: Sequence[ChatMessage], choices: Sequence[str]) -> dict[str, float]:
        """Log-probabilities of single-token choices, read from the top-20 alternatives for the first answer token.

        Tokens are compared after stripping whitespace, and variants of one choice (``"3"`` and ``" 3"``) are added
        up in probability space. A choice absent from the top-20 gets ``min(listed) - MISSING_CHOICE_MARGIN``.
        Multi-token choices are matched on their first token only: use the local backend for exact scores.
        Raises ``NotImplementedError`` when the engine ignores ``logprobs``.
        """
        if not self.capabilities().logprobs:
            raise NotImplementedError(f"{self.base_url} does not return log-probabilities")
        if not choices:
            raise ValueError("choice_logprobs needs at least one choice")
        resp = self._call(self._client.chat.completions.create, model=self.model_id, messages=list(messages),
                          max_tokens=1, logprobs=True, top_logprobs=TOP_LOGPROBS, temperature=0.0)
        content = resp.choices[0].logprobs.content if resp.choices and resp.choices[0].logprobs else None
        if not content or not content[0].top_logprobs:
            raise LLMError(f"{self.base_url} returned no top_logprobs for model {self.model_id!r}")
        top = content[0].top_logprobs
        wanted = set(choices)
        seen: dict[str, float] = {}
        for entry in top:
            token = entry.token.strip()
            if token in wanted:
                seen[token] = _logaddexp(seen[token], entry.logprob) if token in seen else entry.logprob
        floor = min(e.logprob for e in top) - MISSING_CHOICE_MARGIN
        return {c: seen.get(c, floor) for c in choices}

    def close(self) -> None:
        self._client.close()


def _logaddexp(a: float, b: float) -> float:
    hi, lo = max(a, b), min(a, b)
    return hi + math.log1p(math.exp(lo - hi))
