"""``production_model``: the checkpoint in production, as an asset with a history of events.

The production pointer (``serving/production.json``) is written by ``model_deployment`` (a promotion) and by
``nexa-dagster rollback``; each change also records an ``AssetMaterialization`` of ``production_model`` (reported
from the deployment run, or runless from the command line) whose data version is the checkpoint id now in production.
A materialization, not an observation: Dagster's staleness reads an external asset's data version from its latest
materialization (observations count only for observable source assets, which this is not).

So the asset's page in the UI lists every promotion and rollback (which checkpoint, which one before, why), and
Dagster's staleness follows production: an asset that depends on it (``preference_pairs``, ``preference_dataset``,
``preference_checkpoint``) recorded the production checkpoint it was made from as its input data version, and is
shown stale ("has a new dependency data version") once another
checkpoint is promoted or production is rolled back.

It stays an external asset, not an output of ``model_deployment``: the lifecycle is a loop (preference_checkpoint ->
eval_report -> model_deployment -> the next preference run), which an asset graph cannot hold, and a rollback
happens outside any run.
"""

from __future__ import annotations

from typing import Literal

import dagster as dg

from nexa_dagster.core.evaluation.promotion import ProductionEntry

PRODUCTION_MODEL = "production_model"
# Dagster's own tags: what an event's data version is, and that this project, not Dagster, chose it
DATA_VERSION_TAG = "dagster/data_version"
USER_PROVIDED_TAG = "dagster/data_version_is_user_provided"

Change = Literal["promotion", "rollback"]

production_model_asset = dg.AssetSpec(
    PRODUCTION_MODEL,
    group_name="preference",
    kinds={"json"},
    description="The checkpoint in production: serving/production.json under the data root, written by "
    "model_deployment when the gate promotes a checkpoint (an SFT one, or an earlier DPO one) and by "
    "`nexa-dagster rollback`; each change is a materialization here whose data version is the checkpoint id. The "
    "preference stage answers with it, packs for it and trains from it (and goes stale when it changes).",
)


def production_change(
    entry: ProductionEntry, change: Change, previous: str | None
) -> dg.AssetMaterialization:
    """The event of ``entry`` becoming production (by ``change``; ``previous``: the checkpoint it replaced)."""
    return dg.AssetMaterialization(
        asset_key=PRODUCTION_MODEL,
        description=f"{change}: {entry.checkpoint_id} is production (was {previous or 'none'})",
        tags={DATA_VERSION_TAG: entry.checkpoint_id, USER_PROVIDED_TAG: "true"},
        metadata={
            "checkpoint_id": entry.checkpoint_id,
            "change": change,
            "previous_checkpoint": previous or "none",
            "checkpoint_path": dg.MetadataValue.path(entry.checkpoint_path),
            "eval_loss_when_promoted": entry.value,
            "eval_set_version": entry.eval_set_version,
            "mlflow_version": entry.mlflow_version or "none",
        },
    )


def report_production_change(
    instance: dg.DagsterInstance, entry: ProductionEntry, change: Change, previous: str | None
) -> None:
    """Record a change made outside a run (a rollback from the command line) on the instance."""
    instance.report_runless_asset_event(production_change(entry, change, previous))


def production_metadata(entry: ProductionEntry) -> dict[str, str]:
    """What an asset made from the production model says about it (its lineage, beside the input data version
    Dagster records)."""
    return {"production_checkpoint": entry.checkpoint_id}
