"""Pandera schemas of every table that crosses a stage boundary.

They are plain pandera models (no Dagster here); ``nexa_dagster.assets.types`` turns them into Dagster types so
that a bad frame fails at the boundary with a message naming the column and the failing rows.
"""

from __future__ import annotations

import math

import pandas as pd
import pandera.pandas as pa
from pandera.typing import Series

DAY_REGEX = r"^\d{4}-\d{2}-\d{2}$"


class RawDocuments(pa.DataFrameModel):
    """One row per ingested document of a day (the same document landed on two days is a row on each: a frame of
    a partition range holds both, so a doc_id is unique within its day, not across days)."""

    doc_id: Series[str] = pa.Field(str_length={"min_value": 16, "max_value": 16})
    day: Series[str] = pa.Field(str_matches=DAY_REGEX)
    source: Series[str] = pa.Field(str_length={"min_value": 1})
    title: Series[str]
    text: Series[str] = pa.Field(str_length={"min_value": 1})
    n_chars: Series[int] = pa.Field(ge=1)

    class Config:
        strict = True
        coerce = True
        unique = ["day", "doc_id"]


class TeacherSamples(pa.DataFrameModel):
    """One row per (document, generation): the teacher's answer and what it cost."""

    sample_id: Series[str] = pa.Field(unique=True)
    doc_id: Series[str]
    day: Series[str] = pa.Field(str_matches=DAY_REGEX)
    generation_index: Series[int] = pa.Field(ge=0)
    system_prompt: Series[str]
    prompt: Series[str] = pa.Field(str_length={"min_value": 1})
    response: Series[str]
    reasoning: Series[str] = pa.Field(nullable=True)
    model: Series[str] = pa.Field(str_length={"min_value": 1})
    prompt_tokens: Series[int] = pa.Field(ge=0)
    completion_tokens: Series[int] = pa.Field(ge=0)
    latency_s: Series[float] = pa.Field(ge=0)
    finish_reason: Series[str] = pa.Field(nullable=True)
    error: Series[str] = pa.Field(nullable=True)

    class Config:
        strict = True
        coerce = True


class FilteredSamples(TeacherSamples):
    """Samples that passed SampleGate, with the judge's verdict (rationale: json_schema/text judges; confidence:
    logprobs judges)."""

    judge_score: Series[float] = pa.Field(ge=1, le=5)
    judge_method: Series[str] = pa.Field(isin=["json_schema", "logprobs", "text"])
    judge_rationale: Series[str] = pa.Field(nullable=True)
    judge_confidence: Series[float] = pa.Field(nullable=True, ge=0, le=1)


class RejectedSamples(TeacherSamples):
    """Samples SampleGate turned away; ``reason`` says which rule (or the judge) did it."""

    judge_score: Series[float] = pa.Field(nullable=True)
    judge_method: Series[str] = pa.Field(nullable=True)
    judge_rationale: Series[str] = pa.Field(nullable=True)
    judge_confidence: Series[float] = pa.Field(nullable=True, ge=0, le=1)
    reason: Series[str] = pa.Field(str_length={"min_value": 1})


class PreferencePairs(pa.DataFrameModel):
    """``preference_pairs``: one pair per prompt that gave one, TRL's conversational columns plus how it was made."""

    pair_id: Series[str] = pa.Field(unique=True)
    sample_id: Series[str]
    day: Series[str] = pa.Field(str_matches=DAY_REGEX)
    prompt: Series[object]  # [{"role", "content"}, ...]: system (if any) and user
    chosen: Series[object]  # [{"role": "assistant", "content"}]
    rejected: Series[object]
    chosen_score: Series[
        float
    ]  # the judge's 1-5, or a reward (judge_model "reward:<name>"): _scores_in_range
    rejected_score: Series[float]
    score_gap: Series[float] = pa.Field(ge=0)
    chosen_source: Series[str]  # teacher | policy:<generation index>
    rejected_source: Series[str]
    chosen_length: Series[int] = pa.Field(ge=1)
    rejected_length: Series[int] = pa.Field(ge=0)
    judge_model: Series[str] = pa.Field(str_length={"min_value": 1})  # the judge's model id, or reward:<name>
    policy_model: Series[str] = pa.Field(str_length={"min_value": 1})

    @pa.dataframe_check
    def _scores_in_range(cls, df: pd.DataFrame) -> pd.Series:
        """Both scores finite; a judge's on its 1-5 scale (a reward's scale is its own: pairs ranked by a
        verifiable reward, ``preference.rank_by: reward``)."""
        scores = df[["chosen_score", "rejected_score"]].astype(float)
        finite = scores.apply(lambda c: c.map(math.isfinite)).all(axis=1)
        judged = ~df["judge_model"].astype(str).str.startswith("reward:")
        return finite & (~judged | ((scores >= 1) & (scores <= 5)).all(axis=1))

    class Config:
        strict = True
        coerce = True


class PackedSequences(pa.DataFrameModel):
    """Fixed-length packed training sequences (lists stored as Parquet list columns)."""

    input_ids: Series[object]
    loss_mask: Series[object]
    position_ids: Series[object]
    attention_mask: Series[object]
    cu_seqlens: Series[object]
    num_documents: Series[int] = pa.Field(ge=1)
    num_tokens: Series[int] = pa.Field(ge=1)
    num_loss_tokens: Series[int] = pa.Field(ge=0)
    labels: Series[object] | None  # since packed-sft-parquet/3 (Hugging Face -100 convention)

    @pa.dataframe_check
    def sequences_have_pack_size(cls, df):  # noqa: N805 - pandera passes the class
        lengths = df["input_ids"].map(len)
        same = (lengths == df["loss_mask"].map(len)) & (lengths == df["position_ids"].map(len))
        if "labels" in df.columns:
            same &= lengths == df["labels"].map(len)
        return same & (lengths == lengths.iloc[0] if len(df) else True)


class Leaderboard(pa.DataFrameModel):
    checkpoint_id: Series[str] = pa.Field(unique=True)
    eval_set_version: Series[pd.Int64Dtype] = pa.Field(
        nullable=True, coerce=True
    )  # rows of one version compare
    eval_loss: Series[float] = pa.Field(nullable=True)
    perplexity: Series[float] = pa.Field(ge=1)
    judge_score: Series[float] = pa.Field(nullable=True)
