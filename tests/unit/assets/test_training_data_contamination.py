"""What an evaluation says a checkpoint's training data holds of the eval set (``assets/evaluation.py``): a
checkpoint learned from its own data *and* from everything its lineage learned from (the production models it
continued from, its SFT parent, the base model's corpus less the documents the base left out), so an eval example in
any of them is found; a lineage whose data is not in this data root is unknown, never a clean zero."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
from support.packaging_inputs import teacher_rows

from nexa_dagster.assets.evaluation import Ancestor, training_data_contamination, training_lineage
from nexa_dagster.core.common.artifacts import COMPLETION_MARKER
from nexa_dagster.core.common.config import load_scale
from nexa_dagster.core.data.contamination import ContaminationIndex
from nexa_dagster.core.evaluation.eval_set import freeze_eval_set
from nexa_dagster.core.evaluation.promotion import PromotionPolicy
from nexa_dagster.core.evaluation.report import read_checkpoint
from nexa_dagster.core.packaging.decontaminate import DecontaminationReport, record_inputs
from nexa_dagster.core.packaging.preference_dataset import pairs_to_jsonl
from nexa_dagster.core.packaging.pretrain_corpus import corpus_document_ids, documents_to_jsonl
from nexa_dagster.core.packaging.sft_dataset import DayInput, samples_to_jsonl
from nexa_dagster.resources.configs import EvalSetsResource, PackagingResource, PromptsResource
from nexa_dagster.resources.storage import StorageResource
from nexa_dagster.resources.tracking import TrackingResource


def _document(k: int) -> str:
    """A distinct 40-word text (no 13-gram of one is in another)."""
    return " ".join(f"word{k}x{i}" for i in range(40))


def _samples(ids_and_docs: list[tuple[str, int]], day: str) -> pd.DataFrame:
    return teacher_rows(ids_and_docs, day, _document)


def _pairs(ids_and_chosen: list[tuple[str, str]], day: str) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "pair_id": pid,
                "sample_id": f"s-{pid}",
                "day": day,
                "prompt": [{"role": "user", "content": f"question {pid}"}],
                "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": "no"}],
            }
            for pid, chosen in ids_and_chosen
        ]
    )


def _dataset(root: str, run_hash: str, day: DayInput) -> None:
    """A dataset snapshot that records the day file it was packed from (as packaging does)."""
    record_inputs(f"{root}/{run_hash}", root, [day], DecontaminationReport("unused", "remove"), _NO_INDEX)


_NO_INDEX = ContaminationIndex.build([])


def _checkpoint(data: Path, checkpoint_id: str, store: str = "checkpoints", **record: object) -> None:
    """A complete checkpoint folder with its record (weights are never read on this path)."""
    folder = data / store / checkpoint_id
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "checkpoint.json").write_text(json.dumps({"num_steps": 1, "path": str(folder), **record}))
    (folder / COMPLETION_MARKER).write_text("")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer, tiny_model_dir: Path) -> dict:
    data = tmp_path_factory.mktemp("contamination") / "data"
    storage = StorageResource(data_root=str(data))
    freeze_eval_set(
        _samples([(f"held-{k}", k) for k in range(3)], "2026-11-01"),
        tiny_tokenizer,
        storage.path("eval_sets"),
        1,
        fraction=0.999999,
        max_tokens=512,
        log=lambda _: None,
    )
    sft, pref = storage.path("sft"), storage.path("preference")
    clean = DayInput(
        ("2026-11-02",), samples_to_jsonl(_samples([("a", 10), ("b", 11)], "2026-11-02"), sft), 2
    )
    _dataset(sft, "sft-clean", clean)
    # a DPO pair whose chosen answer quotes eval example held-1's document (an answer that recites a page)
    leaked = _pairs([("p1", "fine"), ("p2", "it says " + _document(1))], "2026-11-03")
    _dataset(pref, "pref-leaky", DayInput(("2026-11-03",), pairs_to_jsonl(leaked, pref), 2))
    _dataset(
        pref, "pref-clean", DayInput(("2026-11-04",), pairs_to_jsonl(_pairs([("p3", "ok")], "x"), pref), 1)
    )
    # a pretraining corpus holding the documents of eval examples held-0 and held-2, and a clean one: base b1 left
    # both contaminated documents out of its training, base b2 (trained before the eval set was frozen) only held-0's
    (data / "models").mkdir(parents=True)
    (data / "models" / "tiny-teacher").symlink_to(tiny_model_dir)
    corpus, texts = storage.path("pretrain"), [_document(0), _document(2), _document(20)]
    docs = pd.DataFrame({"doc_id": ["d0", "d2", "d20"], "day": "2026-11-01", "title": "t", "text": texts})
    _dataset(corpus, "corpus-1", DayInput(("2026-11-01",), documents_to_jsonl(docs, corpus), 3))
    ids = corpus_document_ids(texts, tiny_tokenizer, corpus)
    for base, left_out in (("b1", ids[:2]), ("b2", ids[:1])):
        _checkpoint(
            data,
            base,
            "base_models",
            stage="pretrain",
            dataset_run_hash="corpus-1",
            parent="scratch",
            excluded_documents=left_out,
            eval_side_fraction=0.0,
        )
    # a base whose record predates the left-out documents: what it trained on is unknown
    _checkpoint(data, "b-old", "base_models", stage="pretrain", dataset_run_hash="corpus-1", parent="scratch")
    _checkpoint(data, "sft-on-old-base", stage="sft", dataset_run_hash="sft-clean", parent="base:b-old")
    _checkpoint(data, "sft-1", stage="sft", dataset_run_hash="sft-clean", parent="base:b1")
    # nightly continual fine-tuning: an SFT model that went on from one that started from the leaky base
    _checkpoint(data, "sft-leaky-base", stage="sft", dataset_run_hash="sft-clean", parent="base:b2")
    _checkpoint(
        data, "sft-night-2", stage="sft", dataset_run_hash="sft-clean", parent="production:sft-leaky-base"
    )
    _checkpoint(data, "pref-1", stage="preference", dataset_run_hash="pref-leaky", parent="production:sft-1")
    _checkpoint(data, "pref-2", stage="preference", dataset_run_hash="pref-clean", parent="production:pref-1")
    _checkpoint(data, "pref-3", stage="preference", dataset_run_hash="pref-clean", parent="production:gone")
    return {
        "data": data,
        "storage": storage,
        "tracking": TrackingResource(data_root=str(data)),
        "scale": (scale := load_scale("tiny")).model_copy(
            update={
                "evaluation": scale.evaluation.model_copy(
                    update={"benchmarks": scale.evaluation.benchmarks.model_copy(update={"tasks": []})}
                )
            }
        ),
    }


def _contamination(world: dict, checkpoint_id: str) -> tuple[float | None, list[str]]:
    ckpt = read_checkpoint(world["data"] / "checkpoints" / checkpoint_id, checkpoint_id, str(world["data"]))
    return training_data_contamination(
        dg.build_asset_context(),
        world["storage"],
        world["tracking"],
        ckpt,
        EvalSetsResource(),
        world["scale"],
        PromptsResource(),
        PackagingResource(),
        PromotionPolicy(),
    )


def test_an_sft_checkpoint_on_clean_data_holds_none_of_the_eval_set(world: dict) -> None:
    assert _contamination(world, "sft-1") == (0.0, [])


def test_a_dpo_checkpoint_holds_what_its_pairs_hold_and_its_child_inherits_it(world: dict) -> None:
    share, items = _contamination(world, "pref-1")
    assert items == ["eval_set v1 held-1"] and share == pytest.approx(1 / 3)
    # DPO from a DPO production model: clean pairs of its own, its parent's leak still in its weights
    assert _contamination(world, "pref-2") == (pytest.approx(1 / 3), ["eval_set v1 held-1"])


def test_a_dpo_checkpoint_whose_parent_is_not_in_this_data_root_is_unknown(world: dict) -> None:
    ckpt = read_checkpoint(world["data"] / "checkpoints" / "pref-3", "pref-3", str(world["data"]))
    lineage = training_lineage(world["storage"], world["tracking"], PromotionPolicy(), ckpt)
    assert lineage == [Ancestor("preference", "pref-clean", "pref-3"), Ancestor("training", None, "gone")]
    assert _contamination(world, "pref-3") == (None, [])


def test_the_base_models_corpus_counts_less_the_documents_it_left_out(world: dict) -> None:
    # b1 left both contaminated documents out (sft-1 is clean, above); b2 trained on held-2's document
    assert _contamination(world, "sft-leaky-base") == (pytest.approx(1 / 3), ["eval_set v1 held-2"])
    # and a model that continued from it (init_from: production) inherits what its lineage learned
    ckpt = read_checkpoint(world["data"] / "checkpoints" / "sft-night-2", "sft-night-2", str(world["data"]))
    lineage = training_lineage(world["storage"], world["tracking"], PromotionPolicy(), ckpt)
    assert [(a.stage, a.checkpoint_id) for a in lineage] == [
        ("sft", "sft-night-2"),
        ("sft", "sft-leaky-base"),
        ("pretrain", "b2"),
    ]
    assert _contamination(world, "sft-night-2") == (pytest.approx(1 / 3), ["eval_set v1 held-2"])


def test_a_base_model_that_does_not_record_what_it_left_out_is_unknown(world: dict) -> None:
    assert _contamination(world, "sft-on-old-base") == (None, [])


def test_a_checkpoint_started_from_a_model_trained_elsewhere_is_unknown(world: dict, tmp_path: Path) -> None:
    _checkpoint(
        world["data"], "from-path", stage="sft", dataset_run_hash="sft-clean", parent=f"path:{tmp_path}"
    )
    assert _contamination(world, "from-path") == (None, [])
