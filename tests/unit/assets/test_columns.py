"""Every table asset's page has a Columns tab: the column schema its pandera model gives its Dagster type, and
column lineage that names real columns of real upstream assets; a materialization records that lineage."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pandas as pd
import pyarrow.parquet as pq
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


def lineage_problems(graph, lineage_of) -> list[str]:
    """Every lineage entry (``lineage_of(asset)``) naming a column its asset lacks, a parent that is not one, or
    a column the parent lacks; and the number of entries checked."""
    problems, seen = [], 0
    for name in MODELS:
        lineage = lineage_of(name)
        if lineage is None:
            continue
        own = {c.name for c in _metadata(graph, name)[columns.COLUMN_SCHEMA].columns}
        parents = graph.get(dg.AssetKey(name)).parent_keys
        for column, deps in lineage.deps_by_column.items():
            if column not in own:
                problems.append(f"{name}.{column}: no such column")
            for dep in deps:
                seen += 1
                parent = dep.asset_key.to_user_string()
                if dep.asset_key not in parents:
                    problems.append(f"{name}.{column}: {parent} is not a parent")
                    continue
                upstream = {c.name for c in _metadata(graph, parent)[columns.COLUMN_SCHEMA].columns}
                if dep.column_name not in upstream:
                    problems.append(f"{name}.{column}: {parent} has no column {dep.column_name}")
    return problems + ([] if seen >= 20 else [f"only {seen} lineage entries"])


def test_column_lineage_names_real_columns_of_real_parents(graph) -> None:
    assert lineage_problems(graph, lambda name: _metadata(graph, name).get(columns.COLUMN_LINEAGE)) == []


def test_a_lineage_entry_naming_a_missing_column_is_caught(graph, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: a renamed upstream column leaves the lineage naming nothing."""
    renamed = {**columns.LINEAGE["teacher_samples"], "doc_id": [("raw_documents", "document_id")]}
    monkeypatch.setitem(columns.LINEAGE, "teacher_samples", renamed)
    assert lineage_problems(graph, columns.column_lineage) == [
        "teacher_samples.doc_id: raw_documents has no column document_id"
    ]


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
        written = event.asset_materialization.metadata[columns.COLUMN_SCHEMA].value
    assert recorded.value == columns.column_lineage("teacher_samples")
    # the columns of the file written, read back from it (the Columns tab of this materialization)
    file = pq.read_schema(tmp_path / "assets" / "teacher_samples" / "2026-11-20.parquet")
    assert [(c.name, c.type) for c in written.columns] == [(f.name, str(f.type)) for f in file]
