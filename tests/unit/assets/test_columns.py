"""Every table asset's page has a Columns tab: the column schema its pandera model gives its Dagster type, and
column lineage that names real columns of real upstream assets; a materialization records that lineage."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pandas as pd
import pytest

from nexa_dagster.assets import columns
from nexa_dagster.core.data import schemas
from nexa_dagster.resources.io_manager import NexaIOManager

MODELS = {
    "raw_documents": schemas.RawDocuments,
    "teacher_samples": schemas.TeacherSamples,
    "filtered_samples": schemas.FilteredSamples,
    "rejected_samples": schemas.RejectedSamples,
    "preference_pairs": schemas.PreferencePairs,
    "leaderboard": schemas.Leaderboard,
}


@pytest.fixture(scope="module")
def graph():
    from nexa_dagster.definitions import build_defs

    return build_defs().resolve_asset_graph()


def _metadata(graph, name: str) -> dict:
    return graph.get(dg.AssetKey(name)).metadata


@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_table_asset_has_its_pandera_models_columns(graph, name: str) -> None:
    schema = _metadata(graph, name)[columns.COLUMN_SCHEMA]
    model = MODELS[name].to_schema()
    assert [c.name for c in schema.columns] == list(model.columns)
    nullable = {c.name for c in schema.columns if c.constraints.nullable}
    assert nullable == {n for n, c in model.columns.items() if c.nullable}, name


def test_column_lineage_names_real_columns_of_real_parents(graph) -> None:
    seen = 0
    for name in MODELS:
        lineage = _metadata(graph, name).get(columns.COLUMN_LINEAGE)
        if lineage is None:
            continue
        own = {c.name for c in _metadata(graph, name)[columns.COLUMN_SCHEMA].columns}
        parents = graph.get(dg.AssetKey(name)).parent_keys
        for column, deps in lineage.deps_by_column.items():
            assert column in own, (name, column)
            for dep in deps:
                assert dep.asset_key in parents, (name, column, dep.asset_key)
                upstream = {
                    c.name
                    for c in _metadata(graph, dep.asset_key.to_user_string())[columns.COLUMN_SCHEMA].columns
                }
                assert dep.column_name in upstream, (name, column, dep)
                seen += 1
    assert seen >= 20


def test_a_lineage_entry_naming_a_missing_column_is_caught(graph, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: a renamed upstream column leaves the lineage naming nothing."""
    monkeypatch.setitem(columns.LINEAGE, "teacher_samples", {"doc_id": [("raw_documents", "document_id")]})
    lineage = columns.column_lineage("teacher_samples")
    raw = {c.name for c in _metadata(graph, "raw_documents")[columns.COLUMN_SCHEMA].columns}
    assert lineage.deps_by_column["doc_id"][0].column_name not in raw


def test_a_materialization_records_the_column_lineage(graph, tmp_path: Path) -> None:
    key = dg.AssetKey("teacher_samples")
    spec = next(s for s in graph.assets_def_for_key(key).specs if s.key == key)

    @dg.asset(key=key, deps=spec.deps, partitions_def=spec.partitions_def, metadata=spec.metadata)
    def stand_in() -> pd.DataFrame:  # the real definition metadata; the frame handed to the real IO manager
        return pd.DataFrame({c: [] for c in schemas.TeacherSamples.to_schema().columns})

    with dg.instance_for_test() as instance:
        result = dg.materialize(
            [stand_in],
            instance=instance,
            partition_key="2026-11-20",
            resources={"io_manager": NexaIOManager(data_root=str(tmp_path), results_root=str(tmp_path))},
        )
        assert result.success
        event = instance.get_latest_materialization_event(key)
        recorded = event.asset_materialization.metadata[columns.COLUMN_LINEAGE]
    assert recorded.value == columns.column_lineage("teacher_samples")
