"""The frozen held-out RL prompts are protected items across the lineage, as the eval set's examples are: once
``rl_eval_set`` froze a version, the index every training input is checked against (``contamination_index``, the
one ``pretrain_corpus``, ``base_model``, ``sft_dataset``, its ``checkable_tasks`` source and
``preference_dataset`` use) holds their passages, so a pretraining document, a day's teacher answer and a preference
pair that quote a held-out passage are left out before packing and named (the protected item, the row's id, the count per source).

The frozen set is what ``rl_eval_set`` writes (``freeze_rl_eval_set``) from the held-out side that ``build_tasks``
makes of the small landing days' documents; the index is the assets' own, built from the tiny preset's resources
on a fresh data root.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from support.landing_documents import landing_documents, landing_tasks, tiny_task_settings
from support.packaging_inputs import TEACHER_TEMPLATE, teacher_rows

from nexa_dagster.assets.packaging import contamination_index
from nexa_dagster.core.data.contamination import ContaminationIndex
from nexa_dagster.core.distill.teacher import render
from nexa_dagster.core.evaluation.rl_eval_set import freeze_rl_eval_set
from nexa_dagster.core.packaging.blend import ContaminationConfig
from nexa_dagster.core.packaging.decontaminate import (
    chat_texts,
    decontaminate,
    document_texts,
    template_segments,
)
from nexa_dagster.core.packaging.preference_dataset import pair_texts, pairs_to_jsonl
from nexa_dagster.core.packaging.pretrain_corpus import documents_to_jsonl
from nexa_dagster.core.packaging.sft_dataset import DayInput, samples_to_jsonl
from nexa_dagster.core.rl.tasks import build_tasks, document_text, held_out
from nexa_dagster.resources.configs import EvalSetsResource, PromptsResource
from nexa_dagster.resources.scale import ScaleResource
from nexa_dagster.resources.storage import StorageResource

DAY = "2026-11-23"


def _index(data: Path) -> ContaminationIndex:
    """What the packaging assets check their inputs against on this data root (the tiny preset's benchmarks, the
    eval set and the RL eval set where frozen)."""
    storage = StorageResource(data_root=str(data), results_root=str(data.parent / "results"))
    index, _ = contamination_index(
        storage,
        EvalSetsResource(),
        ScaleResource(name="tiny").load(),
        PromptsResource(),
        ContaminationConfig(),
    )
    return index


@pytest.fixture(scope="module")
def frozen(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, object]]]:
    """A data root with RL eval set v1 frozen as rl_eval_set freezes it (the tiny preset's eval_set_version)."""
    data = tmp_path_factory.mktemp("protected") / "data"
    held_out = landing_tasks().held_out
    version = ScaleResource(name="tiny").load().rl.eval_set_version  # type: ignore[union-attr]
    manifest = freeze_rl_eval_set(held_out, str(data / "rl_eval_sets"), version, {}, log=lambda _: None)
    prompts = [json.loads(line) for line in Path(manifest["prompts_path"]).read_text().splitlines()]
    return data, prompts


def test_a_held_out_passage_in_a_pretraining_document_a_teacher_answer_and_a_pair_is_left_out_and_named(
    frozen: tuple[Path, list[dict[str, object]]], tmp_path: Path
) -> None:
    data, prompts = frozen
    planted = prompts[0]
    passage = document_text(planted)
    index = _index(data)
    source = f"rl_eval_set v{ScaleResource(name='tiny').load().rl.eval_set_version}"  # type: ignore[union-attr]
    assert sum(s == source for s, _ in index.items) == len(prompts)  # every frozen prompt is protected

    # a pretraining day: a clean document and the held-out passage re-landed inside another page (another id)
    docs = pd.DataFrame(
        {
            "doc_id": ["clean-doc", "relanded-doc"],
            "day": [DAY] * 2,
            "title": ["t1", "t2"],
            "text": [
                "A page about nothing the RL gate asks about, long enough to be a document of its own here.",
                f"See also. {passage} And the page goes on with words of its own.",
            ],
        }
    )
    out = str(tmp_path / "pretrain")
    corpus_day = DayInput((DAY,), documents_to_jsonl(docs, out), 2)
    kept, report = decontaminate([corpus_day], index, out, "remove", document_texts, "doc_id", lambda _: None)
    assert [json.loads(line)["doc_id"] for line in Path(kept[0].path).read_text().splitlines()] == [
        "clean-doc"
    ]
    assert report.removed_rows == 1 and report.rows_by_source == {source: 1}
    assert report.examples[0]["id"] == "relanded-doc"
    assert report.examples[0]["matches"] == f"{source} {planted['item_id']}"

    # a day's teacher answers: one answer quotes the held-out passage (a teacher asked about its document)
    texts = {0: "a page on modules and how the import system finds them", 1: passage}
    samples = teacher_rows(
        [("clean-answer", 0), ("quoting-answer", 1)],
        DAY,
        lambda k: f"another document {k} about the interpreter",
        response=lambda k: texts[k],
    )
    out = str(tmp_path / "sft")
    sft_day = DayInput((DAY,), samples_to_jsonl(samples, out), 2)
    chat = chat_texts(template_segments(TEACHER_TEMPLATE))
    kept, report = decontaminate([sft_day], index, out, "remove", chat, "sample_id", lambda _: None)
    assert [json.loads(line)["sample_id"] for line in Path(kept[0].path).read_text().splitlines()] == [
        "clean-answer"
    ]
    assert report.removed_rows == 1 and report.rows_by_source == {source: 1}
    assert report.metadata(index)["contaminated_rows_by_source"] == {source: 1}
    assert report.examples[0]["id"] == "quoting-answer"
    assert report.examples[0]["matches"] == f"{source} {planted['item_id']}"

    # a day's preference pairs: one asks about the held-out document (the teacher template around its passage)
    pairs = pd.DataFrame(
        [
            {
                "pair_id": pid,
                "sample_id": f"s-{pid}",
                "day": DAY,
                "prompt": [{"role": "user", "content": render(TEACHER_TEMPLATE, title="t", text=text)}],
                "chosen": [{"role": "assistant", "content": "a short answer"}],
                "rejected": [{"role": "assistant", "content": "no"}],
            }
            for pid, text in (("clean-pair", "a page about the garbage collector"), ("quoting-pair", passage))
        ]
    )
    out = str(tmp_path / "preference")
    pair_day = DayInput((DAY,), pairs_to_jsonl(pairs, out), 2)
    texts_of = pair_texts(template_segments(TEACHER_TEMPLATE))
    kept, report = decontaminate([pair_day], index, out, "remove", texts_of, "pair_id", lambda _: None)
    assert [json.loads(line)["pair_id"] for line in Path(kept[0].path).read_text().splitlines()] == [
        "clean-pair"
    ]
    assert report.rows_by_source == {source: 1} and report.examples[0]["id"] == "quoting-pair"


def test_checkable_tasks_keep_the_frozen_prompts_held_out_and_leave_out_a_train_item_quoting_one(
    frozen: tuple[Path, list[dict[str, object]]],
) -> None:
    """The SFT blend's checkable_tasks source and GRPO's prompts are built with the same index: a train-side
    document quoting a held-out passage (pydoc repeats passages; here behind two words of its own, so it is not the
    same prompt) gives no train item and is named, while the held-out side (never trained on, what the set was drawn
    from) keeps every frozen prompt."""
    data, prompts = frozen
    settings = tiny_task_settings()
    passage = document_text(prompts[0])
    doc_id = next(f"quoting-{n:08d}" for n in range(1000) if not held_out(f"quoting-{n:08d}", settings))
    quoting = {"doc_id": doc_id, "title": "Glossary (part 1)", "text": f"In short: {passage}"}
    build = build_tasks([*landing_documents(), quoting], settings, _index(data))
    held_ids = {str(i["item_id"]) for i in build.held_out}
    assert {str(p["item_id"]) for p in prompts} <= held_ids
    assert not any(i["doc_id"] == doc_id for i in build.train)
    left_out = [c for c in build.contaminated if c["item_id"].endswith(doc_id)]
    assert left_out and left_out[0]["protected"] == f"rl_eval_set v1 {prompts[0]['item_id']}"
