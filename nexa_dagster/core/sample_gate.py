"""SampleGate: heuristic filters, then an LLM judge, and a reason for every sample turned away.

Heuristics are cheap and run first; only survivors are sent to the judge. The judge's score is read from the
probabilities of the score tokens "1".."5" (``expected_score``) when the engine returns log-probabilities, which
gives a valid, graded verdict even from a weak model; otherwise the judge's text is parsed, and a sample with no
readable verdict is rejected with reason ``judge_no_verdict``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

from nexa_dagster.core.config import FilterThresholds
from nexa_dagster.core.distillation import render
from nexa_dagster.core.llm.base import ChatMessage, LLMClient, SamplingParams, expected_score

SCORE_CHOICES = ("1", "2", "3", "4", "5")
_SCORE_IN_TEXT = re.compile(r"\b([1-5])\b")


def repeat_ngram_ratio(text: str, n: int) -> float:
    """Share of word n-grams that repeat an earlier one (0 = no repetition, near 1 = a loop)."""
    words = text.split()
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def non_printable_ratio(text: str) -> float:
    if not text:
        return 0.0
    bad = sum(1 for ch in text if not ch.isprintable() and ch not in "\n\t")
    return bad / len(text)


def echo_overlap(prompt: str, response: str) -> float:
    """Share of the response made of 8-character shingles copied from the prompt."""
    k = 8
    if len(response) < k:
        return 0.0
    prompt_shingles = {prompt[i:i + k] for i in range(len(prompt) - k + 1)}
    shingles = [response[i:i + k] for i in range(len(response) - k + 1)]
    return sum(s in prompt_shingles for s in shingles) / len(shingles)


def heuristic_reason(prompt: str, response: str, error: str | None, t: FilterThresholds) -> str | None:
    """The first heuristic rule a sample breaks, as a reason code with its measured value, or None."""
    if error:
        return f"teacher_error: {error}"
    n = len(response.strip())
    if n < t.min_response_chars:
        return f"too_short: {n} < {t.min_response_chars} chars"
    if n > t.max_response_chars:
        return f"too_long: {n} > {t.max_response_chars} chars"
    r = repeat_ngram_ratio(response, t.repeat_ngram_n)
    if r > t.max_repeat_ngram_ratio:
        return f"repetition: {t.repeat_ngram_n}-gram repeat ratio {r:.2f} > {t.max_repeat_ngram_ratio}"
    npr = non_printable_ratio(response)
    if npr > t.max_non_printable_ratio:
        return f"non_printable: ratio {npr:.3f} > {t.max_non_printable_ratio}"
    for pattern in t.refusal_patterns:
        if re.search(pattern, response):
            return f"refusal: matches {pattern!r}"
    overlap = echo_overlap(prompt, response)
    if overlap > t.prompt_echo_max_overlap:
        return f"prompt_echo: {overlap:.2f} of the response copied from the prompt"
    return None


@dataclass(frozen=True)
class Verdict:
    score: float | None
    method: str  # "logprobs" or "text"


def judge_one(client: LLMClient, template: str, prompt: str, response: str, max_tokens: int) -> Verdict:
    messages: list[ChatMessage] = [{"role": "user", "content": render(template, prompt=prompt, response=response)}]
    if client.capabilities().logprobs:
        return Verdict(expected_score(client.choice_logprobs(messages, SCORE_CHOICES)), "logprobs")
    text = client.chat(messages, SamplingParams(max_tokens=max_tokens, temperature=0.0)).text
    match = _SCORE_IN_TEXT.search(text)
    return Verdict(float(match.group(1)) if match else None, "text")


def apply_sample_gate(samples: pd.DataFrame, thresholds: FilterThresholds, judge: LLMClient, judge_template: str,
                      judge_max_tokens: int = 8,
                      progress: Callable[[int, int], None] | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Split teacher samples into (filtered, rejected); rejected rows carry ``reason``."""
    scores: list[float | None] = []
    methods: list[str | None] = []
    reasons: list[str | None] = []
    total = len(samples)
    for i, row in enumerate(samples.itertuples(index=False), start=1):
        reason = heuristic_reason(row.prompt, row.response, row.error if isinstance(row.error, str) else None,
                                  thresholds)
        score: float | None = None
        method: str | None = None
        if reason is None:
            verdict = judge_one(judge, judge_template, row.prompt, row.response, judge_max_tokens)
            score, method = verdict.score, verdict.method
            if score is None:
                reason = "judge_no_verdict: the judge's answer held no score 1-5"
            elif score < thresholds.judge_min_score:
                reason = f"judge_low_score: {score:.2f} < {thresholds.judge_min_score}"
        scores.append(score)
        methods.append(method)
        reasons.append(reason)
        if progress and (i % 8 == 0 or i == total):
            progress(i, total)
    judged = samples.assign(judge_score=scores, judge_method=methods, reason=reasons)
    keep = judged["reason"].isna()
    filtered = judged[keep].drop(columns=["reason"]).reset_index(drop=True)
    rejected = judged[~keep].reset_index(drop=True)
    return filtered, rejected
