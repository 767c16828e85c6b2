"""The asset checks of assets/checks.py, each on a good output and on the bad one it exists for. The blocking
check of raw_documents runs as Dagster runs it, in a real run on a real instance: a day's documents of another day
fail it, and the teacher step downstream does not run."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest

from nexa_dagster.assets import checks
from nexa_dagster.core.common import storage as io
from nexa_dagster.core.common.artifacts import COMPLETION_MARKER
from nexa_dagster.core.evaluation.eval_set import content_sha256, frozen_marker, version_dir
from nexa_dagster.core.evaluation.promotion import ProductionEntry, ProductionRegistry
from nexa_dagster.resources.configs import EvalSetsResource
from nexa_dagster.resources.io_manager import NexaIOManager
from nexa_dagster.resources.scale import ScaleResource
from nexa_dagster.resources.storage import StorageResource

DAY = "2026-11-20"


def _documents(days: list[str]) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "doc_id": [f"{i:016x}" for i in range(len(days))],
            "day": days,
            "source": "a.jsonl",
            "title": "",
            "text": "some text",
            "n_chars": 9,
        }
    )


@pytest.fixture(scope="module")
def graph():
    from nexa_dagster.definitions import build_defs

    return build_defs().resolve_asset_graph()


def _run_ingest(graph, tmp_path: Path, frame: pd.DataFrame) -> tuple[dg.ExecuteInProcessResult, set[str]]:
    """raw_documents (its spec as the code location defines it, returning ``frame``), its real check, and a
    stand-in teacher_samples that depends on it, in one run."""
    key = dg.AssetKey("raw_documents")
    spec = next(s for s in graph.assets_def_for_key(key).specs if s.key == key)

    @dg.asset(key=key, partitions_def=spec.partitions_def)
    def raw_documents() -> pd.DataFrame:
        return frame

    @dg.asset(key="teacher_samples", partitions_def=spec.partitions_def, deps=[key])
    def teacher_samples() -> None:
        return None

    with dg.instance_for_test() as instance:
        result = dg.materialize(
            [raw_documents, teacher_samples, checks.raw_documents_fit_their_days],
            instance=instance,
            partition_key=DAY,
            raise_on_error=False,
            resources={
                "io_manager": NexaIOManager(data_root=str(tmp_path), results_root=str(tmp_path)),
                "scale_preset": ScaleResource(name="tiny"),
            },
        )
        done = {
            k.to_user_string()
            for k in instance.get_asset_keys()
            if instance.get_latest_materialization_event(k)
        }
    return result, done


def test_raw_documents_of_the_runs_day_pass(graph, tmp_path: Path) -> None:
    result, done = _run_ingest(graph, tmp_path, _documents([DAY, DAY]))
    assert result.success
    [evaluation] = result.get_asset_check_evaluations()
    assert evaluation.passed and done == {"raw_documents", "teacher_samples"}


@pytest.mark.parametrize(
    ("days", "expected"),
    [([DAY, "2026-11-19"], "outside the run's"), ([DAY] * 301, "above the preset's cap of 300")],
)
def test_a_bad_day_fails_the_blocking_check_and_stops_the_teacher(
    graph, tmp_path: Path, days: list[str], expected: str
) -> None:
    result, done = _run_ingest(graph, tmp_path, _documents(days))
    assert not result.success
    [evaluation] = result.get_asset_check_evaluations()
    assert not evaluation.passed and expected in evaluation.description
    assert done == {"raw_documents"}  # teacher_samples never ran


def _samples(responses: list[str], errors: list[str | None]) -> pd.DataFrame:
    return pd.DataFrame(
        {"sample_id": [f"s{i}" for i in range(len(responses))], "response": responses, "error": errors}
    )


def test_filtered_samples_without_an_answer_fail() -> None:
    good = checks.filtered_samples_have_answers(
        filtered_samples=_samples(["an answer", "another"], [None, None])
    )
    assert good.passed
    bad = checks.filtered_samples_have_answers(
        filtered_samples=_samples(["ok", "  ", "x"], [None, None, "timeout"])
    )
    assert not bad.passed and bad.metadata["sample_ids"].value == ["s1", "s2"]


def _freeze(root: Path, version: int = 1) -> Path:
    """A frozen version as freeze_eval_set leaves it: files, a manifest of their SHA-256s, the frozen marker."""
    directory = Path(version_dir(str(root), version))
    directory.mkdir(parents=True)
    pd.DataFrame({"prompt": ["q"], "answer": ["a"]}).to_parquet(directory / "examples.parquet")
    files = {"examples.parquet": io.sha256_file(directory / "examples.parquet")}
    content = content_sha256(files)
    (directory / "manifest.json").write_text(
        json.dumps({"version": version, "files": files, "content_sha256": content})
    )
    Path(frozen_marker(str(root), version)).write_text(content + "\n")
    return directory


def test_an_eval_set_changed_after_it_was_frozen_fails(tmp_path: Path) -> None:
    storage = StorageResource(data_root=str(tmp_path))
    eval_sets = EvalSetsResource(version=1)
    assert not checks.eval_set_matches_its_manifest(
        storage=storage, eval_sets=eval_sets
    ).passed  # none frozen
    directory = _freeze(tmp_path / "eval_sets")
    assert checks.eval_set_matches_its_manifest(storage=storage, eval_sets=eval_sets).passed
    pd.DataFrame({"prompt": ["q"], "answer": ["b"]}).to_parquet(directory / "examples.parquet")
    result = checks.eval_set_matches_its_manifest(storage=storage, eval_sets=eval_sets)
    assert not result.passed and "changed since it was frozen" in result.description


def test_a_leaderboard_missing_an_evaluated_checkpoint_warns() -> None:
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("checkpoints", ["ckpt-1", "ckpt-2"])
        for ckpt in ("ckpt-1", "ckpt-2"):
            instance.report_runless_asset_event(dg.AssetMaterialization("eval_report", partition=ckpt))
        context = dg.build_asset_check_context(instance=instance)
        full = checks.leaderboard_lists_every_evaluation(
            context, leaderboard=pd.DataFrame({"checkpoint_id": ["ckpt-1", "ckpt-2", "base-1"]})
        )
        short = checks.leaderboard_lists_every_evaluation(
            context, leaderboard=pd.DataFrame({"checkpoint_id": ["ckpt-1"]})
        )
    assert full.passed
    assert not short.passed and short.severity == dg.AssetCheckSeverity.WARN and "ckpt-2" in short.description


def test_a_production_pointer_to_an_incomplete_checkpoint_fails(tmp_path: Path) -> None:
    storage = StorageResource(data_root=str(tmp_path))
    assert checks.production_checkpoint_is_complete(storage=storage).passed  # nothing promoted yet
    ckpt = tmp_path / "checkpoints" / "ckpt-1"
    ckpt.mkdir(parents=True)
    ProductionRegistry(storage.production_pointer()).promote(
        ProductionEntry(checkpoint_id="ckpt-1", checkpoint_path=str(ckpt), metric="eval_loss")
    )
    result = checks.production_checkpoint_is_complete(storage=storage)
    assert not result.passed and "not a complete checkpoint" in result.description
    (ckpt / COMPLETION_MARKER).write_text("")
    assert checks.production_checkpoint_is_complete(storage=storage).passed
