"""An IO manager that stores tables as Parquet per partition and artifacts as JSON, atomically.

It understands partition ranges: a single-run backfill over ten days hands the asset one frame with a ``day``
column, and this IO manager writes each day's rows to that day's partition file (and reads a range back as one
frame). That is what lets ``dagster asset materialize --partition-range`` process a date range in one run.

Artifacts name the files they describe by their place in the data root or the results root
(``{data_root}/checkpoints/ckpt-1``, ``core.common.roots.portable``) and are read back under the roots as they
are now, so a moved data root's artifacts stay valid; an artifact written with absolute paths before is read
under the current roots by the paths' tails.
"""

from __future__ import annotations

import importlib
from typing import Any

import dagster as dg
import pandas as pd
import pyarrow.parquet as pq
from pydantic import BaseModel

from nexa_dagster import settings
from nexa_dagster.core.common import roots
from nexa_dagster.core.common import storage as io
from nexa_dagster.core.common.config import resolve_path

PARTITION_COLUMN = "day"


# input metadata of a reader of every partition of an artifact asset: none materialized (or none at all) is an
# empty dict, not an error (the leaderboard before any base model was evaluated)
MISSING_OK = "nexa/missing_ok"


def _root(value: str) -> str:
    return value if "://" in value else str(resolve_path(value))


class NexaIOManager(dg.ConfigurableIOManager):
    data_root: str = "data"
    results_root: str = ""  # empty: NEXA_RESULTS_ROOT's value (reports, the leaderboard)

    def _base(self, key: dg.AssetKey) -> str:
        return io.join(_root(self.data_root), "assets", *key.path)

    def roots(self) -> dict[str, str]:
        """The roots artifacts' paths are stored relative to, as they are now."""
        return {
            "data_root": _root(self.data_root),
            "results_root": _root(self.results_root or settings.RESULTS_ROOT.get()),
        }

    def _path(self, key: dg.AssetKey, partition: str | None, ext: str) -> str:
        return io.join(self._base(key), f"{partition or '__all__'}.{ext}")

    # -- writing --------------------------------------------------------------------------------------------
    def handle_output(self, context: dg.OutputContext, obj: Any) -> None:
        if obj is None:
            return
        keys = context.asset_partition_keys if context.has_asset_partitions else [None]
        if isinstance(obj, pd.DataFrame):
            written = []
            for key in keys:
                part = obj
                if key is not None and len(keys) > 1:
                    part = obj[obj[PARTITION_COLUMN] == key].reset_index(drop=True)
                path = self._path(context.asset_key, key, "parquet")
                io.write_parquet(part, path)
                written.append(path)
            context.add_output_metadata(
                {
                    "path": dg.MetadataValue.path(written[0])
                    if len(written) == 1
                    else dg.MetadataValue.json(written),
                    # the lineage assets/columns.py declares, where the UI's column lineage graph reads it
                    **_column_lineage(context),
                    # the columns of the file written, read back from it: what the Columns tab shows of this
                    # materialization (the definition's schema is the pandera model's: what every file must hold)
                    "dagster/column_schema": written_schema(written[0]),
                }
            )
        elif isinstance(obj, BaseModel):
            cls = type(obj)
            for key in keys:
                io.write_json(
                    {
                        "type": f"{cls.__module__}.{cls.__qualname__}",
                        "data": roots.portable(obj.model_dump(), self.roots()),
                    },
                    self._path(context.asset_key, key, "json"),
                )
        else:
            raise TypeError(
                f"{context.asset_key.to_user_string()}: NexaIOManager stores DataFrames and pydantic "
                f"artifacts, got {type(obj).__name__}"
            )

    # -- reading --------------------------------------------------------------------------------------------
    def load_input(self, context: dg.InputContext) -> Any:
        key = context.asset_key
        keys: list[str | None] = (
            list(context.asset_partition_keys) if context.has_asset_partitions else [None]
        )
        json_paths = {k: self._path(key, k, "json") for k in keys}
        # an unpartitioned asset reading a partitioned one gets every partition (e.g. every checkpoint's report)
        many = context.has_asset_partitions and not context.has_partition_key
        if not many and len(keys) == 1 and io.exists(json_paths[keys[0]]):
            return _load_artifact(json_paths[keys[0]], self.roots())
        if many:  # {partition: artifact} for artifacts; tables fall through and are concatenated
            found = {k: p for k, p in json_paths.items() if io.exists(p)}
            if found or (context.definition_metadata or {}).get(MISSING_OK):
                return {k: _load_artifact(p, self.roots()) for k, p in found.items()}
        paths = [self._path(key, k, "parquet") for k in keys]
        present = [p for p in paths if io.exists(p)]
        if not present:
            what = (
                "partitions (it has none yet)"
                if not keys
                else f"partitions {keys[0]}..{keys[-1]}"
                if len(keys) > 1
                else f"partition {keys[0]}"
            )
            raise FileNotFoundError(
                f"{key.to_user_string()}: nothing materialized for {what} under {self._base(key)}"
            )
        if len(present) < len(paths):
            context.log.info(
                skipped_partitions_message(key.to_user_string(), keys, [p in present for p in paths])
            )
        return pd.concat([io.read_parquet(p) for p in present], ignore_index=True)


def skipped_partitions_message(asset: str, keys: list[str | None], materialized: list[bool]) -> str:
    """Why a reader of every partition reads fewer: most days of the partition range never had data.

    A downstream asset reads every partition from the partitions' start date to today; days on which nothing landed
    (or that have not run yet) have no file, and that is expected, not data lost.
    """
    read = [str(k) for k, m in zip(keys, materialized, strict=True) if m]
    shown = ", ".join(read) if len(read) <= 5 else f"{read[0]} .. {read[-1]}"
    return (
        f"{asset}: reading the {len(read)} materialized partition(s) ({shown}); the other "
        f"{len(keys) - len(read)} of the {len(keys)} partitions from {keys[0]} to {keys[-1]} were never "
        "materialized (no data landed on those days, or they have not run yet) and are skipped"
    )


def read_stored_artifact(
    data_root: str, asset: str, partition: str | None = None, results_root: str = ""
) -> BaseModel | None:
    """An artifact asset's value as this IO manager stored it under ``data_root``, or None if it never was: for an
    asset that may run before the artifact exists and says so itself (evaluation without a dataset)."""
    manager = NexaIOManager(data_root=data_root, results_root=results_root)
    path = manager._path(dg.AssetKey(asset), partition, "json")
    return _load_artifact(path, manager.roots()) if io.exists(path) else None


def stored_partitions(data_root: str, asset: str, partitions: list[str]) -> list[tuple[str, str]]:
    """``(partition, Parquet path)`` of the materialized ones among ``partitions``, in their order, unread: for a
    stage that streams a table's partitions from storage instead of loading them all into its process."""
    manager = NexaIOManager(data_root=data_root)
    paths = [(k, manager._path(dg.AssetKey(asset), k, "parquet")) for k in partitions]
    return [(k, p) for k, p in paths if io.exists(p)]


def _load_artifact(path: str, where: dict[str, str]) -> BaseModel:
    """The artifact at ``path`` with its paths under the roots as they are now (``where``)."""
    payload = io.read_json(path)
    module, _, name = payload["type"].rpartition(".")
    return getattr(importlib.import_module(module), name).model_validate(
        roots.localize(payload["data"], where)
    )


def written_schema(path: str) -> dg.TableSchema:
    """The column names and Arrow types of the Parquet file at ``path``, read from its footer."""
    with io.open_read(path) as f:
        schema = pq.read_schema(f)
    return dg.TableSchema(columns=[dg.TableColumn(name=field.name, type=str(field.type)) for field in schema])


def _column_lineage(context: dg.OutputContext) -> dict[str, Any]:
    """``dagster/column_lineage`` of the asset's definition metadata, for its materialization (none: empty)."""
    lineage = (context.definition_metadata or {}).get("dagster/column_lineage")
    return {"dagster/column_lineage": lineage} if lineage is not None else {}
