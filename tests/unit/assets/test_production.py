"""Production as an asset with events (assets/production.py): every promotion and rollback is a materialization of
``production_model`` whose data version is the checkpoint id; what was made from production recorded that data
version as its input (Dagster's own lineage), so a promotion leaves it behind (stale) and the history lists every
change. A rollback from the command line, outside any run, records its event on the instance DAGSTER_HOME names.

Only public Dagster API. Dagster 1.13 has no public in-process call that returns an asset's stale status: the
resolver the UI's "Unsynced" comes from (``CachingStaleStatusResolver``) lives in ``dagster._core``, and the public
``staleStatus``/``staleCauses`` fields are the webserver's GraphQL (read in the browser by
``tests/integration/test_ui.py``; executing that schema in-process needs ``dagster._core.workspace``). So the
staleness test makes Dagster's own comparison from Dagster's public pieces, with no tag of ours read: a stale
dependency is one whose data version recorded in the materialization's provenance (``dg.DataProvenance.from_tags``,
the tags Dagster wrote when the pairs were made) differs from the dependency's current data version; and the
current data version is what Dagster records as the input of a materialization made now (its step reads the same
latest materialization, the same way, as the resolver)."""

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

PRODUCTION = dg.AssetKey(PRODUCTION_MODEL)
PAIRS = dg.AssetKey("preference_pairs")
DAY, NEXT, LATER = "2026-11-20", "2026-11-21", "2026-11-22"


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


def _made_from(instance: dg.DagsterInstance, day: str) -> dg.DataVersion:
    """The data version of production_model that Dagster recorded as the input of the latest pairs of ``day``."""
    [record] = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=PAIRS, asset_partitions=[day]), limit=1
    ).records
    provenance = dg.DataProvenance.from_tags(record.asset_materialization.tags)
    assert provenance is not None and provenance.has_input_asset(PRODUCTION)
    return provenance.input_data_versions[PRODUCTION]


def _make_pairs(instance: dg.DagsterInstance, pairs: dg.AssetsDefinition, day: str) -> dg.DataVersion:
    """Pairs of ``day`` made now; the data version of production Dagster read for them (production's current one)."""
    assert dg.materialize([production_model_asset, pairs], instance=instance, partition_key=day).success
    return _made_from(instance, day)


def test_a_promotion_leaves_the_pairs_made_from_the_old_production_behind(tmp_path: Path) -> None:
    pairs = _pairs_stand_in()
    with dg.instance_for_test() as instance:
        report_production_change(instance, _entry("ckpt-a", tmp_path), "promotion", None)
        recorded = _make_pairs(instance, pairs, DAY)
        assert recorded == dg.DataVersion("ckpt-a")

        report_production_change(instance, _entry("ckpt-b", tmp_path), "promotion", "ckpt-a")
        # what Dagster now takes as production's data version; DAY, made from ckpt-a, is stale ("has a new
        # dependency data version"), NEXT, made after the promotion, is not
        current = _make_pairs(instance, pairs, NEXT)
        assert current == dg.DataVersion("ckpt-b") != _made_from(instance, DAY)

        report_production_change(instance, _entry("ckpt-a", tmp_path), "rollback", "ckpt-b")
        # rolled back: DAY is fresh again, NEXT (made from ckpt-b) is stale
        current = _make_pairs(instance, pairs, LATER)
        assert current == _made_from(instance, DAY) != _made_from(instance, NEXT)

        history = instance.fetch_materializations(PRODUCTION, limit=10, ascending=True).records
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
