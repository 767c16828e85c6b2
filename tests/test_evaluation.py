"""Evaluation of a checkpoint from a notebook, no Dagster: held-out loss, judged answers, win rate, progress."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from openai_stub import chat_payload, stub_server

from nexa_dagster.core.config import read_text
from nexa_dagster.core.evaluation import evaluate_checkpoint, pairwise_win_rate
from nexa_dagster.core.llm.local import LocalTransformersClient
from nexa_dagster.core.llm.openai_compat import OpenAICompatibleClient
from nexa_dagster.core.sft_dataset import build_sft_dataset

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def test_a_checkpoint_is_evaluated(tiny_model_dir: Path, tiny_tokenizer, tmp_path: Path) -> None:
    """The tiny model as student and judge: a finite loss over the validation split's loss tokens, one judged
    answer per prompt, progress in the log. (The win rate is tested below against a judge whose preference is
    known: against an identical model it is 0.5 by construction and says nothing.)"""
    n = 24
    samples = pd.DataFrame({"sample_id": [f"id{i:03d}" for i in range(n)], "day": ["2026-11-20"] * n,
                            "system_prompt": ["Be brief."] * n, "prompt": [f"What is {i} + 1?" for i in range(n)],
                            "response": [f"It is {i + 1}." for i in range(n)]})
    dataset, _ = build_sft_dataset(samples, tiny_tokenizer, str(tiny_model_dir), str(tmp_path), 128, 0.2,
                                   log=lambda m: None)
    lines: list[str] = []
    prompts = ["What is a tuple?", "Name a prime number."]
    with LocalTransformersClient(str(tiny_model_dir)) as judge:
        evaluation = evaluate_checkpoint("ckpt-test", str(tiny_model_dir), dataset.validation_path, prompts, judge,
                                         read_text("prompts/judge.jinja"), max_new_tokens=8, log=lines.append)
    loss = evaluation.result.loss
    assert math.isfinite(loss.loss) and loss.perplexity > 1 and loss.tokens > 0
    assert loss.sequences == dataset.num_validation_sequences
    assert [a.prompt for a in evaluation.result.answers] == prompts
    assert evaluation.win_rate_vs_production is None  # no production model given
    assert any(line.startswith("ckpt-test: validation sequences scored: ") for line in lines), lines
    assert any(line.startswith("ckpt-test: held-out answers judged: 2/2 ") for line in lines), lines


QUESTIONS = [f"What is {i} + 1?" for i in range(4)]
# the candidate is right on the first three questions, production only on the last
CANDIDATE = ["It is 1.", "It is 2.", "It is 3.", "It is 7."]
PRODUCTION = ["It is 5.", "It is 6.", "It is 9.", "It is 4."]


def _arithmetic_judge(logprobs: bool, p_right: float = 0.9):
    """A judge whose preference is fixed by construction: it works the sum out and prefers the right answer,
    by its letter (text) or with probability ``p_right`` (logprobs), in whichever position it is."""
    def reply(n: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if body.get("response_format"):
            return 400, {"error": {"message": "response_format is not supported"}}
        if body.get("logprobs") and not logprobs:
            return 400, {"error": {"message": "logprobs is not supported"}}
        prompt = body["messages"][-1]["content"]
        found = re.search(r"What is (\d+) \+ 1\?.*ANSWER A:\s*(.*?)\s*ANSWER B:\s*(.*?)\s*Better", prompt, re.S)
        right = "A" if found and f"It is {int(found.group(1)) + 1}." == found.group(2) else "B"
        if not logprobs:
            return 200, chat_payload(right)
        wrong = "B" if right == "A" else "A"
        top = [{"token": right, "logprob": math.log(p_right), "bytes": None},
               {"token": wrong, "logprob": math.log(1 - p_right), "bytes": None}]
        return 200, chat_payload(right, {"content": [{"token": right, "logprob": math.log(p_right), "bytes": None,
                                                      "top_logprobs": top[: body.get("top_logprobs", 0)]}]})
    return reply


@pytest.mark.parametrize(("logprobs", "expected"), [(False, 0.75), (True, (3 * 0.9 + 0.1) / 4)],
                         ids=["text", "logprobs"])
def test_the_win_rate_is_the_judges_known_preference(logprobs: bool, expected: float) -> None:
    """Right on 3 of 4 questions where production is right on 1: a judge that prefers the right answer gives the
    candidate 0.75 (votes) or the mean of its probabilities, and production the rest, in both orders."""
    with stub_server(_arithmetic_judge(logprobs)) as (url, calls, _), \
            OpenAICompatibleClient(url, model="stub", backoff_s=0.01) as judge:
        assert judge.capabilities().logprobs is logprobs
        assert pairwise_win_rate(judge, QUESTIONS, CANDIDATE, PRODUCTION) == pytest.approx(expected)
        assert pairwise_win_rate(judge, QUESTIONS, PRODUCTION, CANDIDATE) == pytest.approx(1 - expected)
        asked = [c for c in calls if "Better answer" in c["messages"][-1]["content"]]
        assert len(asked) == 2 * 2 * len(QUESTIONS)  # every pair in both orders, for both calls
