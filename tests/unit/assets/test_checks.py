"""The asset checks of assets/checks.py, each on a good output and on the bad one it exists for. The blocking
check of raw_documents runs as Dagster runs it, in a real run on a real instance, on the real ingest of real landing
folders: a day re-delivered under a new date fails it, and the teacher step downstream does not run."""

from __future__ import annotations

import shutil
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
from support.packaging_inputs import teacher_rows
from support.sandbox import SAMPLE_LANDING

from nexa_dagster.assets import checks
from nexa_dagster.core.common.artifacts import COMPLETION_MARKER, EvalReport
from nexa_dagster.core.data.table_checks import redelivered_days
from nexa_dagster.core.evaluation.eval_set import freeze_eval_set, version_dir
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


def test_no_gate_configuration_lets_a_blank_answer_through() -> None:
    """Why filtered_samples has no answer check: SampleGate's heuristics refuse every generation error, and a filters
    file that would let a blank answer through (min_response_chars below 1) is refused when it is read."""
    import pydantic

    from nexa_dagster.core.distill.sample_gate import GateConfig, heuristic_reason, load_gate_config

    gate = load_gate_config("filters.yaml")
    assert heuristic_reason("a question?", "   ", None, gate).startswith("too_short")
    assert heuristic_reason("a question?", "an answer", "timeout", gate).startswith("teacher_error")
    with pytest.raises(pydantic.ValidationError, match="min_response_chars"):
        GateConfig.model_validate({**gate.model_dump(), "min_response_chars": 0})


def test_a_frozen_eval_set_edited_after_it_was_frozen_fails(tmp_path: Path, tiny_tokenizer) -> None:
    """A real eval set, frozen by freeze_eval_set (what the eval_set asset calls) from real teacher-template rows:
    the check passes it, then fails once its examples file is rewritten, naming what changed; a version never
    frozen fails too."""
    storage = StorageResource(data_root=str(tmp_path))
    eval_sets = EvalSetsResource(version=1)
    assert not checks.eval_set_matches_its_manifest(
        storage=storage, eval_sets=eval_sets
    ).passed  # none frozen
    rows = teacher_rows([(f"held-{k}", k) for k in range(3)], DAY, lambda k: f"document {k} " * 20)
    freeze_eval_set(rows, tiny_tokenizer, storage.path("eval_sets"), 1, 0.999999, 512, log=lambda _: None)
    assert checks.eval_set_matches_its_manifest(storage=storage, eval_sets=eval_sets).passed
    examples = Path(version_dir(storage.path("eval_sets"), 1)) / "examples.parquet"
    frame = pd.read_parquet(examples)
    frame.iloc[:1].to_parquet(examples)  # an example dropped after freezing
    result = checks.eval_set_matches_its_manifest(storage=storage, eval_sets=eval_sets)
    assert not result.passed and "changed since it was frozen" in result.description


def test_a_leaderboard_missing_an_evaluated_checkpoint_warns(tmp_path: Path) -> None:
    """The real leaderboard asset and its check, on reports the IO manager stored for two evaluated checkpoints: it
    lists both and the check passes; once one report's stored file is lost (a data root copied without it), the
    instance still says that checkpoint was evaluated, the leaderboard built again has no row for it, and the check
    warns naming it."""
    from nexa_dagster.assets.evaluation import leaderboard
    from nexa_dagster.assets.partitions import base_model_partitions, checkpoint_partitions

    @dg.asset(key="eval_report", partitions_def=checkpoint_partitions, io_manager_key="io_manager")
    def eval_report(context) -> EvalReport:  # noqa: ANN001 (Dagster reads the annotation as a string here)
        ckpt = context.partition_key
        return EvalReport(
            checkpoint_id=ckpt,
            checkpoint_path=str(tmp_path / ckpt),
            eval_loss=3.9,
            judge_score=3.0,
            perplexity=50.0,
            num_heldout_prompts=0,
            report_json=str(tmp_path / f"{ckpt}.json"),
            report_markdown=str(tmp_path / f"{ckpt}.md"),
        )

    resources = {
        "io_manager": NexaIOManager(data_root=str(tmp_path / "data"), results_root=str(tmp_path)),
        "storage": StorageResource(data_root=str(tmp_path / "data"), results_root=str(tmp_path)),
    }
    base_models = dg.SourceAsset("base_model_eval", partitions_def=base_model_partitions)  # none evaluated
    board = [eval_report, base_models, leaderboard, checks.leaderboard_lists_every_evaluation]
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("checkpoints", ["ckpt-1", "ckpt-2"])
        for ckpt in ("ckpt-1", "ckpt-2"):
            dg.materialize([eval_report], instance=instance, partition_key=ckpt, resources=resources)
        full = dg.materialize(board, instance=instance, resources=resources, selection=[leaderboard.key])
        [passed] = full.get_asset_check_evaluations()
        assert passed.passed and set(full.output_for_node("leaderboard")["checkpoint_id"]) == {
            "ckpt-1",
            "ckpt-2",
        }

        lost = list((tmp_path / "data" / "assets" / "eval_report").glob("ckpt-2*"))
        assert lost, "the IO manager stored no file for ckpt-2's report"
        for path in lost:
            path.unlink()
        short = dg.materialize(board, instance=instance, resources=resources, selection=[leaderboard.key])
        [warned] = short.get_asset_check_evaluations()
    assert short.success  # a warning: the leaderboard is written, the light is yellow
    assert not warned.passed and warned.severity == dg.AssetCheckSeverity.WARN
    assert "ckpt-2" in (warned.description or "")


def test_a_rollback_to_a_checkpoint_deleted_since_fails_the_production_check(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Two complete checkpoints (the tiny model saved, with training's _COMPLETE marker) promoted in turn: the
    check passes. The older one's folder is then removed (a disk cleanup of old checkpoints) and production rolled
    back to it, as ``nexa-dagster rollback`` does without a serving service (ProductionRegistry.rollback, which
    does not look at the folder): the pointer names a checkpoint that is not there, and the check says so."""
    storage = StorageResource(data_root=str(tmp_path))
    registry = ProductionRegistry(storage.production_pointer())
    assert checks.production_checkpoint_is_complete(storage=storage).passed  # nothing promoted yet
    for checkpoint_id in ("ckpt-1", "ckpt-2"):
        folder = tmp_path / "checkpoints" / checkpoint_id
        shutil.copytree(tiny_model_dir, folder)
        (folder / COMPLETION_MARKER).write_text("ok\n")
        registry.promote(
            ProductionEntry(checkpoint_id=checkpoint_id, checkpoint_path=str(folder), metric="eval_loss")
        )
    assert checks.production_checkpoint_is_complete(storage=storage).passed
    shutil.rmtree(tmp_path / "checkpoints" / "ckpt-1")
    registry.rollback()
    result = checks.production_checkpoint_is_complete(storage=storage)
    assert not result.passed and "production ckpt-1" in result.description
    assert "not a complete checkpoint" in result.description
