"""Any OpenAI-compatible server (vLLM, ``transformers serve``, a hosted API) through the ``openai`` client.

Requests run concurrently up to ``max_concurrency``; each is retried with exponential backoff and jitter on the
failures worth retrying (429, 5xx, timeouts, dropped connections). A request that still fails comes back from
``chat_many`` as a ``Completion`` with ``error`` set, so one bad request never kills a partition. The API key is
held by the client only: it never appears in errors, logs or ``repr``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
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

RETRYABLE_STATUS = {408, 409, 429, 500, 502, 503, 504}
MISSING_CHOICE_LOGPROB = -100.0  # a choice absent from the engine's top-k: far less likely than any listed one


class OpenAICompatibleClient(LLMClient):
    def __init__(self, base_url: str, model: str = "", api_key: str = "", max_concurrency: int = 8,
                 timeout_s: float = 120.0, max_retries: int = 4, backoff_s: float = 0.5) -> None:
        import openai

        self.base_url = base_url.rstrip("/")
        self.max_concurrency = max_concurrency
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self._client = openai.OpenAI(base_url=self.base_url, api_key=api_key or "EMPTY", timeout=timeout_s,
                                     max_retries=0)
        self._capabilities: Capabilities | None = None
        self.model_id = model or self._first_model()

    def __repr__(self) -> str:
        return f"OpenAICompatibleClient(base_url={self.base_url!r}, model={self.model_id!r})"

    # -- errors and retries ---------------------------------------------------------------------------------
    def _describe(self, exc: BaseException) -> str:
        import openai

        if isinstance(exc, openai.APIStatusError):
            return f"HTTP {exc.status_code} from {self.base_url}: {str(exc.message)[:300]}"
        if isinstance(exc, openai.APITimeoutError):
            return f"timeout talking to {self.base_url}"
        if isinstance(exc, openai.APIConnectionError):
            cause = exc.__cause__ or exc
            return f"cannot reach {self.base_url}: {type(cause).__name__}: {str(cause)[:200]}"
        return f"{type(exc).__name__} from {self.base_url}: {str(exc)[:300]}"

    def _retryable(self, exc: BaseException) -> bool:
        import openai

        if isinstance(exc, openai.APIStatusError):
            return exc.status_code in RETRYABLE_STATUS
        return isinstance(exc, openai.APITimeoutError | openai.APIConnectionError)

    def _call(self, fn: Any, **kwargs: Any) -> Any:
        """Call ``fn`` with retries; raise ``LLMError`` (naming the URL, never the key) when it keeps failing."""
        for attempt in range(self.max_retries + 1):
            try:
                return fn(**kwargs)
            except Exception as exc:
                if not self._retryable(exc) or attempt == self.max_retries:
                    raise LLMError(self._describe(exc)) from None
                delay = self.backoff_s * (2 ** attempt)
                time.sleep(delay * (0.5 + random.random()))  # full jitter keeps clients from retrying in lockstep
        raise AssertionError("unreachable")

    def _first_model(self) -> str:
        models = self._call(self._client.models.list)
        if not models.data:
            raise LLMError(f"{self.base_url} serves no model (GET /models returned none)")
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
                                              extra={"base_url": self.base_url})
        return self._capabilities

    def chat(self, messages: Sequence[ChatMessage], params: SamplingParams) -> Completion:
        t0 = time.perf_counter()
        kwargs: dict[str, Any] = {"model": self.model_id, "messages": list(messages), "max_tokens": params.max_tokens,
                                  "temperature": params.temperature, "top_p": params.top_p}
        if params.seed is not None:
            kwargs["seed"] = params.seed
        resp = self._call(self._client.chat.completions.create, **kwargs)
        choice = resp.choices[0]
        usage = resp.usage
        message = choice.message
        reasoning = getattr(message, "reasoning_content", None) or getattr(message, "reasoning", None)
        return Completion(
            text=(message.content or "").strip(), model=resp.model or self.model_id,
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
            latency_s=time.perf_counter() - t0, finish_reason=choice.finish_reason, reasoning=reasoning,
        )

    def chat_many(self, conversations: Sequence[Sequence[ChatMessage]], params: SamplingParams) -> list[Completion]:
        def one(messages: Sequence[ChatMessage]) -> Completion:
            t0 = time.perf_counter()
            try:
                return self.chat(messages, params)
            except LLMError as e:
                return Completion(text="", model=self.model_id, prompt_tokens=0, completion_tokens=0,
                                  latency_s=time.perf_counter() - t0, error=str(e))

        with ThreadPoolExecutor(max_workers=self.max_concurrency) as pool:
            return list(pool.map(one, conversations))

    def choice_logprobs(self, messages: Sequence[ChatMessage], choices: Sequence[str]) -> dict[str, float]:
        """Log-probabilities of single-token choices from the engine's top-20 for the first answer token."""
        if not self.capabilities().logprobs:
            raise NotImplementedError(f"{self.base_url} does not return log-probabilities")
        resp = self._call(self._client.chat.completions.create, model=self.model_id, messages=list(messages),
                          max_tokens=1, logprobs=True, top_logprobs=20, temperature=0.0)
        top = resp.choices[0].logprobs.content[0].top_logprobs
        seen: dict[str, float] = {}
        for entry in top:
            token = entry.token.strip()
            if token in choices and token not in seen:
                seen[token] = entry.logprob
        return {c: seen.get(c, MISSING_CHOICE_LOGPROB) for c in choices}

    def close(self) -> None:
        self._client.close()
