"""SampleGate: each heuristic rule with its reason code, dedup within and across partitions, strict verdict
parsing, and the judge's score from real log-probabilities."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from nexa_dagster.core.common.config import read_text
from nexa_dagster.core.distill.sample_gate import (
    apply_sample_gate,
    heuristic_reason,
    load_gate_config,
    repeat_ngram_ratio,
)

PROD = load_gate_config("filters.production.yaml")
DEMO = load_gate_config("filters.yaml")


@pytest.mark.parametrize(
    ("response", "error", "code"),
    [
        ("", None, "too_short"),
        ("x" * 30000, None, "too_long"),
        ("the cat sat on the mat " * 40, None, "repetition"),
        ("".join(f"word{i}\x00\x01 " for i in range(40)), None, "non_printable"),
        (
            "As an AI language model, I think this is a fine explanation of the topic at hand.",
            None,
            "refusal",
        ),
        (
            "A list keeps items in order and you can append to it. Hope this helps, and good luck with the code!",
            None,
            "boilerplate",
        ),
        ("{}[]()<>;;" * 5 + " x = 1 + 2; y = [3, 4] # 5 6 7 8 9 0 !! ?? ** // -- ++ ==", None, "non_letter"),
        ("ignored", "HTTP 500 from http://x/v1", "teacher_error"),
    ],
)
def test_heuristics_name_the_rule(response: str, error: str | None, code: str) -> None:
    reason = heuristic_reason("Explain the documented feature in detail please.", response, error, PROD)
    assert reason is not None and reason.startswith(code)


def test_prompt_echo_is_caught() -> None:
    prompt = "The with statement is used to wrap the execution of a block with methods defined by a context manager."
    assert heuristic_reason(prompt, prompt, None, PROD).startswith("prompt_echo")


def test_a_good_answer_passes_the_heuristics() -> None:
    answer = (
        "A context manager sets something up before a block runs and tears it down after, even when the "
        "block raises. Example: `with open(path) as f: data = f.read()` closes the file for you."
    )
    assert heuristic_reason("Explain the with statement.", answer, None, PROD) is None
    assert repeat_ngram_ratio(answer, 4) == 0.0


def test_token_bounds_use_the_teachers_count() -> None:
    answer = "A tuple is an immutable sequence, a list a mutable one; both keep their items in order."
    assert heuristic_reason("Explain tuples.", answer, None, PROD, completion_tokens=5).startswith(
        "too_short"
    )
    assert heuristic_reason("Explain tuples.", answer, None, PROD, completion_tokens=5000).startswith(
        "too_long"
    )
    assert heuristic_reason("Explain tuples.", answer, None, PROD, completion_tokens=30) is None


def _teacher_frame(responses: list[str], day: str = "2026-11-20", prefix: str = "s") -> pd.DataFrame:
    n = len(responses)
    return pd.DataFrame(
        {
            "sample_id": [f"{prefix}{i}" for i in range(n)],
            "doc_id": ["d"] * n,
            "day": [day] * n,
            "generation_index": [0] * n,
            "system_prompt": [""] * n,
            "prompt": ["Explain lists."] * n,
            "response": responses,
            "reasoning": [None] * n,
            "model": ["m"] * n,
            "prompt_tokens": [3] * n,
            "completion_tokens": [5] * n,
            "latency_s": [0.1] * n,
            "finish_reason": ["stop"] * n,
            "error": [None] * n,
        }
    )


def test_gate_with_a_real_local_judge_gives_valid_scores(tiny_model_dir: Path) -> None:
    from nexa_dagster.core.data.schemas import FilteredSamples, RejectedSamples
    from nexa_dagster.core.llm.local import LocalTransformersClient

    frame = _teacher_frame(["A list is a mutable sequence; append adds an item at the end.", "", "ok " * 50])
    with LocalTransformersClient(str(tiny_model_dir)) as judge:
        result = apply_sample_gate(
            frame, DEMO, judge, read_text("prompts/judge.jinja"), read_text("prompts/judge_verdict.jinja")
        )
    filtered, rejected = result.filtered, result.rejected
    assert len(filtered) + len(rejected) == 3 and result.judge_method == "logprobs"
    FilteredSamples.validate(filtered)
    RejectedSamples.validate(rejected)
    assert set(rejected["sample_id"]) >= {"s1", "s2"}  # empty and repetitive
    judged = pd.concat([filtered, rejected])
    judged = judged[judged["judge_method"].notna()]
    assert (judged["judge_method"] == "logprobs").all()
    assert judged["judge_score"].between(1, 5).all()
    assert judged["judge_confidence"].between(0.2, 1).all()  # max of five renormalised probabilities


# -- strict verdicts -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"score": 4, "rationale": "Clear and correct."}', (4, "Clear and correct.")),
        ('```json\n{"score": 2, "rationale": "Off topic."}\n```', (2, "Off topic.")),
        ('{"score": 5.0, "rationale": ""}', (5, "")),
    ],
)
def test_a_well_formed_verdict_is_read(text: str, expected: tuple[int, str]) -> None:
    from nexa_dagster.core.distill.judge import parse_verdict

    assert parse_verdict(text) == expected


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("4", "not an object"),  # a bare number is JSON, but not a verdict
        ("Score: 4. Good answer.", "not a JSON object"),
        ('{"score": 6, "rationale": "x"}', "out of range"),
        ('{"score": 0, "rationale": "x"}', "out of range"),
        ('{"score": "4", "rationale": "x"}', "not an integer"),
        ('{"score": true, "rationale": "x"}', "not an integer"),
        ('{"score": 3.5, "rationale": "x"}', "not an integer"),
        ('{"score": 3}', "'rationale'"),
        ('{"score": 3, "rationale": "cut off mid', "not a JSON object"),
        ("hello world 5 stars", "not a JSON object"),
    ],
)
def test_an_unreadable_verdict_is_refused_with_the_reason(text: str, problem: str) -> None:
    from nexa_dagster.core.distill.judge import VerdictError, parse_verdict

    with pytest.raises(VerdictError, match=problem):
        parse_verdict(text)


# -- de-duplication ------------------------------------------------------------------------------------------------
BASE = (
    "A context manager sets something up before a block runs and tears it down after, even when the block "
    "raises an exception. Example: with open(path) as f: data = f.read() closes the file for you."
)
NEAR = BASE.replace("tears it down after", "tears it down afterwards")  # one word changed
OTHER = "A tuple is an immutable sequence; unlike a list it cannot be changed after creation, e.g. (1, 2)."
THIRD = (
    "The yield keyword turns a function into a generator that produces values lazily, one per next() call."
)


@pytest.fixture(scope="module")
def local_judge(tiny_model_dir: Path):
    from nexa_dagster.core.llm.local import LocalTransformersClient

    with LocalTransformersClient(str(tiny_model_dir)) as client:
        yield client


def _gate(frame: pd.DataFrame, judge, dedup_root: str | None = None):
    lenient = DEMO.model_copy(
        update={"judge": DEMO.judge.model_copy(update={"min_score": 1.0})}
    )  # judge passes all
    return apply_sample_gate(
        frame,
        lenient,
        judge,
        read_text("prompts/judge.jinja"),
        read_text("prompts/judge_verdict.jinja"),
        dedup_root,
    )


def test_exact_and_near_duplicates_within_a_partition(local_judge) -> None:
    from nexa_dagster.core.distill.dedup import DedupIndex, DedupSettings

    index = DedupIndex(DedupSettings())
    e1, m1 = index.signature(BASE)
    e2, m2 = index.signature(NEAR)
    assert 0.85 <= m1.jaccard(m2) < 1.0  # the near copy really is near, and not exact
    frame = _teacher_frame(
        [
            BASE,
            "  a CONTEXT manager sets something up, before a block runs and tears it down "
            "after even when the block raises an exception!! Example: with open(path) as f: "
            "data = f.read() closes the file for you",
            NEAR,
            OTHER,
        ]
    )
    result = _gate(frame, local_judge)
    assert list(result.filtered["sample_id"]) == ["s0", "s3"]
    reasons = dict(zip(result.rejected["sample_id"], result.rejected["reason"], strict=True))
    assert (
        reasons["s1"].startswith("exact_duplicate") and "sample s0" in reasons["s1"]
    )  # case, spaces, punctuation
    assert reasons["s2"].startswith("near_duplicate") and "sample s0" in reasons["s2"]
    assert result.judged == 2  # duplicates never reach the judge


def test_duplicates_of_earlier_partitions_but_not_of_rejected_samples(local_judge, tmp_path: Path) -> None:
    root = str(tmp_path / "dedup")
    day1 = _teacher_frame([BASE, "", OTHER * 30], day="2026-11-20", prefix="a")  # "" and a loop are rejected
    first = _gate(day1, local_judge, root)
    assert (
        list(first.filtered["sample_id"]) == ["a0"] and (tmp_path / "dedup" / "2026-11-20.parquet").exists()
    )
    day2 = _teacher_frame([NEAR, OTHER * 30, THIRD, "  " + BASE.upper()], day="2026-11-21", prefix="b")
    second = _gate(day2, local_judge, root)
    assert second.history_partitions == ["2026-11-20"]
    reasons = dict(zip(second.rejected["sample_id"], second.rejected["reason"], strict=True))
    assert reasons["b0"].startswith("near_duplicate") and "(partition 2026-11-20)" in reasons["b0"]
    assert reasons["b3"].startswith("exact_duplicate") and "sample a0" in reasons["b3"]
    assert reasons["b1"].startswith("repetition")  # a copy of a rejected sample is judged on its own merits
    assert list(second.filtered["sample_id"]) == ["b2"]
    # gating day 1 again (a re-materialization) never compares it with itself ...
    again = _gate(day1, local_judge, root)
    assert list(again.filtered["sample_id"]) == ["a0"] and again.history_partitions == []
    # ... and a two-day run (a single-run backfill) gates day 2 against day 1 the same way
    both = _gate(pd.concat([day1, day2], ignore_index=True), local_judge, str(tmp_path / "fresh"))
    assert sorted(both.filtered["sample_id"]) == ["a0", "b2"]
