"""Any OpenAI-compatible server (vLLM, ``transformers serve``, a hosted API) through the async ``openai`` client.

One ``openai.AsyncOpenAI`` client runs on an event loop in a background thread owned by this object, so the
same client serves synchronous callers (Dagster assets, the judge's worker threads) and keeps many requests in
flight: an ``asyncio.Semaphore`` bounds them to ``max_concurrency``. Each request is retried with exponential
backoff and jitter on the failures worth retrying (429, 5xx, timeouts, dropped connections); the semaphore is
released while a request waits to retry, so a backing-off request does not hold a slot. A request that still
fails comes back from ``chat_many``/``stream_chat`` as a ``Completion`` with ``error`` set, so one bad request
never kills a partition, while ``chat`` raises ``LLMError`` naming the URL; a failure that no request can escape
(a wrong key, an unknown model: ``LLMError.endpoint_wide``) is raised from ``chat_many``/``stream_chat`` too. The API key is held by the
``openai`` client only: it never appears in errors, logs or ``repr`` (error texts are additionally scrubbed of
it, in case a server echoes it back).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import email.utils
import json
import logging
import math
import queue
import random
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

from nexa_dagster.core.llm.base import (
    Capabilities,
    ChatMessage,
    ChatRequest,
    Completion,
    LLMClient,
    LLMError,
    Sample,
    SamplingParams,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

RETRYABLE_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})
# A choice missing from the engine's top-k is less likely than every listed token; it gets the smallest listed
# log-probability minus this margin (one nat, ~e times less likely), an estimate rather than -inf so that
# ``expected_score`` stays defined and a choice that just missed the cut keeps a small weight.
MISSING_CHOICE_MARGIN = 1.0
TOP_LOGPROBS = 20  # the most the OpenAI API allows
# what the start-up probe asks for under ``response_format``; an engine that ignores it answers free text
_PROBE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


class _LoopThread:
    """An event loop running in a daemon thread; coroutines are submitted to it from any thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.submit(coro).result()

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


def _unix_transport(uds: str, limits: Any) -> Any:
    """An HTTP transport to a Unix socket, of the HTTP library the installed ``openai`` is built on (``httpx``, or
    its successor ``httpx2`` in recent releases: a transport of the other one is refused)."""
    import openai  # seconds to import, only when a client is made: not at the code location's load

    library = sys.modules[openai.DefaultAsyncHttpxClient.__mro__[1].__module__.split(".")[0]]
    own_limits = library.Limits(
        max_connections=limits.max_connections, max_keepalive_connections=limits.max_keepalive_connections
    )
    return library.AsyncHTTPTransport(uds=uds, limits=own_limits)


class OpenAICompatibleClient(LLMClient):
    """Chat completions against ``base_url`` (``http://host:port/v1``) with retries and bounded concurrency.

    ``model`` defaults to the first id the server lists on ``GET /models`` (``transformers serve`` lists none for a
    model it was started with: pass the name then, as ``ManagedServer.model_name`` does).
    """

    def __init__(
        self,
        base_url: str,
        model: str = "",
        api_key: str = "",
        max_concurrency: int = 8,
        timeout_s: float = 120.0,
        max_retries: int = 4,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        uds: str | None = None,
    ) -> None:
        """``uds``: the server's Unix socket (an engine without a TCP port); ``base_url`` then names the paths."""
        # httpx and openai take seconds to import, only when a client is made: not at the code location's load
        import httpx
        import openai

        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.base_url = base_url.rstrip("/")
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._secret = api_key  # only for scrubbing error texts; never printed
        self._loop = _LoopThread(f"openai-{self.base_url}")
        self._closed = False

        async def make() -> tuple[Any, asyncio.Semaphore]:
            # created on the loop that will use them: httpx connections and semaphores belong to one loop
            limits = httpx.Limits(
                max_connections=max_concurrency + 4, max_keepalive_connections=max_concurrency
            )
            http = openai.DefaultAsyncHttpxClient(
                limits=limits, timeout=timeout_s, transport=_unix_transport(uds, limits) if uds else None
            )
            # the openai client's own retries are off: ours back off with jitter and name the URL when they give up
            client = openai.AsyncOpenAI(
                base_url=self.base_url,
                api_key=api_key or "EMPTY",
                timeout=timeout_s,
                max_retries=0,
                http_client=http,
            )
            return client, asyncio.Semaphore(max_concurrency)

        self._client, self._slots = self._loop.run(make())
        self._capabilities: Capabilities | None = None
        try:
            self.model_id = model or self._loop.run(self._first_model())
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"OpenAICompatibleClient(base_url={self.base_url!r}, model={self.model_id!r})"

    # -- errors and retries ---------------------------------------------------------------------------------
    def _scrub(self, text: str) -> str:
        return text.replace(self._secret, "***") if self._secret else text

    def _describe(self, exc: BaseException) -> str:
        import openai  # as in __init__ (imported once, then a lookup)

        if isinstance(exc, openai.APIStatusError):
            text = f"HTTP {exc.status_code} from {self.base_url}: {str(exc.message)[:300]}"
        elif isinstance(exc, openai.APITimeoutError):
            text = f"timeout after {self.timeout_s:g} s talking to {self.base_url}"
        elif isinstance(exc, openai.APIConnectionError):
            cause: BaseException = exc
            while (
                cause.__cause__ is not None
            ):  # the innermost cause says "connection refused", "name unknown"
                cause = cause.__cause__
            text = f"cannot reach {self.base_url}: {type(cause).__name__}: {str(cause)[:200]}"
        else:
            text = f"{type(exc).__name__} from {self.base_url}: {str(exc)[:300]}"
        return self._scrub(text)

    @staticmethod
    def _retryable(exc: BaseException) -> bool:
        import openai  # as in __init__ (imported once, then a lookup)

        if isinstance(exc, openai.APIStatusError):
            return exc.status_code in RETRYABLE_STATUS
        return isinstance(exc, openai.APITimeoutError | openai.APIConnectionError)

    def _delay(self, attempt: int, exc: BaseException | None = None) -> float:
        """How long to wait before retry ``attempt + 1``.

        The server's ``Retry-After`` (seconds or an HTTP date; ``retry-after-ms`` too) when it sends one, capped at
        ``max_backoff_s`` so that a server asking for an hour does not park the step; else exponential backoff with
        jitter (0.5x-1.5x), so that many clients do not retry in lockstep.
        """
        asked = _retry_after_s(exc)
        if asked is not None:
            return min(self.max_backoff_s, asked)
        return min(self.max_backoff_s, self.backoff_s * 2**attempt) * (0.5 + random.random())

    async def _call(self, fn: Callable[..., Awaitable[Any]], **kwargs: Any) -> Any:
        """Await ``fn`` with retries; raise ``LLMError`` (naming the URL, never the key) when it keeps failing.

        Only transient failures are retried; a 4xx other than 408/409/429 raises at once with ``permanent`` set.
        The ``LLMError`` is raised outside the ``except`` block, so it carries no ``__context__``: the ``openai``
        exception holds the request (headers included) and must not travel into Dagster's error records.
        """
        import openai  # as in __init__ (imported once, then a lookup)

        if self._closed:
            raise LLMError(f"{self.base_url}: client is closed")
        message, status, permanent = "", None, False
        for attempt in range(self.max_retries + 1):
            try:
                async with (
                    self._slots
                ):  # at most max_concurrency requests in flight, waiting ones hold no slot
                    return await fn(**kwargs)
            except Exception as exc:  # every failure becomes an LLMError below
                message = self._describe(exc)
                status = exc.status_code if isinstance(exc, openai.APIStatusError) else None
                permanent = not self._retryable(exc)
                if permanent or attempt == self.max_retries:
                    if attempt:
                        message += f" (after {attempt + 1} attempts)"
                    break
                delay = self._delay(attempt, exc)
            log.warning("%s; retry %d/%d in %.2f s", message, attempt + 1, self.max_retries, delay)
            await asyncio.sleep(delay)
        raise LLMError(message, status=status, permanent=permanent)

    async def _first_model(self) -> str:
        models = await self._call(self._client.models.list)
        if not models.data:
            raise LLMError(f"{self.base_url} lists no model on GET /models; pass the model name explicitly")
        return models.data[0].id

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise LLMError(f"{self.base_url}: client is closed")
        return self._loop.run(coro)

    # -- capabilities ---------------------------------------------------------------------------------------
    def capabilities(self) -> Capabilities:
        """Probe once whether the engine honours ``logprobs`` and ``response_format`` (``transformers serve``
        ignores both): the judge picks its method from the answer and says which one it used."""
        if self._capabilities is None:
            self._capabilities = self._run(self._probe())
        return self._capabilities

    async def _probe(self) -> Capabilities:
        # An engine that rejects a parameter (400/422) does not support it; any other failure (a bad key, an
        # unknown model, a server that stays down) is raised: it would fail every later request too, and taking it
        # for "unsupported" would quietly downgrade the judge's method.
        try:
            resp = await self._call(
                self._client.chat.completions.create,
                model=self.model_id,
                messages=[{"role": "user", "content": "Say 1."}],
                max_tokens=1,
                logprobs=True,
                top_logprobs=5,
                temperature=0.0,
            )
            choice = resp.choices[0] if resp.choices else None
            has_logprobs = bool(
                choice is not None and choice.logprobs is not None and choice.logprobs.content
            )
        except LLMError as e:
            if not e.rejected_request:
                raise
            has_logprobs = False
        try:
            resp = await self._call(
                self._client.chat.completions.create,
                model=self.model_id,
                messages=[{"role": "user", "content": 'Reply with the JSON {"ok": true}.'}],
                max_tokens=16,
                temperature=0.0,
                response_format=_json_schema_format("probe", _PROBE_SCHEMA),
            )
            text = (resp.choices[0].message.content or "") if resp.choices else ""
            value = json.loads(text)
            has_schema = isinstance(value, dict) and isinstance(value.get("ok"), bool)
        except LLMError as e:
            if not e.rejected_request:
                raise
            has_schema = False
        except ValueError:
            has_schema = False  # ignored: free text came back
        return Capabilities(
            logprobs=has_logprobs,
            json_schema=has_schema,
            engine="openai-compatible",
            extra={"base_url": self.base_url, "model": self.model_id},
        )

    # -- chat -----------------------------------------------------------------------------------------------
    def _request(self, messages: Sequence[ChatMessage], params: SamplingParams) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "model": self.model_id,
            "messages": list(messages),
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
        }
        if params.seed is not None:
            kwargs["seed"] = params.seed
        return kwargs

    async def achat(
        self, messages: Sequence[ChatMessage], params: SamplingParams, **extra: Any
    ) -> Completion:
        """One chat completion on the client's loop; raises ``LLMError`` naming the URL when it keeps failing."""
        t0 = time.perf_counter()
        resp = await self._call(
            self._client.chat.completions.create, **self._request(messages, params), **extra
        )
        latency = time.perf_counter() - t0
        if not resp.choices:
            raise LLMError(f"{self.base_url} returned no choices for model {self.model_id!r}")
        choice = resp.choices[0]
        usage = resp.usage
        message = choice.message
        # vLLM's reasoning parsers fill `reasoning_content`; some servers call it `reasoning`
        reasoning = getattr(message, "reasoning_content", None) or getattr(message, "reasoning", None)
        return Completion(
            text=(message.content or "").strip(),
            model=resp.model or self.model_id,
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
            latency_s=latency,
            finish_reason=choice.finish_reason,
            reasoning=reasoning if isinstance(reasoning, str) and reasoning else None,
        )

    async def _achat_safe(self, messages: Sequence[ChatMessage], params: SamplingParams) -> Completion:
        t0 = time.perf_counter()
        try:
            return await self.achat(messages, params)
        except LLMError as e:
            if e.endpoint_wide:
                raise  # a wrong key or model: every other request would fail the same way
            return Completion(
                text="",
                model=self.model_id,
                prompt_tokens=0,
                completion_tokens=0,
                latency_s=time.perf_counter() - t0,
                error=str(e),
            )
        except Exception as e:  # a failed row is data, not a crash
            error = self._scrub(f"{type(e).__name__}: {e}")
            return Completion(
                text="",
                model=self.model_id,
                prompt_tokens=0,
                completion_tokens=0,
                latency_s=time.perf_counter() - t0,
                error=error,
            )

    def chat(self, messages: Sequence[ChatMessage], params: SamplingParams) -> Completion:
        return self._run(self.achat(messages, params))

    def chat_json(
        self, messages: Sequence[ChatMessage], schema: dict[str, object], name: str, params: SamplingParams
    ) -> Completion:
        if not self.capabilities().json_schema:
            raise NotImplementedError(f"{self.base_url} does not honour response_format json_schema")
        return self._run(self.achat(messages, params, response_format=_json_schema_format(name, schema)))

    def chat_many(
        self, conversations: Sequence[Sequence[ChatMessage]], params: SamplingParams
    ) -> list[Completion]:
        """Concurrent ``chat`` calls, in order; a request that fails after its retries comes back with ``error``."""
        if not conversations:
            return []

        async def all_of() -> list[Completion]:
            tasks = await _all_or_none([self._achat_safe(m, params) for m in conversations])
            return [t.result() for t in tasks]

        return self._run(all_of())

    def stream_chat(
        self, requests: Sequence[ChatRequest], chunk: int = 16
    ) -> Iterator[tuple[int, Completion]]:
        """``(index, answer)`` in completion order, ``max_concurrency`` requests in flight (``chunk`` unused).

        Stopping the iteration early (the consumer raised, the run was interrupted) cancels what is in flight.
        """
        if not requests:
            return
        done: queue.Queue[tuple[int, Completion]] = queue.Queue()

        async def one(i: int, r: ChatRequest) -> None:
            done.put((i, await self._achat_safe(r.messages, r.params)))

        async def all_of() -> None:
            await _all_or_none([one(i, r) for i, r in enumerate(requests)])

        if self._closed:
            raise LLMError(f"{self.base_url}: client is closed")
        future = self._loop.submit(all_of())
        try:
            for _ in range(len(requests)):
                while True:
                    try:
                        yield done.get(timeout=0.5)
                        break
                    except queue.Empty:
                        if future.done() and done.empty():
                            future.result()  # re-raises what broke the batch, if anything did
                            raise LLMError(
                                f"{self.base_url}: streaming stopped before every answer came back"
                            ) from None
        finally:
            future.cancel()

    def sample(
        self, messages: Sequence[ChatMessage], params: SamplingParams, n: int, token_ids: bool = False
    ) -> list[Sample]:
        """``n`` answers to one conversation in one request (``n``), each with its tokens' log-probabilities.

        ``token_ids``: tokens as ``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids``), to compare with another
        engine's ids. An engine that returns fewer than ``n`` answers, or none of the log-probabilities, ignored
        what was asked (``transformers serve`` does): an ``LLMError``, never fewer samples than the caller counts.
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        extra: dict[str, Any] = {"extra_body": {"return_tokens_as_token_ids": True}} if token_ids else {}
        resp = self._run(
            self._call(
                self._client.chat.completions.create,
                **self._request(messages, params),
                n=n,
                logprobs=True,
                **extra,
            )
        )
        samples = [
            Sample(
                text=c.message.content or "",
                tokens=[t.token for t in (c.logprobs.content or [])] if c.logprobs else [],
                logprobs=[t.logprob for t in (c.logprobs.content or [])] if c.logprobs else [],
                finish_reason=c.finish_reason,
            )
            for c in resp.choices
        ]
        if len(samples) != n or any(not s.logprobs for s in samples):
            raise LLMError(
                f"{self.base_url} ignored n={n} or logprobs (got {len(samples)} answers, "
                f"{sum(bool(s.logprobs) for s in samples)} with log-probabilities): serve it with vLLM",
                permanent=True,
            )
        return samples

    # -- scoring --------------------------------------------------------------------------------------------
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
        resp = self._run(
            self._call(
                self._client.chat.completions.create,
                model=self.model_id,
                messages=list(messages),
                max_tokens=1,
                logprobs=True,
                top_logprobs=TOP_LOGPROBS,
                temperature=0.0,
            )
        )
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
        """Close the connections and stop the loop thread. Idempotent."""
        if self._closed:
            return
        try:
            if getattr(self, "_client", None) is not None:
                self._loop.run(self._client.close())
        finally:
            self._closed = True
            self._loop.stop()


def _json_schema_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


async def _all_or_none(coros: Sequence[Coroutine[Any, Any, T]]) -> list[asyncio.Task[T]]:
    """Run ``coros`` concurrently; the first that raises cancels the rest (not yet sent: they would fail the same
    way) and its exception is raised as it is, not wrapped in an ``ExceptionGroup``."""
    tasks: list[asyncio.Task[T]] = []
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in coros]
    except BaseExceptionGroup as eg:
        first = eg.exceptions[0]
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    return tasks


def _retry_after_s(exc: BaseException | None) -> float | None:
    """Seconds the server asked us to wait (``retry-after-ms`` or ``Retry-After``: seconds or an HTTP date)."""
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None)
    if headers is None:
        return None
    try:
        if headers.get("retry-after-ms"):
            return max(0.0, float(headers["retry-after-ms"]) / 1000)
        value = headers.get("retry-after")
        if not value:
            return None
        try:
            return max(0.0, float(value))
        except ValueError:
            when = email.utils.parsedate_to_datetime(value)
            return max(0.0, (when - datetime.datetime.now(datetime.UTC)).total_seconds())
    except (TypeError, ValueError):
        return None  # unreadable: fall back to our own backoff


def _logaddexp(a: float, b: float) -> float:
    hi, lo = max(a, b), min(a, b)
    return hi + math.log1p(math.exp(lo - hi))
