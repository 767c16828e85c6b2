"""Column schemas and column lineage of the table assets, for the Columns tab of each asset's page.

The schema of a table asset is the one its pandera model gives its Dagster type (``assets/types.py``:
``dagster_pandera`` derives a ``TableSchema`` from the model, names, types, nullability, uniqueness, checks), so the
UI shows exactly what the stage boundary enforces and there is one description of each table. ``with_column_schemas``
puts it in every table asset's definition metadata (``dagster/column_schema``) when the code location loads, with
``dagster/column_lineage`` where a column is copied or derived from an upstream table's column; the IO manager
records that lineage on each materialization too (``resources/io_manager.py``), where the UI's column lineage graph
reads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import dagster as dg

from nexa_dagster.assets import types
from nexa_dagster.core.data import schemas

COLUMN_SCHEMA = "dagster/column_schema"
COLUMN_LINEAGE = "dagster/column_lineage"

TABLE_TYPES: dict[str, dg.DagsterType] = {
    "raw_documents": types.RawDocumentsType,
    "teacher_samples": types.TeacherSamplesType,
    "filtered_samples": types.FilteredSamplesType,
    "rejected_samples": types.RejectedSamplesType,
    "preference_pairs": types.PreferencePairsType,
    "leaderboard": types.LeaderboardType,
}

# SampleGate copies every teacher_samples column into the table a sample lands in, and adds the judge's
_SAMPLE_COLUMNS = list(schemas.TeacherSamples.to_schema().columns)
_COPIED_FROM_TEACHER = {c: [("teacher_samples", c)] for c in _SAMPLE_COLUMNS}

# column -> the (upstream asset, column) pairs it is copied or derived from
LINEAGE: dict[str, dict[str, list[tuple[str, str]]]] = {
    "teacher_samples": {
        "doc_id": [("raw_documents", "doc_id")],
        "day": [("raw_documents", "day")],
        # a hash of the rendered prompt (the document's title and text), the model and the sampling
        "sample_id": [("raw_documents", "title"), ("raw_documents", "text")],
        "prompt": [("raw_documents", "title"), ("raw_documents", "text")],  # the teacher prompt renders both
    },
    "filtered_samples": _COPIED_FROM_TEACHER,
    "rejected_samples": _COPIED_FROM_TEACHER,
    "preference_pairs": {
        "sample_id": [("filtered_samples", "sample_id")],
        "day": [("filtered_samples", "day")],
        "prompt": [("filtered_samples", "system_prompt"), ("filtered_samples", "prompt")],
        "chosen": [
            ("filtered_samples", "response")
        ],  # the teacher's answer or the policy's, whichever scored higher
        "rejected": [("filtered_samples", "response")],
    },
}


def column_schema(asset: str) -> dg.TableSchema:
    """The table schema the pandera model of ``asset`` gives its Dagster type."""
    return TABLE_TYPES[asset].metadata["schema"].schema


def column_lineage(asset: str) -> dg.TableColumnLineage | None:
    lineage = LINEAGE.get(asset)
    if not lineage:
        return None
    return dg.TableColumnLineage(
        deps_by_column={
            column: [dg.TableColumnDep(asset_key=dg.AssetKey(dep), column_name=name) for dep, name in sources]
            for column, sources in lineage.items()
        }
    )


def column_metadata(asset: str) -> Mapping[str, Any]:
    """The definition metadata of a table asset: its column schema, and its column lineage where it has one."""
    if asset not in TABLE_TYPES:
        return {}
    lineage = column_lineage(asset)
    return {COLUMN_SCHEMA: column_schema(asset), **({COLUMN_LINEAGE: lineage} if lineage else {})}


def with_column_schemas(assets: Iterable[Any]) -> list[Any]:
    """The assets, each table asset's spec given its column schema and lineage."""

    def described(spec: dg.AssetSpec) -> dg.AssetSpec:
        extra = column_metadata(spec.key.to_user_string())
        return spec.merge_attributes(metadata=extra) if extra else spec

    return [a.map_asset_specs(described) if isinstance(a, dg.AssetsDefinition) else a for a in assets]
