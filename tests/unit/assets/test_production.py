"""Production as an asset with events (assets/production.py): every promotion and rollback is a materialization of
``production_model`` whose data version is the checkpoint id; what was made from production recorded that data
version as its input (Dagster's own lineage), so a promotion leaves it behind (stale) and the history lists every
change. A rollback from the command line, outside any run, records its event on the instance DAGSTER_HOME names.

Only public Dagster API: the instance's event records and their tags (the ones the UI's staleness compares)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dagster as dg

from nexa_dagster.assets.production import (
    DATA_VERSION_TAG,
    PRODUCTION_MODEL,
    production_model_asset,
    report_production_change,
)
from nexa_dagster.core.common.config import REPO_ROOT
from nexa_dagster.core.evaluation.promotion import ProductionEntry, ProductionRegistry

INPUT_TAG = f"dagster/input_data_version/{PRODUCTION_MODEL}"  # what a materialization recorded of its input
DAY = "2026-11-20"


def _entry(checkpoint_id: str, root: Path) -> ProductionEntry:
    return ProductionEntry(
        checkpoint_id=checkpoint_id, checkpoint_path=str(root / checkpoint_id), metric="eval_loss"
    )


def _pairs_stand_in() -> dg.AssetsDefinition:
    """preference_pairs as the code location defines its key, partitions and dependency on production_model."""
    from nexa_dagster.definitions import defs

    spec = next(s for s in defs.resolve_all_asset_specs() if s.key == dg.AssetKey("preference_pairs"))
    assert PRODUCTION_MODEL in {d.asset_key.to_user_string() for d in spec.deps}

    @dg.multi_asset(specs=[spec.replace_attributes(deps=[PRODUCTION_MODEL])], name="stand_in_pairs")
    def pairs() -> dg.MaterializeResult:
        return dg.MaterializeResult(asset_key=spec.key)

    return pairs


def _production_now(instance: dg.DagsterInstance) -> str:
    event = instance.get_latest_materialization_event(dg.AssetKey(PRODUCTION_MODEL))
    return event.asset_materialization.tags[DATA_VERSION_TAG]


def test_a_promotion_leaves_the_pairs_made_from_the_old_production_behind(tmp_path: Path) -> None:
    pairs = _pairs_stand_in()
    with dg.instance_for_test() as instance:
        report_production_change(instance, _entry("ckpt-a", tmp_path), "promotion", None)
        assert dg.materialize([production_model_asset, pairs], instance=instance, partition_key=DAY).success
        made = instance.get_latest_materialization_event(dg.AssetKey("preference_pairs"))
        recorded = made.asset_materialization.tags[INPUT_TAG]
        assert recorded == "ckpt-a" == _production_now(instance)  # fresh: made from what is production

        report_production_change(instance, _entry("ckpt-b", tmp_path), "promotion", "ckpt-a")
        assert _production_now(instance) == "ckpt-b" != recorded  # stale: "has a new dependency data version"

        report_production_change(instance, _entry("ckpt-a", tmp_path), "rollback", "ckpt-b")
        assert _production_now(instance) == recorded  # rolled back to what it was made from: fresh again

        history = instance.fetch_materializations(
            dg.AssetKey(PRODUCTION_MODEL), limit=10, ascending=True
        ).records
        assert [
            (
                r.asset_materialization.metadata["change"].value,
                r.asset_materialization.metadata["checkpoint_id"].value,
            )
            for r in history
        ] == [("promotion", "ckpt-a"), ("promotion", "ckpt-b"), ("rollback", "ckpt-a")]


def test_a_rollback_from_the_command_line_is_an_event_of_production(tmp_path: Path) -> None:
    home, data = tmp_path / "dagster_home", tmp_path / "data"
    home.mkdir()
    for checkpoint_id in ("ckpt-a", "ckpt-b"):
        (data / "checkpoints" / checkpoint_id).mkdir(parents=True)
    registry = ProductionRegistry(data / "serving" / "production.json")
    registry.promote(_entry("ckpt-a", data / "checkpoints"))
    registry.promote(_entry("ckpt-b", data / "checkpoints"))
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "NEXA_DATA_ROOT": str(data),
        "NEXA_RESULTS_ROOT": str(tmp_path / "results"),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "nexa_dagster.cli", "rollback"],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    with dg.DagsterInstance.from_config(str(home)) as instance:
        records = instance.fetch_materializations(dg.AssetKey(PRODUCTION_MODEL), limit=5).records
        assert len(records) == 1
        meta = {k: v.value for k, v in records[0].asset_materialization.metadata.items()}
        assert (meta["change"], meta["checkpoint_id"], meta["previous_checkpoint"]) == (
            "rollback",
            "ckpt-a",
            "ckpt-b",
        )
        assert records[0].asset_materialization.tags[DATA_VERSION_TAG] == "ckpt-a"


def test_production_model_is_the_projects_external_asset_not_a_stub() -> None:
    """Its page has the project's description and group, and the preference stage below it (an AssetSpec that
    load_assets_from_modules does not collect would be drawn as a stub in the default group)."""
    from nexa_dagster.definitions import defs

    spec = next(s for s in defs.resolve_all_asset_specs() if s.key == dg.AssetKey(PRODUCTION_MODEL))
    assert spec.group_name == "preference" and "dagster/auto_created_stub_asset" not in spec.metadata
    assert spec.description == production_model_asset.description
