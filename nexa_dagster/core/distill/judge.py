"""The LLM judge: a rubric prompt, a well-formed verdict (score 1-5 and a short rationale), or ``judge_error``.

Which method makes the verdict well-formed depends on what the engine honours, probed at start-up
(``LLMClient.capabilities``) and recorded with every verdict:

* ``json_schema``: decoding constrained to ``VERDICT_SCHEMA`` (``response_format``; vLLM, hosted APIs), then the
  same strict parse as ``text`` (an engine may still stop mid-object at ``max_tokens``);
* ``logprobs``: G-Eval style, the score is the expected value of the score tokens "1".."5" under the judge's own
  probabilities at the first answer token (the in-process backend, vLLM), and the confidence is the renormalised
  probability of the most likely score. It is graded and always well-formed, even from a weak model, but has no
  rationale;
* ``text``: the engine is asked for the JSON verdict and its answer is parsed strictly: one JSON object (optionally
  in a code fence) with an integer ``score`` in 1..5 and a string ``rationale``. No digit-hunting in free text.

A verdict that cannot be read, is out of range, or whose request failed is asked again (``retries`` times, later
attempts sampled at temperature 0.7 with their own seed, since a greedy judge repeats its mistake) and then comes
back with ``error`` set: SampleGate rejects such a sample as ``judge_error``; nothing passes by default.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from nexa_dagster.core.common.config import read_text
from nexa_dagster.core.distill.teacher import render
from nexa_dagster.core.llm.base import (
    Capabilities,
    ChatMessage,
    LLMClient,
    LLMError,
    SamplingParams,
    expected_score,
)

SCORE_CHOICES = ("1", "2", "3", "4", "5")
METHODS = ("auto", "json_schema", "logprobs", "text")
VERDICT_SCHEMA: dict[str, object] = {
    "type": "object",
    "properties": {
        "score": {"type": "integer", "minimum": 1, "maximum": 5},
        "rationale": {"type": "string", "maxLength": 400},
    },
    "required": ["score", "rationale"],
    "additionalProperties": False,
}
VERDICT_MIN_TOKENS = 96  # a JSON verdict with a one-sentence rationale; fewer would cut it off mid-object
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


class VerdictError(ValueError):
    """The judge's answer is not a well-formed verdict; the message says what is wrong with it."""


def parse_verdict(text: str) -> tuple[int, str]:
    """``(score, rationale)`` from a strict JSON verdict, or ``VerdictError`` saying why not."""
    body = text.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1)
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        raise VerdictError(f"not a JSON object ({e.msg} at char {e.pos}): {text[:80]!r}") from None
    if not isinstance(value, dict):
        raise VerdictError(f"verdict is a JSON {type(value).__name__}, not an object: {text[:80]!r}")
    score = value.get("score")
    if isinstance(score, bool) or not isinstance(score, int | float) or float(score) != int(score):
        raise VerdictError(f"verdict field 'score' is {score!r}, not an integer")
    if not 1 <= int(score) <= 5:
        raise VerdictError(f"verdict field 'score' {score} is out of range 1..5")
    rationale = value.get("rationale")
    if not isinstance(rationale, str):
        raise VerdictError(f"verdict field 'rationale' is {rationale!r}, not a string")
    return int(score), rationale.strip()


def pick_method(capabilities: Capabilities, preferred: str = "auto") -> str:
    """The method to use: ``preferred`` when the engine supports it, else the best it offers (for ``auto``)."""
    if preferred not in METHODS:
        raise ValueError(f"judge method {preferred!r} is not one of {METHODS}")
    if preferred == "auto":
        return "json_schema" if capabilities.json_schema else "logprobs" if capabilities.logprobs else "text"
    if (preferred == "json_schema" and not capabilities.json_schema) or (
        preferred == "logprobs" and not capabilities.logprobs
    ):
        raise ValueError(
            f"judge method {preferred!r} is not supported by the {capabilities.engine} engine "
            f"({capabilities.extra}); use 'auto' or 'text'"
        )
    return preferred


@dataclass(frozen=True)
class Verdict:
    score: float | None
    method: str  # "json_schema", "logprobs" or "text"
    rationale: str | None = None
    confidence: float | None = None  # logprobs only: probability of the most likely score
    error: str | None = None  # set (and score None) when no well-formed verdict came back
    attempts: int = 1


class Judge:
    """One judge endpoint with its templates and method; ``judge_many`` keeps ``max_concurrency`` requests busy.

    ``score_template`` (Jinja, ``prompt`` and ``response``) ends where the score token comes (logprobs);
    ``verdict_template`` asks for the JSON verdict (json_schema and text).
    """

    def __init__(
        self,
        client: LLMClient,
        score_template: str,
        verdict_template: str,
        max_tokens: int = 128,
        method: str = "auto",
        retries: int = 2,
    ) -> None:
        self.client = client
        self.score_template = score_template
        self.verdict_template = verdict_template
        if retries < 0:
            raise ValueError(f"judge retries must be >= 0, got {retries}")
        self.retries = retries
        self.method = pick_method(client.capabilities(), method)
        if self.method != "logprobs" and max_tokens < VERDICT_MIN_TOKENS:
            raise ValueError(
                f"judge max_tokens {max_tokens} is too few for a JSON verdict (method {self.method!r}): "
                f"it would be cut off mid-object; use at least {VERDICT_MIN_TOKENS}"
            )
        self.max_tokens = max_tokens  # the logprobs method reads one token and does not use it

    def _messages(self, template: str, prompt: str, response: str) -> list[ChatMessage]:
        return [{"role": "user", "content": render(template, prompt=prompt, response=response)}]

    def _attempt(self, prompt: str, response: str, attempt: int) -> Verdict:
        if self.method == "logprobs":
            logprobs = self.client.choice_logprobs(
                self._messages(self.score_template, prompt, response), SCORE_CHOICES
            )
            if not all(math.isfinite(v) for v in logprobs.values()):
                raise VerdictError(f"non-finite score log-probabilities {logprobs}")
            top = max(logprobs.values())
            weights = [math.exp(v - top) for v in logprobs.values()]
            return Verdict(expected_score(logprobs), "logprobs", None, max(weights) / sum(weights))
        params = (
            SamplingParams(self.max_tokens, 0.0)
            if attempt == 0
            else SamplingParams(self.max_tokens, 0.7, 1.0, seed=attempt)
        )
        messages = self._messages(self.verdict_template, prompt, response)
        answer = (
            self.client.chat_json(messages, VERDICT_SCHEMA, "verdict", params)
            if self.method == "json_schema"
            else self.client.chat(messages, params)
        )
        score, rationale = parse_verdict(answer.text)
        return Verdict(float(score), self.method, rationale)

    def judge(self, prompt: str, response: str) -> Verdict:
        """The verdict on one answer; never raises for a bad or failed verdict (``error`` is set instead).

        Only an unreadable verdict is asked again: a failed request has had its transport retries in the client
        already (re-asking would multiply them) or was refused for what it asks (a 400: asking again cannot help),
        and a failure of the endpoint itself (bad key, unknown model: ``LLMError.endpoint_wide``) is raised, since
        every other verdict would fail the same way.
        """
        problems = []
        for attempt in range(self.retries + 1):
            try:
                verdict = self._attempt(prompt, response, attempt)
            except VerdictError as e:
                problems.append(str(e))
                continue
            except LLMError as e:
                if e.endpoint_wide:
                    raise
                return Verdict(None, self.method, None, None, f"request failed: {e}", attempt + 1)
            return Verdict(
                verdict.score, verdict.method, verdict.rationale, verdict.confidence, None, attempt + 1
            )
        return Verdict(
            None,
            self.method,
            None,
            None,
            f"no valid verdict after {self.retries + 1} attempts; last: {problems[-1]}",
            self.retries + 1,
        )

    def judge_many(
        self, items: Sequence[tuple[str, str]], progress: Callable[[int, int], None] | None = None
    ) -> list[Verdict]:
        """Verdicts for ``(prompt, response)`` pairs, in order, up to the client's ``max_concurrency`` at once."""
        if not items:
            return []
        workers = max(1, min(self.client.max_concurrency, len(items)))
        out: list[Verdict] = []
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="judge") as pool:
            for i, verdict in enumerate(pool.map(lambda item: self.judge(*item), items), start=1):
                out.append(verdict)
                if progress:
                    progress(i, len(items))
        return out


def judge_one(
    client: LLMClient,
    template: str,
    prompt: str,
    response: str,
    max_tokens: int = 128,
    verdict_template: str | None = None,
    method: str = "auto",
    retries: int = 2,
) -> Verdict:
    """One verdict with ``template`` as the score prompt (what evaluation uses); see ``Judge``.

    ``verdict_template`` defaults to ``configs/prompts/judge_verdict.jinja``.
    """
    if verdict_template is None:
        verdict_template = read_text("prompts/judge_verdict.jinja")
    return Judge(client, template, verdict_template, max_tokens, method, retries).judge(prompt, response)
