"""SampleGate: heuristic filters, de-duplication, then the LLM judge, and a reason for every sample turned away.

Cheapest first: heuristics (length in characters and tokens, n-gram repetition, non-printable and non-letter
ratios, refusal and boilerplate patterns, prompt echo), then exact and near-duplicate detection (within the
partition and against every earlier partition, ``core.dedup``), and only the survivors are sent to the judge
(``core.judge``), which is the part that costs. Every rejected row carries a reason code with the measured value
(``too_short: 3 < 8 chars``, ``near_duplicate: Jaccard 0.91 with sample ab12.. (partition 2026-11-20)``,
``judge_error: ...``) and, when the judge saw it, the judge's score, rationale and method.

Thresholds live in ``configs/filters.yaml`` (demo) and ``configs/filters.production.yaml``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, model_validator

from nexa_dagster.core.common.config import load_validated
from nexa_dagster.core.distill.dedup import DedupIndex, DedupSettings, load_history, save_partition
from nexa_dagster.core.distill.judge import SCORE_CHOICES, VERDICT_MIN_TOKENS, Judge, Verdict, judge_one
from nexa_dagster.core.llm.base import LLMClient

__all__ = [
    "SCORE_CHOICES",
    "GateConfig",
    "GateResult",
    "Verdict",
    "apply_sample_gate",
    "heuristic_reason",
    "judge_one",
    "load_gate_config",
]

GATE_COLUMNS = ["judge_score", "judge_method", "judge_rationale", "judge_confidence"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JudgeConfig(_Strict):
    method: Literal["auto", "json_schema", "logprobs", "text"] = "auto"  # core.judge.METHODS
    min_score: float = Field(
        ge=1, le=5, description="samples scored below this are rejected (judge_low_score)"
    )
    max_tokens: int = Field(
        default=128,
        ge=VERDICT_MIN_TOKENS,
        description="for JSON verdicts (json_schema, text); fewer would cut a verdict off",
    )
    retries: int = Field(default=2, ge=0, description="re-asks of an unreadable verdict before judge_error")
    validity_pairs: int = Field(
        default=24,  # a judge right 3 times in 4 passes the sign test (17+ of 24) with probability 0.77; 12: 0.39
        ge=0,
        description="answers re-judged with their words shuffled for the judge_prefers_real_answers check "
        "(0: no check); core/distill/judge_validity.py",
    )


class DedupConfig(_Strict):
    enabled: bool = True
    near_duplicate_threshold: float = Field(default=0.85, gt=0, le=1)
    num_perm: int = Field(default=128, ge=16)
    shingle: int = Field(default=5, ge=1, description="character shingle length")


class GateConfig(_Strict):
    # at least 1: a blank answer never passes the heuristics (nor does an errored one, teacher_error), so no
    # sample SampleGate keeps is without an answer and no check downstream needs to say it again
    min_response_chars: int = Field(ge=1)
    max_response_chars: int = Field(gt=0)
    min_response_tokens: int = Field(default=0, ge=0)
    max_response_tokens: int = Field(default=1_000_000, gt=0)
    max_repeat_ngram_ratio: float = Field(ge=0, le=1)
    repeat_ngram_n: int = Field(gt=0)
    max_non_printable_ratio: float = Field(ge=0, le=1)
    max_non_letter_ratio: float = Field(default=1.0, ge=0, le=1)
    refusal_patterns: list[str] = Field(default_factory=list)
    boilerplate_patterns: list[str] = Field(default_factory=list)
    prompt_echo_max_overlap: float = Field(ge=0, le=1)
    judge: JudgeConfig
    dedup: DedupConfig = DedupConfig()
    pass_rate_band: tuple[float, float] = (0.0, 1.0)

    @model_validator(mode="after")
    def _check(self) -> GateConfig:
        lo, hi = self.pass_rate_band
        if not 0 <= lo <= hi <= 1:
            raise ValueError(f"pass_rate_band {self.pass_rate_band} must satisfy 0 <= low <= high <= 1")
        for pattern in [*self.refusal_patterns, *self.boilerplate_patterns]:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"pattern {pattern!r} is not a valid regular expression: {e}") from e
        return self


def load_gate_config(name: str = "filters.yaml") -> GateConfig:
    return load_validated(GateConfig, name)


# -- heuristics ----------------------------------------------------------------------------------------------------
def repeat_ngram_ratio(text: str, n: int) -> float:
    """Share of word n-grams that repeat an earlier one (0 = no repetition, near 1 = a loop)."""
    words = text.split()
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def non_printable_ratio(text: str) -> float:
    if not text:
        return 0.0
    bad = sum(1 for ch in text if not ch.isprintable() and ch not in "\n\t")
    return bad / len(text)


def non_letter_ratio(text: str) -> float:
    """Share of the non-space characters that are not letters (digits, punctuation, symbols, debris)."""
    chars = [ch for ch in text if not ch.isspace()]
    if not chars:
        return 0.0
    return sum(1 for ch in chars if not ch.isalpha()) / len(chars)


def echo_overlap(prompt: str, response: str) -> float:
    """Share of the response made of 8-character shingles copied from the prompt."""
    k = 8
    if len(response) < k:
        return 0.0
    prompt_shingles = {prompt[i : i + k] for i in range(len(prompt) - k + 1)}
    shingles = [response[i : i + k] for i in range(len(response) - k + 1)]
    return sum(s in prompt_shingles for s in shingles) / len(shingles)


def heuristic_reason(
    prompt: str, response: str, error: str | None, t: GateConfig, completion_tokens: int | None = None
) -> str | None:
    """The first heuristic rule a sample breaks, as a reason code with its measured value, or None."""
    if error:
        return f"teacher_error: {error}"
    n = len(response.strip())
    if n < t.min_response_chars:
        return f"too_short: {n} < {t.min_response_chars} chars"
    if n > t.max_response_chars:
        return f"too_long: {n} > {t.max_response_chars} chars"
    if completion_tokens is not None:
        if completion_tokens < t.min_response_tokens:
            return f"too_short: {completion_tokens} < {t.min_response_tokens} tokens"
        if completion_tokens > t.max_response_tokens:
            return f"too_long: {completion_tokens} > {t.max_response_tokens} tokens"
    r = repeat_ngram_ratio(response, t.repeat_ngram_n)
    if r > t.max_repeat_ngram_ratio:
        return f"repetition: {t.repeat_ngram_n}-gram repeat ratio {r:.2f} > {t.max_repeat_ngram_ratio}"
    npr = non_printable_ratio(response)
    if npr > t.max_non_printable_ratio:
        return f"non_printable: ratio {npr:.3f} > {t.max_non_printable_ratio}"
    nlr = non_letter_ratio(response)
    if nlr > t.max_non_letter_ratio:
        return f"non_letter: ratio {nlr:.2f} > {t.max_non_letter_ratio}"
    for pattern in t.refusal_patterns:
        if re.search(pattern, response):
            return f"refusal: matches {pattern!r}"
    for pattern in t.boilerplate_patterns:
        if re.search(pattern, response):
            return f"boilerplate: matches {pattern!r}"
    overlap = echo_overlap(prompt, response)
    if overlap > t.prompt_echo_max_overlap:
        return f"prompt_echo: {overlap:.2f} of the response copied from the prompt"
    return None


# -- the gate ------------------------------------------------------------------------------------------------------
@dataclass
class GateResult:
    filtered: pd.DataFrame
    rejected: pd.DataFrame
    judge_method: str
    judge_capabilities: dict[str, object]
    judged: int = 0  # samples sent to the judge
    judge_attempts: int = 0
    history_partitions: list[str] = field(default_factory=list)  # earlier partitions deduplicated against

    @property
    def total(self) -> int:
        return len(self.filtered) + len(self.rejected)

    @property
    def pass_rate(self) -> float:
        return len(self.filtered) / self.total if self.total else 0.0

    def reason_counts(self) -> dict[str, int]:
        if self.rejected.empty:
            return {}
        return {
            str(k): int(v) for k, v in self.rejected["reason"].str.split(":").str[0].value_counts().items()
        }


def configured_judge(
    client: LLMClient, config: GateConfig, score_template: str, verdict_template: str
) -> Judge:
    """The gate's judge: ``client`` with the SampleGate file's method, token budget and retries."""
    return Judge(
        client,
        score_template,
        verdict_template,
        config.judge.max_tokens,
        config.judge.method,
        config.judge.retries,
    )


def apply_sample_gate(
    samples: pd.DataFrame,
    config: GateConfig,
    judge: LLMClient,
    score_template: str,
    verdict_template: str,
    dedup_root: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> GateResult:
    """Split teacher samples into filtered and rejected rows (rejected ones carry ``reason``).

    Partitions (the ``day`` column) are gated in key order, each deduplicated against every earlier one: the
    history persisted under ``dedup_root`` (partitions before the first one here) and those earlier in this call.
    With ``dedup_root`` set, each partition's kept signatures are written there for the partitions after it.
    """
    gate_judge = configured_judge(judge, config, score_template, verdict_template)
    caps = judge.capabilities()
    settings = DedupSettings(
        config.dedup.near_duplicate_threshold, config.dedup.num_perm, config.dedup.shingle
    )
    history = DedupIndex(settings)
    result = GateResult(
        samples.iloc[0:0],
        samples.iloc[0:0],
        gate_judge.method,
        {"engine": caps.engine, "logprobs": caps.logprobs, "json_schema": caps.json_schema},
    )
    days = sorted(samples["day"].unique().tolist()) if len(samples) else []
    if config.dedup.enabled and dedup_root and days:
        result.history_partitions = load_history(history, dedup_root, before=days[0])
    judged_frames = []
    done, total = 0, len(samples)
    for day in days:
        part = samples[samples["day"] == day].reset_index(drop=True)
        tick = _progress_from(progress, done, total)
        judged_frames.append(
            _gate_partition(part, day, config, gate_judge, history, result, tick, dedup_root)
        )
        done += len(part)
        # rows the heuristics or dedup decided never reach the judge: the day is done all the same
        if progress:
            progress(done, total)
    result.filtered, result.rejected = _filtered_and_rejected(samples, judged_frames)
    return result


def _progress_from(
    progress: Callable[[int, int], None] | None, offset: int, total: int
) -> Callable[[int, int], None]:
    """The judge's progress callback for one partition: its judged rows counted after the ``offset`` before it."""

    def tick(n: int, _: int) -> None:
        if progress:
            progress(offset + n, total)

    return tick


def _gate_partition(
    part: pd.DataFrame,
    day: str,
    config: GateConfig,
    gate_judge: Judge,
    history: DedupIndex,
    result: GateResult,
    tick: Callable[[int, int], None],
    dedup_root: str | None,
) -> pd.DataFrame:
    """One partition's rows with the judge's columns and ``reason`` (None: kept); its kept rows join ``history``.

    Only the rows the heuristics and dedup let through are judged; ``result`` counts them and the judge's attempts.
    """
    reasons, signatures = _screen_partition(part, day, config, history)
    to_judge = [i for i, r in enumerate(reasons) if r is None]
    verdicts = gate_judge.judge_many([(part.at[i, "prompt"], part.at[i, "response"]) for i in to_judge], tick)
    result.judged += len(to_judge)
    result.judge_attempts += sum(v.attempts for v in verdicts)
    by_row: dict[int, Verdict] = dict(zip(to_judge, verdicts, strict=True))
    for i, v in by_row.items():
        if v.error is not None or v.score is None:
            reasons[i] = f"judge_error: {v.error}"
        elif v.score < config.judge.min_score:
            reasons[i] = f"judge_low_score: {v.score:.2f} < {config.judge.min_score}"
    judged = part.assign(**_verdict_columns(len(part), by_row), reason=reasons)
    judged["judge_score"] = judged["judge_score"].astype("float64")
    judged["judge_confidence"] = judged["judge_confidence"].astype("float64")
    if config.dedup.enabled:
        kept = [i for i, r in enumerate(reasons) if r is None]
        for i in kept:
            history.add(part.at[i, "sample_id"], day, *signatures[i])
        if dedup_root:
            exact = {part.at[i, "sample_id"]: signatures[i][0] for i in kept}
            save_partition(history, dedup_root, day, [part.at[i, "sample_id"] for i in kept], exact)
    return judged


def _screen_partition(
    part: pd.DataFrame, day: str, config: GateConfig, history: DedupIndex
) -> tuple[list[str | None], dict[int, tuple[str, object]]]:
    """The cheap checks before the judge: each row's heuristic or duplicate reason (None: passed both), and the
    dedup signatures of the rows that passed (by row), duplicates found in ``history`` or earlier in ``part``."""
    reasons: list[str | None] = []
    signatures: dict[int, tuple[str, object]] = {}
    within = DedupIndex(history.settings)
    for i, row in enumerate(part.itertuples(index=False)):
        error = row.error if isinstance(row.error, str) else None
        reason = heuristic_reason(row.prompt, row.response, error, config, int(row.completion_tokens))
        if reason is None and config.dedup.enabled:
            exact, mh = history.signature(row.response)
            dup = history.find(exact, mh) or within.find(exact, mh)
            if dup is not None:
                reason = dup.reason()
            else:
                within.add(row.sample_id, day, exact, mh)
                signatures[i] = (exact, mh)
        reasons.append(reason)
    return reasons, signatures


def _verdict_columns(rows: int, by_row: dict[int, Verdict]) -> dict[str, list[object]]:
    """The judge's columns (``GATE_COLUMNS``) for ``rows`` rows: a verdict's values, None where none was asked."""
    columns: dict[str, list[object]] = {c: [] for c in GATE_COLUMNS}
    for i in range(rows):
        v = by_row.get(i)
        columns["judge_score"].append(v.score if v else None)
        columns["judge_method"].append(v.method if v else None)
        columns["judge_rationale"].append(v.rationale if v else None)
        columns["judge_confidence"].append(v.confidence if v else None)
    return columns


def _filtered_and_rejected(
    samples: pd.DataFrame, judged_frames: list[pd.DataFrame]
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The gated partitions split into kept rows (without ``reason``) and rejected ones; with no partition, both
    empty with the gate's columns typed as a gated frame has them."""
    if judged_frames:
        judged = pd.concat(judged_frames, ignore_index=True)
        keep = judged["reason"].isna()
        return judged[keep].drop(columns=["reason"]).reset_index(drop=True), judged[~keep].reset_index(
            drop=True
        )
    empty = samples.assign(
        **{
            c: pd.Series(dtype="float64" if c in ("judge_score", "judge_confidence") else "object")
            for c in GATE_COLUMNS
        }
    )
    return empty.reset_index(drop=True), empty.assign(reason=pd.Series(dtype="object")).reset_index(drop=True)
