"""The asset checks of assets/checks.py, each on a good output and on the bad one it exists for. The blocking
check of raw_documents runs as Dagster runs it, in a real run on a real instance, on the real ingest of real landing
folders: a day re-delivered under a new date fails it, and the teacher step downstream does not run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import dagster as dg
import pandas as pd
from support.sandbox import SAMPLE_LANDING

from nexa_dagster.assets import checks
from nexa_dagster.core.common import storage as io
from nexa_dagster.core.common.artifacts import COMPLETION_MARKER
from nexa_dagster.core.data.table_checks import redelivered_days
from nexa_dagster.core.evaluation.eval_set import content_sha256, frozen_marker, version_dir
from nexa_dagster.core.evaluation.promotion import ProductionEntry, ProductionRegistry
from nexa_dagster.resources.configs import EvalSetsResource
from nexa_dagster.resources.io_manager import NexaIOManager
from nexa_dagster.resources.scale import ScaleResource
from nexa_dagster.resources.storage import StorageResource

DAY, NEXT = "2026-11-20", "2026-11-21"


def _run_ingest(
    tmp_path: Path, instance: dg.DagsterInstance, day: str
) -> tuple[dg.ExecuteInProcessResult, bool]:
    """The real raw_documents asset (the real ingest of the landing folder of ``day``), its real check, and a
    stand-in teacher_samples that depends on it, in one run; (the result, whether the teacher step ran)."""
    from nexa_dagster.assets.ingest import raw_documents
    from nexa_dagster.resources.configs import IngestResource

    ran = tmp_path / f"teacher-{day}"

    @dg.asset(key="teacher_samples", partitions_def=raw_documents.partitions_def, deps=[raw_documents.key])
    def teacher_samples() -> None:
        ran.touch()

    storage = StorageResource(data_root=str(tmp_path / "data"), landing_root=str(tmp_path / "landing"))
    result = dg.materialize(
        [raw_documents, teacher_samples, checks.raw_documents_are_new],
        instance=instance,
        partition_key=day,
        raise_on_error=False,
        resources={
            "io_manager": NexaIOManager(data_root=str(tmp_path / "data"), results_root=str(tmp_path)),
            "storage": storage,
            "scale_preset": ScaleResource(name="tiny"),
            "ingest_config": IngestResource(),
        },
    )
    return result, ran.exists()


def test_a_day_redelivered_under_a_new_date_fails_the_blocking_check_and_stops_the_teacher(
    tmp_path: Path,
) -> None:
    """Real landing folders, really ingested: a new day passes; the same files landed again under the next date
    (a re-delivery) fail the check, naming the day that holds them, and the teacher never runs on them."""
    landing = tmp_path / "landing"
    shutil.copytree(SAMPLE_LANDING / DAY, landing / DAY)
    shutil.copytree(SAMPLE_LANDING / DAY, landing / NEXT)  # the same files, delivered again
    with dg.instance_for_test() as instance:
        result, teacher_ran = _run_ingest(tmp_path, instance, DAY)
        [evaluation] = result.get_asset_check_evaluations()
        assert result.success and evaluation.passed and teacher_ran

        result, teacher_ran = _run_ingest(tmp_path, instance, NEXT)
        [evaluation] = result.get_asset_check_evaluations()
        assert not result.success and not evaluation.passed and not teacher_ran
        assert (
            f"{NEXT}: all" in evaluation.description
            and f"ingested before (on {DAY})" in evaluation.description
        )


def test_a_day_with_one_new_document_passes() -> None:
    frame = pd.DataFrame({"doc_id": ["a", "b", "c"], "day": [NEXT] * 3})
    assert redelivered_days(frame, {DAY: {"a", "b"}}) == []
    assert redelivered_days(frame, {DAY: {"a", "b", "c", "d"}})[0].startswith(f"{NEXT}: all 3 documents")
    # within one run (a backfill of both days), the earlier day of the run counts too
    both = pd.concat([frame.assign(day=DAY), frame])
    assert len(redelivered_days(both, {})) == 1


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
