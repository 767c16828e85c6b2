"""Checkable RL tasks from the project's own documents: train and held-out apart, no benchmark or eval item trained
on, and every answer checkable from the prompt's own content."""

from __future__ import annotations

import hashlib

import pytest

from nexa_dagster.core.common.config import BenchmarkSettings, RLTaskSettings
from nexa_dagster.core.data.contamination import ContaminationIndex, ProtectedItem
from nexa_dagster.core.data.sample_corpus import _topics
from nexa_dagster.core.evaluation.protected import benchmark_items
from nexa_dagster.core.rl.tasks import (
    NEXT_WORDS,
    TOPIC,
    build_tasks,
    held_out,
    normalise_words,
    write_task_rows,
)

SETTINGS = RLTaskSettings(tasks=[TOPIC, NEXT_WORDS])


@pytest.fixture(scope="module")
def documents() -> list[dict[str, str]]:
    """The sample corpus's documents as ingest gives them (the demo's data): a doc id, a title, a text."""
    return [
        {"doc_id": hashlib.sha256(title.encode()).hexdigest()[:16], "title": title, "text": text}
        for title, text in _topics()
    ]


@pytest.fixture(scope="module")
def benchmark_index() -> ContaminationIndex:
    items, missing = benchmark_items(
        BenchmarkSettings(
            tasks=["nexa_stdlib_module", "nexa_docstring_completion"], include_path=["configs/benchmarks"]
        )
    )
    assert not missing and len(items) == 80
    return ContaminationIndex.build(items, n=13, min_words=8)


def test_train_and_held_out_share_no_document_or_prompt_and_the_split_is_stable(documents) -> None:
    build = build_tasks(documents, SETTINGS, None)
    assert build.train and build.held_out
    assert not {r["doc_id"] for r in build.train} & {r["doc_id"] for r in build.held_out}
    assert not {r["prompt"] for r in build.train} & {r["prompt"] for r in build.held_out}
    share = len({r["doc_id"] for r in build.held_out}) / len(
        {r["doc_id"] for r in build.train + build.held_out}
    )
    assert 0.2 < share < 0.3  # held_out_fraction (0.25) of the documents, by a hash of their id
    again = build_tasks(
        list(reversed(documents)), SETTINGS, None
    )  # another order, another run: the same items
    assert again.train == build.train and again.held_out == build.held_out


def test_a_passage_repeated_word_for_word_under_two_topics_is_never_a_prompt(documents) -> None:
    twin = {**documents[0], "doc_id": "f" * 16, "title": "lambda (part 9)"}  # the same text, another answer
    build = build_tasks([*documents, twin], RLTaskSettings(tasks=[TOPIC]), None)
    passages = [r["prompt"].split("\n\n")[1] for r in build.train + build.held_out]
    assert " ".join(documents[0]["text"].split()[:40]) not in passages
    assert build.skipped["prompt repeated with another answer or on the other side"] >= 2


def test_items_sharing_text_with_a_protected_item_are_left_out_and_named(documents, benchmark_index) -> None:
    victim = next(d for d in documents[10:] if len(d["text"].split()) > 80)  # long enough for both tasks
    protected = ProtectedItem("eval_set v1", "s-1", (" ".join(victim["text"].split()[:20]),))
    index = ContaminationIndex.build([protected], n=13, min_words=8)
    build = build_tasks(documents, SETTINGS, index)
    kept = {r["doc_id"] for r in build.train + build.held_out}
    assert victim["doc_id"] not in kept
    assert {c["item_id"] for c in build.contaminated} == {
        f"{TOPIC}:{victim['doc_id']}",
        f"{NEXT_WORDS}:{victim['doc_id']}",
    }
    assert all(c["protected"] == "eval_set v1 s-1" and c["shared"] for c in build.contaminated)
    # against the lm-eval benchmark items (CPython's module docstrings): whatever is kept shares no 13-gram with them
    clean = build_tasks(documents, SETTINGS, benchmark_index)
    for row in clean.train + clean.held_out:
        assert benchmark_index.hits([row["prompt"], row["answer"]])[0] == []


def test_a_held_out_item_quoting_a_protected_item_stays_held_out(documents) -> None:
    """A held-out item is never trained on, so quoting the eval set there harms nothing: it stays (leaving such items
    out shrank the RL eval set frozen on make run's first night from 125 to 93 prompts, issue 47.6)."""
    victim = next(d for d in documents if held_out(d["doc_id"], SETTINGS) and len(d["text"].split()) > 80)
    protected = ProtectedItem("eval_set v1", "s-1", (" ".join(victim["text"].split()[:20]),))
    build = build_tasks(documents, SETTINGS, ContaminationIndex.build([protected], n=13, min_words=8))
    assert {f"{TOPIC}:{victim['doc_id']}", f"{NEXT_WORDS}:{victim['doc_id']}"} <= {
        r["item_id"] for r in build.held_out
    }
    assert build.contaminated == []


def test_a_benchmark_item_planted_in_a_document_is_never_trained_on(documents, benchmark_index) -> None:
    planted = dict(documents[3])  # a document quoting a benchmark item's docstring (it could be ingested)
    planted["text"] = (
        "Base16, Base32, Base64 (RFC 3548), Base85 and Ascii85 data encodings, as the module's docstring says: "
        + planted["text"]
    )
    build = build_tasks([planted, *documents[4:]], RLTaskSettings(tasks=[TOPIC]), benchmark_index)
    assert planted["doc_id"] not in {r["doc_id"] for r in build.train + build.held_out}
    assert build.contaminated and build.contaminated[0]["protected"].startswith("benchmark:nexa_")


def test_every_answer_is_checkable_from_the_prompt_and_the_document(documents) -> None:
    build = build_tasks(documents, SETTINGS, None)
    texts = {d["doc_id"]: d["text"] for d in documents}
    for row in build.train + build.held_out:
        assert row["reference"] == row["answer"] and row["item_id"] == f"{row['task']}:{row['doc_id']}"
        if row["task"] == TOPIC:
            choices = row["choices"]
            assert len(choices) == SETTINGS.choices and len(set(choices)) == len(choices)
            assert row["answer"] in choices and f"Choices: {', '.join(choices)}" in row["prompt"]
        else:
            passage = row["prompt"].split("\n\n", 1)[1]
            assert " ".join(texts[row["doc_id"]].split()).startswith(f"{passage} {row['answer']}")
            assert len(normalise_words(row["answer"])) >= SETTINGS.next_words


def test_the_answer_is_in_every_position_about_equally_often(documents) -> None:
    """Always naming the first choice (a policy's cheapest trick) must score chance, not more."""
    rows = [r for r in build_tasks(documents, SETTINGS, None).train if r["task"] == TOPIC]
    first = sum(r["choices"][0] == r["answer"] for r in rows) / len(rows)
    assert abs(first - 1 / SETTINGS.choices) < 0.08


def test_task_rows_are_written_once_content_addressed(documents, tmp_path) -> None:
    build = build_tasks(documents, RLTaskSettings(), None)
    run_hash, train, held = write_task_rows(build, str(tmp_path))
    assert write_task_rows(build, str(tmp_path)) == (run_hash, train, held)
    with open(train) as t, open(held) as h:
        assert sum(1 for _ in t) == len(build.train) and sum(1 for _ in h) == len(build.held_out)
