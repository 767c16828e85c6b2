"""SampleGate: each heuristic rule with its reason code, and the judge's score from real log-probabilities."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from nexa_dagster.core.config import load_filters, read_text
from nexa_dagster.core.sample_gate import apply_sample_gate, heuristic_reason, repeat_ngram_ratio

PROD = load_filters("filters.production.yaml")


@pytest.mark.parametrize(("response", "error", "code"), [
    ("", None, "too_short"),
    ("x" * 30000, None, "too_long"),
    ("the cat sat on the mat " * 40, None, "repetition"),
    ("".join(f"word{i}\x00\x01 " for i in range(40)), None, "non_printable"),
    ("As an AI language model, I think this is a fine explanation of the topic at hand.", None, "refusal"),
    ("ignored", "HTTP 500 from http://x/v1", "teacher_error"),
])
def test_heuristics_name_the_rule(response: str, error: str | None, code: str) -> None:
    reason = heuristic_reason("Explain the documented feature in detail please.", response, error, PROD)
    assert reason is not None and reason.startswith(code)


def test_prompt_echo_is_caught() -> None:
    prompt = "The with statement is used to wrap the execution of a block with methods defined by a context manager."
    assert heuristic_reason(prompt, prompt, None, PROD).startswith("prompt_echo")


def test_a_good_answer_passes_the_heuristics() -> None:
    answer = ("A context manager sets something up before a block runs and tears it down after, even when the "
              "block raises. Example: `with open(path) as f: data = f.read()` closes the file for you.")
    assert heuristic_reason("Explain the with statement.", answer, None, PROD) is None
    assert repeat_ngram_ratio(answer, 4) == 0.0


def _teacher_frame(responses: list[str]) -> pd.DataFrame:
    n = len(responses)
    return pd.DataFrame({
        "sample_id": [f"s{i}" for i in range(n)], "doc_id": ["d"] * n, "day": ["2026-11-20"] * n,
        "generation_index": [0] * n, "system_prompt": [""] * n, "prompt": ["Explain lists."] * n,
        "response": responses, "reasoning": [None] * n, "model": ["m"] * n, "prompt_tokens": [3] * n,
        "completion_tokens": [5] * n, "latency_s": [0.1] * n, "finish_reason": ["stop"] * n, "error": [None] * n,
    })


def test_gate_with_a_real_local_judge_gives_valid_scores(tiny_model_dir: Path) -> None:
    from nexa_dagster.core.llm.local import LocalTransformersClient
    from nexa_dagster.core.schemas import FilteredSamples, RejectedSamples

    frame = _teacher_frame(["A list is a mutable sequence; append adds an item at the end.", "", "ok " * 50])
    with LocalTransformersClient(str(tiny_model_dir)) as judge:
        filtered, rejected = apply_sample_gate(frame, load_filters(), judge, read_text("prompts/judge.jinja"))
    assert len(filtered) + len(rejected) == 3
    FilteredSamples.validate(filtered)
    RejectedSamples.validate(rejected)
    assert set(rejected["sample_id"]) >= {"s1", "s2"}  # empty and repetitive
    judged = pd.concat([filtered, rejected])
    judged = judged[judged["judge_method"].notna()]
    assert (judged["judge_method"] == "logprobs").all()
    assert judged["judge_score"].between(1, 5).all()
