"""Training inputs are checked against the frozen eval set and the benchmark items before they are packed: a planted
eval example (another id, the same text) is removed and counted, a benchmark item planted in the corpus is caught,
a clean day passes untouched, and a night checks only its new day."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
from support.packaging_inputs import TEACHER_TEMPLATE, teacher_rows

from nexa_dagster.core.common.config import BenchmarkSettings
from nexa_dagster.core.data.contamination import ContaminationIndex, ProtectedItem, normalise
from nexa_dagster.core.distill.teacher import render
from nexa_dagster.core.evaluation.eval_set import freeze_eval_set, load_eval_set
from nexa_dagster.core.evaluation.protected import benchmark_items, eval_set_items
from nexa_dagster.core.packaging.decontaminate import (
    chat_texts,
    decontaminate,
    document_texts,
    template_segments,
)
from nexa_dagster.core.packaging.pretrain_corpus import documents_to_jsonl
from nexa_dagster.core.packaging.sft_dataset import DayInput, samples_to_jsonl

WORDS = [
    "the",
    "compiler",
    "reads",
    "each",
    "statement",
    "of",
    "the",
    "module",
    "in",
    "order",
    "binds",
    "every",
    "name",
    "it",
    "meets",
    "and",
    "raises",
    "an",
    "error",
    "when",
    "a",
    "name",
    "is",
    "used",
    "before",
    "it",
    "is",
    "bound",
    "unless",
    "a",
    "global",
    "declaration",
    "says",
    "otherwise",
]


def _document(k: int) -> str:
    """A distinct 33-word text: the same words, shifted by ``k`` (no 13-gram of one is in another)."""
    return " ".join(WORDS[(i * (k + 2)) % len(WORDS)] + str(k) for i in range(len(WORDS)))


def _samples(ids_and_docs: list[tuple[str, int]], day: str) -> pd.DataFrame:
    return teacher_rows(
        ids_and_docs,
        day,
        _document,
        response=lambda k: f"an answer about {_document(k).split()[k]} number {k}",
    )


def test_a_planted_eval_example_is_removed_before_packing_and_a_clean_day_is_untouched(
    tmp_path: Path, tiny_tokenizer
) -> None:
    eval_samples = _samples([(f"held-{k}", k) for k in range(3)], "2026-11-01")
    freeze_eval_set(
        eval_samples,
        tiny_tokenizer,
        str(tmp_path / "eval_sets"),
        1,
        fraction=0.999999,
        max_tokens=512,
        log=lambda _: None,
    )
    manifest = load_eval_set(str(tmp_path / "eval_sets"), 1)
    index = ContaminationIndex.build(eval_set_items(manifest, template_segments(TEACHER_TEMPLATE)))
    texts = chat_texts(template_segments(TEACHER_TEMPLATE))
    out = str(tmp_path / "sft")
    clean = DayInput(
        ("2026-11-02",), samples_to_jsonl(_samples([("a", 10), ("b", 11)], "2026-11-02"), out), 2
    )
    # day 3 holds eval example held-1's document under another id and another title (a re-landed page)
    planted = DayInput(
        ("2026-11-03",), samples_to_jsonl(_samples([("c", 12), ("renamed", 1)], "2026-11-03"), out), 2
    )

    kept, report = decontaminate(
        [clean, planted], index, out, "remove", texts, "sample_id", log=lambda _: None
    )
    assert kept[0] == clean  # a clean day passes untouched: the same file
    assert report.contaminated_rows == report.removed_rows == 1 and report.rows_checked == 4
    assert report.examples[0]["id"] == "renamed" and report.examples[0]["matches"] == "eval_set v1 held-1"
    packed_ids = [json.loads(line)["sample_id"] for line in Path(kept[1].path).read_text().splitlines()]
    assert (
        packed_ids == ["c"] and kept[1].rows == 1 and report.items_hit == set()
    )  # nothing of it is trained on

    # the next night checks only its new day: the two earlier days come from their receipts, and the planted
    # day's cleaned copy is the one made before (named in its receipt): the night does not read that day again
    later = DayInput(("2026-11-04",), samples_to_jsonl(_samples([("d", 13)], "2026-11-04"), out), 1)
    planted_bytes = Path(planted.path).read_bytes()
    Path(planted.path).unlink()  # a read of it now would fail
    again, night = decontaminate(
        [clean, planted, later], index, out, "remove", texts, "sample_id", log=lambda _: None
    )
    assert (night.rows_checked, night.rows_checked_now, night.removed_rows) == (5, 1, 1)
    assert again[1].path == kept[1].path and again[2] == later
    Path(planted.path).write_bytes(planted_bytes)
    # with report, the row stays, is counted, and the item it holds is named
    _, reported = decontaminate([planted], index, out, "report", texts, "sample_id", log=lambda _: None)
    assert reported.removed_rows == 0 and [index.describe(i) for i in reported.items_hit] == [
        "eval_set v1 held-1"
    ]


def test_the_teacher_templates_own_words_are_not_evidence(tmp_path: Path) -> None:
    """Every prompt shares the template's words; with them left out, two prompts on different documents share
    no 13-gram (without the cut they would: the template alone is 25 words)."""
    segments = template_segments(TEACHER_TEMPLATE)
    mine, other = (render(TEACHER_TEMPLATE, title="t", text=_document(k)) for k in (1, 2))
    assert len(normalise(TEACHER_TEMPLATE)) > 13  # the template alone holds 13-grams
    assert ContaminationIndex.build([ProtectedItem("eval_set v1", "x", (mine,))]).hits([other])[0] == [0]
    assert (
        ContaminationIndex.build([ProtectedItem("eval_set v1", "x", tuple(segments(mine)))]).hits(
            segments(other)
        )[0]
        == []
    )


def test_a_benchmark_item_planted_in_the_corpus_is_caught(tmp_path: Path) -> None:
    settings = BenchmarkSettings(tasks=["nexa_stdlib_module"])
    items, unchecked = benchmark_items(settings)
    assert unchecked == [] and len(items) == 40
    index = ContaminationIndex.build(items)
    abc = next(
        i for i in items if i.item_id == "abc"
    )  # "Abstract Base Classes (ABCs) according to PEP 3119."
    docs = pd.DataFrame(
        {
            "doc_id": ["d1", "d2"],
            "day": ["2026-11-05"] * 2,
            "title": ["t1", "t2"],
            "text": [_document(3), f"Notes. {abc.texts[0]} And more text that follows it here."],
        }
    )
    out = str(tmp_path / "pretrain")
    day = DayInput(("2026-11-05",), documents_to_jsonl(docs, out), 2)
    kept, report = decontaminate([day], index, out, "remove", document_texts, "doc_id", log=lambda _: None)
    assert report.removed_rows == 1 and report.examples[0]["id"] == "d2"
    assert report.examples[0]["matches"] == "benchmark:nexa_stdlib_module abc"
    assert [json.loads(line)["doc_id"] for line in Path(kept[0].path).read_text().splitlines()] == ["d1"]
    # an item shorter than min_words (8) is too generic to check, and says so
    short = ContaminationIndex.build([ProtectedItem("benchmark:t", "csv", ("CSV parsing and writing.",))])
    assert short.unchecked == [0] and short.hits(["CSV parsing and writing."])[0] == []
