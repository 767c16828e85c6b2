"""Asset checks on the stages that had none: a red or yellow light on each asset page, and, where a bad output must
not flow on, a blocking check that stops the run before the next stage reads it.

* ``raw_documents``: the day brings documents not ingested on an earlier day (blocking: a landing folder
  re-delivered under a new date must not be answered and trained on twice). ``read_day`` already guarantees the
  day's rows are of that day, not empty and within the preset's cap, so no check says it again.
* ``filtered_samples`` has none of its own here: SampleGate's heuristics turn away every generation error and blank
  answer (``min_response_chars`` is at least 1), so a check for them could never fail; its pass-rate band check
  lives beside it (``pass_rate_in_band``).
* ``eval_set``: the frozen files match the SHA-256s of their manifest and the frozen marker (blocking: every report
  compares checkpoints on the eval set's hash; a changed file makes the comparison meaningless). In a run,
  ``eval_set`` itself refuses a damaged version before the check runs; the check is what a check-only run
  (the asset page's "Execute" of its checks) answers about the files now, and what automation waits on.
* ``leaderboard``: lists every checkpoint whose evaluation the instance recorded (a warning).
* ``model_deployment``: the production pointer names a complete checkpoint directory (an error: serving would fail).

The checks of packaging, training and evaluation's promotion gate live beside their assets; the preference stage's
are its own.
"""

from pathlib import Path

import dagster as dg
import pandas as pd

from nexa_dagster.assets.partitions import daily_partitions
from nexa_dagster.core.common import storage as io
from nexa_dagster.core.common.artifacts import COMPLETION_MARKER
from nexa_dagster.core.data.table_checks import redelivered_days
from nexa_dagster.core.evaluation.eval_set import EvalSetDamaged, load_eval_set
from nexa_dagster.core.evaluation.promotion import ProductionRegistry
from nexa_dagster.resources.configs import EvalSetsResource
from nexa_dagster.resources.storage import StorageResource


@dg.asset_check(
    asset="raw_documents",
    blocking=True,
    partitions_def=daily_partitions,
    description="The day brings new documents: not every one of them was already ingested on an earlier day (a "
    "landing folder re-delivered under a new date).",
)
def raw_documents_are_new(
    context: dg.AssetCheckExecutionContext, raw_documents: pd.DataFrame, storage: StorageResource
) -> dg.AssetCheckResult:
    first = min(context.op_execution_context.partition_keys)
    earlier = {}  # the days stored before this run's first (the IO manager's files), their doc_ids only
    for path in io.glob(storage.path("assets", "raw_documents", "*.parquet")):
        if Path(path).stem < first:
            with io.open_read(path) as f:
                earlier[Path(path).stem] = set(pd.read_parquet(f, columns=["doc_id"])["doc_id"])
    problems = redelivered_days(raw_documents, earlier)
    return dg.AssetCheckResult(
        passed=not problems,
        description="; ".join(problems) or None,
        metadata={"earlier_days": len(earlier), "rows": len(raw_documents)},
    )


@dg.asset_check(
    asset="eval_set",
    blocking=True,
    description="The frozen version's files match the SHA-256s its manifest and its frozen marker recorded.",
)
def eval_set_matches_its_manifest(
    storage: StorageResource, eval_sets: EvalSetsResource
) -> dg.AssetCheckResult:
    try:
        manifest = load_eval_set(storage.path("eval_sets"), eval_sets.version)
    except (EvalSetDamaged, FileNotFoundError) as e:
        return dg.AssetCheckResult(passed=False, description=str(e), metadata={"version": eval_sets.version})
    return dg.AssetCheckResult(
        passed=True, metadata={"version": eval_sets.version, "content_sha256": manifest["content_sha256"]}
    )


@dg.asset_check(
    asset="leaderboard",
    description="Every checkpoint whose evaluation (eval_report) the instance recorded has a row.",
)
def leaderboard_lists_every_evaluation(
    context: dg.AssetCheckExecutionContext, leaderboard: pd.DataFrame
) -> dg.AssetCheckResult:
    evaluated = context.instance.get_materialized_partitions(dg.AssetKey("eval_report"))
    missing = sorted(evaluated - set(leaderboard["checkpoint_id"]))
    return dg.AssetCheckResult(
        passed=not missing,
        severity=dg.AssetCheckSeverity.WARN,
        description=f"{len(missing)} evaluated checkpoints missing: {missing[:10]}" if missing else None,
        metadata={"evaluated": len(evaluated), "rows": len(leaderboard)},
    )


@dg.asset_check(
    asset="model_deployment",
    description="The production pointer names a checkpoint directory that is complete (its _COMPLETE marker).",
)
def production_checkpoint_is_complete(storage: StorageResource) -> dg.AssetCheckResult:
    production = ProductionRegistry(storage.production_pointer()).current()
    if production is None:
        return dg.AssetCheckResult(passed=True, description="no production model (nothing promoted yet)")
    path = production.checkpoint_path
    complete = (Path(path) / COMPLETION_MARKER).is_file()
    return dg.AssetCheckResult(
        passed=complete,
        description=None
        if complete
        else f"production {production.checkpoint_id}: {path} is not a complete checkpoint",
        metadata={"checkpoint_id": production.checkpoint_id, "path": dg.MetadataValue.path(path)},
    )
