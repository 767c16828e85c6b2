"""Scoring a live answer for a canary: the verifiable reward on a prompt of the answer book, the judge's score on
the others, nothing (not a zero) when the exchange cannot be read or nothing can score it; and the scorer's queue,
which drops rather than grows when it falls behind."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from nexa_dagster.core.distill.judge import Verdict
from nexa_dagster.core.serving.live_quality import (
    AnswerBook,
    AnswerBookError,
    LiveQualityScorer,
    LiveScore,
    read_exchange,
    score_exchange,
)
from nexa_dagster.core.serving.request_log import Exchange

PROMPT = "Which reference topic is this passage from? ... Choices: json, os.path, data model"


def chat(prompt: Any, answer: str) -> Exchange:
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    return Exchange(
        json.dumps({"model": "nexa-moe", "messages": messages}).encode(),
        json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}]}).encode(),
    )


@pytest.fixture
def book(tmp_path: Path) -> AnswerBook:
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": PROMPT, "answer": "os.path", "task": "topic"},
        {"prompt": "Next words: a b", "answer": "c d"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return AnswerBook.load(path)


class RecordingJudge:
    """A judge with a fixed score that records what it was shown (the real one is tested in core/distill)."""

    def __init__(self, score: float | None = 4.0, delay: threading.Event | None = None) -> None:
        self.score, self.seen, self.delay = score, [], delay

    def judge_many(self, items: list[tuple[str, str]]) -> list[Verdict]:
        if self.delay is not None:
            self.delay.wait(10)
        self.seen.extend(items)
        return [Verdict(self.score, "text") for _ in items]


def test_a_checkable_prompt_gets_the_verifiable_reward_whatever_the_spacing_or_case(book: AnswerBook) -> None:
    assert score_exchange(chat(PROMPT, "os.path"), book) == LiveScore(1.0, "reward")
    assert score_exchange(chat("  " + PROMPT.upper(), "`os.path`."), book) == LiveScore(1.0, "reward")
    assert score_exchange(chat(PROMPT, "json"), book) == LiveScore(0.0, "reward")
    # listing every choice is not an answer (the RL reward's own rule)
    assert score_exchange(chat(PROMPT, "os.path, json, data model, and many more modules"), book).value == 0.0
    # a chat with a system turn: the user turns are the prompt
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    assert score_exchange(chat(system, "os.path"), book) == LiveScore(1.0, "reward")


def test_other_prompts_go_to_the_judge_blind_and_are_unscored_without_one(book: AnswerBook) -> None:
    judge = RecordingJudge(score=4.0)
    assert score_exchange(chat("Tell me about modules", "Modules group code."), book) is None
    assert score_exchange(chat("Tell me about modules", "Modules group code."), book, judge) == LiveScore(
        0.75, "judge"
    )
    assert judge.seen == [("Tell me about modules", "Modules group code.")]  # no backend, no model name
    # an empty answer or an echo of the question scores 0 without asking (judge_score's rule)
    assert score_exchange(
        chat("Tell me about the import system", "tell me about the import system"), None, judge
    ) == (LiveScore(0.0, "judge"))
    assert len(judge.seen) == 1
    # no verdict from the judge: 0, as the RL reward counts it
    assert score_exchange(chat("Tell me", "Something."), None, RecordingJudge(score=None)) == LiveScore(
        0.0, "judge"
    )


@pytest.mark.parametrize(
    "exchange",
    [
        Exchange(
            b'{"messages": [{"role": "user", "content": "q"}]}', b'{"choices": [{"message": {"cont'
        ),  # cut
        Exchange(b"not json", b'{"choices": [{"text": "a"}]}'),
        Exchange(b'{"messages": []}', b'{"choices": []}'),
        Exchange(b'{"messages": []}', b'{"error": {"message": "overloaded"}}'),
    ],
)
def test_an_exchange_that_cannot_be_read_is_not_scored(exchange: Exchange, book: AnswerBook) -> None:
    assert read_exchange(exchange) is None
    assert score_exchange(exchange, book, RecordingJudge()) is None


def test_an_open_question_of_the_book_is_scored_by_reference_f1(tmp_path: Path) -> None:
    path = tmp_path / "open.jsonl"
    row = {"prompt": "What is the capital of France?", "reward": "reference_f1", "reference": "It is Paris."}
    path.write_text(json.dumps(row) + "\n")
    book = AnswerBook.load(path)
    assert score_exchange(chat(row["prompt"], "It is Paris."), book) == LiveScore(1.0, "reward")
    partly = score_exchange(chat(row["prompt"], "The answer is: Paris"), book)
    assert partly is not None and 0 < partly.value < 1  # word bigrams: order counts, a bag of words would not
    path.write_text(json.dumps({**row, "reward": "bleu"}) + "\n")
    with pytest.raises(AnswerBookError, match=r"line 1: .*KeyError 'bleu'"):
        AnswerBook.load(path)


def test_a_completions_request_is_read_too(book: AnswerBook) -> None:
    exchange = Exchange(json.dumps({"prompt": PROMPT}).encode(), b'{"choices": [{"text": " os.path"}]}')
    assert score_exchange(exchange, book) == LiveScore(1.0, "reward")


def test_a_bad_answer_book_is_named_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "book.jsonl"
    path.write_text('{"prompt": "a", "answer": "b"}\n{"prompt": "c"}\n')
    with pytest.raises(
        AnswerBookError, match=r"book.jsonl line 2: not a JSON object with 'prompt' and 'answer'"
    ):
        AnswerBook.load(path)
    path.write_text("\n")
    with pytest.raises(AnswerBookError, match="no rows"):
        AnswerBook.load(path)
    with pytest.raises(AnswerBookError, match="cannot be read"):
        AnswerBook.load(tmp_path / "missing.jsonl")


def test_the_scorer_drops_and_counts_when_it_falls_behind_instead_of_growing(book: AnswerBook) -> None:
    release = threading.Event()
    scores: list[tuple[str, LiveScore]] = []
    scorer = LiveQualityScorer(
        lambda arm, s: scores.append((arm, s)), book, RecordingJudge(delay=release), max_pending=4
    ).start()
    try:
        free = chat("Tell me about modules", "Modules group code.")
        accepted = [scorer.submit("canary" if i % 2 else "stable", free) for i in range(20)]
        # one in the judge's hands, four queued: the rest dropped, not queued
        assert 4 <= sum(accepted) <= 5 and scorer.counts["dropped"] == 20 - sum(accepted)
        release.set()
        scorer.drain()
        assert len(scores) == sum(accepted) and scorer.counts["stable judge"] + scorer.counts[
            "canary judge"
        ] == len(scores)
        scorer.submit("stable", chat(PROMPT, "os.path"))
        scorer.submit("stable", Exchange(b"cut", b"cut"))
        scorer.drain()
        assert scores[-1] == ("stable", LiveScore(1.0, "reward")) and scorer.counts["unscored"] == 1
    finally:
        scorer.stop()
