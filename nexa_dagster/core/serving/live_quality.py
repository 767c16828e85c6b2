"""Scores of live answers, a canary's ``quality`` figure: each answer HAProxy kept (a sample of the requests, both
backends at one rate: ``haproxy.request_logging``) scored on a thread of its own, never in a request's path.

A request is scored by what can check it, blind to which backend answered:

* a *checkable* request, one whose prompt is in the answer book (the frozen held-out RL prompt set,
  ``core.evaluation.rl_eval_set``, or any JSONL of ``prompt`` and ``answer`` rows), gets the verifiable reward the
  RL stage trains and gates on (``exact_answer``: 1 for the right answer, else 0), or, for a row that says
  ``reward: reference_f1``, the word-bigram F1 against its ``reference`` (an open question);
* any other gets the pointwise judge's score mapped to [0, 1] (``judge_score``, the RL reward of that name: an
  empty answer or an echo of the prompt scores 0 without asking), when a judge is given;
* none, when the answer cannot be read (not JSON, cut at HAProxy's buffer, no choice), or no judge is given for an
  unchecked prompt: counted as unscored, never as a 0 (a missing score is not a bad answer).

The queue is bounded: when the scorer falls behind (a slow judge) a kept answer is dropped and counted, rather than
memory growing with the traffic. Requests of both backends are kept at one rate and interleave in the queue, so a
drop does not pick a side. Dagster-free.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from nexa_dagster.core.common.config import read_text
from nexa_dagster.core.llm.openai_compat import OpenAICompatibleClient
from nexa_dagster.core.rl.rewards import (
    bigram_f1,
    exact_answer_score,
    make_judge_score,
    normalize_answer,
    prompt_text,
)
from nexa_dagster.core.serving.request_log import Exchange

if TYPE_CHECKING:
    from nexa_dagster.core.distill.judge import Judge, Verdict

log = logging.getLogger(__name__)
Source = Literal["reward", "judge"]
JUDGE_TEMPLATE, VERDICT_TEMPLATE = "prompts/judge.jinja", "prompts/judge_verdict.jinja"  # the gate's judge's


class AnswerBookError(ValueError):
    """An answer book that cannot be read: the message names the file and the line."""


@dataclass(frozen=True)
class LiveScore:
    value: float  # in [0, 1]
    source: Source


@dataclass(frozen=True)
class Check:
    """How one checkable prompt is scored: ``exact_answer`` against its answer (the RL stage's reward and gate), or
    ``reference_f1`` (word-bigram F1, the RL reward of that name) against a reference answer, for open questions
    whose right answer a sentence can phrase many ways."""

    reward: Literal["exact_answer", "reference_f1"]
    expected: str

    def score(self, text: str) -> float:
        if self.reward == "exact_answer":
            return exact_answer_score(text, self.expected)
        return bigram_f1(text, self.expected)


class AnswerBook:
    """Checkable prompts and how each is checked, found by the prompt's text (the user turns, normalised as answers
    are: case, spacing and edge punctuation do not make a prompt another one)."""

    def __init__(self, checks: dict[str, Check], path: str = "") -> None:
        self.checks, self.path = checks, path

    @classmethod
    def load(cls, path: str | Path) -> AnswerBook:
        """Per JSONL line ``prompt`` (text or chat messages) and ``answer`` (checked exactly), or ``reward:
        reference_f1`` and ``reference``; a bad line is an error naming it. The frozen RL eval set's rows qualify."""
        checks: dict[str, Check] = {}
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise AnswerBookError(f"answer book {path}: cannot be read: {e}") from e
        for n, line in enumerate(lines, start=1):
            if line.strip():
                key, check = _row(line, f"answer book {path} line {n}")
                checks[key] = check
        if not checks:
            raise AnswerBookError(f"answer book {path}: no rows")
        return cls(checks, str(path))

    def check_for(self, prompt: str) -> Check | None:
        return self.checks.get(normalize_answer(prompt))

    def answer_for(self, prompt: str) -> str | None:
        check = self.check_for(prompt)
        return check.expected if check is not None else None

    def __len__(self) -> int:
        return len(self.checks)


def _row(line: str, where: str) -> tuple[str, Check]:
    """One answer book line's prompt key and check (``AnswerBookError`` naming ``where``)."""
    try:
        row = json.loads(line)
        reward = row.get("reward", "exact_answer")
        field = {"exact_answer": "answer", "reference_f1": "reference"}[reward]
        prompt, expected = row["prompt"], str(row[field])
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise AnswerBookError(
            f"{where}: not a JSON object with 'prompt' and 'answer' (or reward 'reference_f1' and 'reference'): "
            f"{type(e).__name__} {e}"
        ) from None
    key = normalize_answer(prompt_text(prompt))
    if not key or not expected.strip():
        raise AnswerBookError(f"{where}: an empty prompt or answer")
    return key, Check(reward, expected)


def read_exchange(exchange: Exchange) -> tuple[Any, str] | None:
    """(the request's prompt: chat messages or text, the answer's text) of an OpenAI-style chat or completions
    exchange, or None when either body is not readable as one."""
    try:
        request, answer = json.loads(exchange.request), json.loads(exchange.answer)
        prompt = request["messages"] if "messages" in request else request["prompt"]
        choice = answer["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, IndexError, TypeError):
        return None
    if not isinstance(text, str):
        return None
    return prompt, text


def score_exchange(exchange: Exchange, book: AnswerBook | None, judge: Any = None) -> LiveScore | None:
    """The exchange's score (module docstring), or None when nothing can score it."""
    read = read_exchange(exchange)
    if read is None:
        return None
    prompt, text = read
    check = book.check_for(prompt_text(prompt)) if book is not None else None
    if check is not None:
        return LiveScore(check.score(text), "reward")
    if judge is None:
        return None
    return LiveScore(make_judge_score(judge)([text], prompts=[prompt])[0], "judge")


class EndpointJudge:
    """The pointwise judge on an OpenAI-compatible endpoint, connected on its first answer (on the scorer's thread):
    the judge probes its endpoint when built, and a judge that is down must not stop the serving service from
    starting; it fails the answers it is asked, counted as failed."""

    def __init__(self, base_url: str, model: str, api_key: str = "", max_concurrency: int = 2) -> None:
        self.base_url, self.model, self._key, self.max_concurrency = base_url, model, api_key, max_concurrency
        self._judge: Judge | None = None

    def judge_many(self, items: Sequence[tuple[str, str]]) -> list[Verdict]:
        if self._judge is None:
            # here, not at the top: the judge's module imports pandas (0.3 s), which the service's start need not pay
            from nexa_dagster.core.distill.judge import Judge

            client = OpenAICompatibleClient(
                self.base_url, self.model, self._key, max_concurrency=self.max_concurrency
            )
            self._judge = Judge(client, read_text(JUDGE_TEMPLATE), read_text(VERDICT_TEMPLATE))
        return self._judge.judge_many(items)


class LiveQualityScorer:
    """``submit(arm, exchange)`` from the request log's thread; ``on_score(arm, score)`` is called from the
    scorer's own thread. ``counts`` says what happened to every kept answer (scored by what, unscored, dropped)."""

    def __init__(
        self,
        on_score: Callable[[Any, LiveScore], None],
        book: AnswerBook | None = None,
        judge: Any = None,
        max_pending: int = 256,
    ) -> None:
        self.on_score, self.book, self.judge = on_score, book, judge
        self.counts: Counter[str] = Counter()
        self._queue: queue.Queue[tuple[str, Exchange] | None] = queue.Queue(max_pending)
        self._thread: threading.Thread | None = None

    def start(self) -> LiveQualityScorer:
        self._thread = threading.Thread(target=self._work, name="live-quality", daemon=True)
        self._thread.start()
        return self

    def submit(self, arm: str, exchange: Exchange) -> bool:
        """Queue one kept answer; False (and counted as dropped) when the scorer is that far behind."""
        try:
            self._queue.put_nowait((arm, exchange))
        except queue.Full:
            self.counts["dropped"] += 1
            return False
        return True

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._score(*item)
            finally:
                self._queue.task_done()

    def _score(self, arm: str, exchange: Exchange) -> None:
        try:
            score = score_exchange(exchange, self.book, self.judge)
        except Exception as e:  # a judge that fails for good: counted and logged, the canary goes on
            self.counts["failed"] += 1
            log.warning("live answer not scored: %s", e)
            return
        if score is None:
            self.counts["unscored"] += 1
            return
        self.counts[f"{arm} {score.source}"] += 1
        self.on_score(arm, score)

    def drain(self, timeout_s: float = 10.0) -> None:
        """Wait until every queued answer is scored (tests, and before a final count)."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.02)

    def stop(self) -> None:
        if self._thread is not None:
            with contextlib.suppress(queue.Full):
                self._queue.put(None, timeout=5)
            self._thread.join(timeout=10)
            self._thread = None
