"""The frozen held-out RL prompts: written once, the same prompts on every read, a changed file refused, and an item
that is also a train row named."""

from __future__ import annotations

import json

import pytest

from nexa_dagster.core.evaluation.eval_set import EvalSetDamaged
from nexa_dagster.core.evaluation.rl_eval_set import (
    freeze_rl_eval_set,
    load_rl_eval_set,
    newest_prompts_path,
    overlap_problems,
    read_prompts,
)
from nexa_dagster.core.serving.live_quality import AnswerBook


def _item(i: int, topic: str) -> dict:
    return {
        "item_id": f"topic:doc{i:03d}",
        "doc_id": f"doc{i:03d}",
        "task": "topic",
        "prompt": f"Which Python reference topic is this passage from?\n\npassage {i}\n\nChoices: {topic}, x, y, z",
        "answer": topic,
        "reference": topic,
        "choices": [topic, "x", "y", "z"],
    }


HELD = [_item(i, "lambda") for i in range(5)]


def test_a_version_is_frozen_once_and_read_back_the_same(tmp_path) -> None:
    root = str(tmp_path / "rl_eval_sets")
    first = freeze_rl_eval_set(list(reversed(HELD)), root, 1, {"held_out_prompts": 5}, log=lambda _: None)
    assert first["prompts"] == 5 and first["tasks"] == {"topic": 5}
    assert [r["item_id"] for r in read_prompts(first)] == sorted(r["item_id"] for r in HELD)
    # more items later (a new day): version 1 stays what it was
    again = freeze_rl_eval_set(
        [*HELD, _item(9, "with")], root, 1, {"held_out_prompts": 6}, log=lambda _: None
    )
    assert again["content_sha256"] == first["content_sha256"] and again["prompts"] == 5
    assert read_prompts(again, limit=2) == read_prompts(first)[:2]


def test_a_changed_prompt_file_is_refused_naming_the_file(tmp_path) -> None:
    root = str(tmp_path / "rl_eval_sets")
    manifest = freeze_rl_eval_set(HELD, root, 1, {}, log=lambda _: None)
    with open(manifest["prompts_path"], "a", encoding="utf-8") as f:
        f.write(json.dumps(_item(7, "assert")) + "\n")
    with pytest.raises(EvalSetDamaged, match="prompts.jsonl changed since it was frozen"):
        load_rl_eval_set(root, 1)


def test_nothing_to_freeze_is_an_error_that_says_what_to_do(tmp_path) -> None:
    with pytest.raises(ValueError, match="no held-out item"):
        freeze_rl_eval_set([], str(tmp_path), 1, {}, log=lambda _: None)
    with pytest.raises(FileNotFoundError):
        load_rl_eval_set(str(tmp_path), 2)


def test_a_held_out_item_among_the_train_rows_is_named(tmp_path) -> None:
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(_item(i, "assert")) + "\n" for i in range(10, 14)))
    assert overlap_problems(HELD, str(train)) == []
    leaked = _item(2, "lambda")  # the same document and prompt as a held-out item
    train.write_text(train.read_text() + json.dumps(leaked) + "\n")
    problems = overlap_problems(HELD, str(train))
    assert "item_id on both sides: topic:doc002" in problems and "doc_id on both sides: doc002" in problems


def test_the_newest_frozen_version_is_the_answer_book_of_a_canary(tmp_path) -> None:
    root = str(tmp_path / "rl_eval_sets")
    assert newest_prompts_path(root) is None  # nothing frozen: no checkable prompts
    freeze_rl_eval_set(HELD, root, 1, {}, log=lambda _: None)
    freeze_rl_eval_set(HELD + [_item(9, "yield")], root, 2, {}, log=lambda _: None)
    path = newest_prompts_path(root)
    assert path is not None and path.endswith("v2/prompts.jsonl")
    book = AnswerBook.load(path)
    assert len(book) == 6 and book.answer_for(_item(9, "yield")["prompt"]) == "yield"
    with open(path, "a") as f:  # a changed file is refused, not scored against
        f.write("{}\n")
    with pytest.raises(EvalSetDamaged):
        newest_prompts_path(root)
