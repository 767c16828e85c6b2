"""Evaluation stage: every checkpoint (one partition each) gets held-out loss, perplexity, a judge score, a
pairwise win rate against production, and the promotion gate: a check whose decision model_deployment follows
(held back is a recorded warning, not a failure).
"""

from collections.abc import Callable
from pathlib import Path

import dagster as dg
import pandas as pd

from nexa_dagster.assets.common import MODEL_CALL_RETRY
from nexa_dagster.assets.llm_failures import no_retry_on_permanent_llm_errors
from nexa_dagster.assets.partitions import checkpoint_partitions
from nexa_dagster.assets.types import LeaderboardType
from nexa_dagster.core import storage as io
from nexa_dagster.core.artifacts import Checkpoint, EvalReport, SFTDataset
from nexa_dagster.core.config import load_scale, load_yaml, read_text
from nexa_dagster.core.evaluation import (
    evaluate_checkpoint,
    render_markdown,
    write_report,
)
from nexa_dagster.core.plots import loss_curve_png, markdown_image
from nexa_dagster.core.promotion import ProductionRegistry, decide, load_policy, report_metric
from nexa_dagster.core.tiny_model import COMPLETION_MARKER
from nexa_dagster.resources.io_manager import read_stored_artifact
from nexa_dagster.resources.llm import LLMResource
from nexa_dagster.resources.storage import StorageResource
from nexa_dagster.resources.tracking import TrackingResource

GATE = dg.AssetCheckSpec("beats_production", asset="eval_report", blocking=False,
                         description="Promotion gate (configs/promotion.yaml): the checkpoint beats the production "
                                     "model on the configured metric by the margin, or there is none yet. A "
                                     "checkpoint held back (a tie included) is a recorded decision, a warning, not "
                                     "a failed run: model_deployment then deploys nothing and is not materialized.")


# Eager, except that a checkpoint whose evaluation is missing (failed, or not run yet) does not hold the
# leaderboard back: plain eager() waits for every partition of eval_report, so one failed evaluation would freeze it.
LEADERBOARD_CONDITION = dg.AutomationCondition.eager().without(~dg.AutomationCondition.any_deps_missing())


def load_checkpoint_record(ckpt_dir: Path, checkpoint_id: str) -> Checkpoint:
    """The checkpoint's own record, or a minimal one for a checkpoint copied into the store by hand.

    The record is read for its lineage, never for where the model is: a folder copied from another data root or
    host carries the absolute path it was written at, so the model is always the folder it was found in."""
    if not (ckpt_dir / COMPLETION_MARKER).exists():
        raise dg.Failure(f"checkpoint {ckpt_dir} is not complete (no {COMPLETION_MARKER} marker)", allow_retries=False)
    record = ckpt_dir / "checkpoint.json"
    try:
        if record.exists():
            return Checkpoint.model_validate({**io.read_json(record), "path": str(ckpt_dir)})
        job, summary = ckpt_dir / "training_job.json", ckpt_dir / "training_summary.json"
        if job.exists() and summary.exists():
            # written by the training worker before its completion marker, so always there for our own
            # checkpoints (checkpoint.json, with the MLflow ids, follows a moment later from the training asset)
            j, r = io.read_json(job), io.read_json(summary)
            return Checkpoint(checkpoint_id=checkpoint_id, path=str(ckpt_dir), num_steps=r["steps"],
                              training_loss=r["final_loss"], validation_loss=r["validation_loss"],
                              dataset_run_hash=j.get("dataset_run_hash") or None,
                              dataset_validation_path=j["validation_path"], model_preset=j["model_preset"],
                              parent=j.get("parent"))
        return Checkpoint(checkpoint_id=checkpoint_id, path=str(ckpt_dir), num_steps=0)  # copied in by hand
    except ValueError as error:  # pydantic's ValidationError: no config.json or weights in the folder
        raise dg.Failure(f"checkpoint {checkpoint_id} in {ckpt_dir} cannot be evaluated: {error}",
                         allow_retries=False) from error


def evaluation_data(ckpt: Checkpoint, storage: StorageResource, log: Callable[[str], None]) -> tuple[str, str]:
    """(validation split, dataset run hash) to evaluate on: the split the checkpoint was trained with when it exists
    here, else the validation split of this data root's latest ``sft_dataset`` (a checkpoint copied in by hand, or
    from another data root); a clear failure, not retried, when this data root has no dataset at all."""
    own = ckpt.dataset_validation_path
    if own and io.exists(own):
        return own, ckpt.dataset_run_hash or ""
    current = read_stored_artifact(storage.data_root, "sft_dataset")
    if not isinstance(current, SFTDataset):
        raise dg.Failure(
            f"no evaluation data for checkpoint {ckpt.checkpoint_id}: "
            + (f"the validation split its record names ({own}) is not on this machine, and " if own else "")
            + f"no sft_dataset has been materialized under {storage.root}. Materialize it first (`dagster asset "
            "materialize -m nexa_dagster.definitions --select sft_dataset`, after the daily data), then "
            f"evaluate again: `dagster asset materialize -m nexa_dagster.definitions --select "
            f"eval_report,model_deployment --partition {ckpt.checkpoint_id}`.", allow_retries=False)
    if own:
        log(f"{ckpt.checkpoint_id}: its validation split {own} is not here; evaluating on this data root's "
            f"sft_dataset {current.run_hash}")
    return current.validation_path, current.run_hash


def loss_curve_markdown(ckpt: Checkpoint) -> str | None:
    metrics = Path(ckpt.path) / "metrics.jsonl"
    if not metrics.exists():
        return None
    rows = pd.read_json(metrics, lines=True)
    png = loss_curve_png(list(zip(rows["step"], rows["loss"], strict=True)), ckpt.checkpoint_id, ckpt.validation_loss)
    return markdown_image(png, "training loss")


@dg.asset(
    group_name="evaluation",
    partitions_def=checkpoint_partitions,
    retry_policy=MODEL_CALL_RETRY,
    deps=["moe_checkpoint", "sft_dataset"],  # sft_dataset is read only when the checkpoint's own split is not here
    check_specs=[GATE],
    kinds={"pytorch", "markdown"},
    description="Held-out loss and perplexity on the validation split the checkpoint was trained with, the "
                "judge's mean score of its answers to the fixed held-out prompts and, when a production model "
                "exists, the judge's pairwise win rate against it; JSON + Markdown report in "
                "results/evaluation/reports/<checkpoint_id>/.",
)
def eval_report(context: dg.AssetExecutionContext, judge_llm: LLMResource, storage: StorageResource,
                tracking: TrackingResource):
    checkpoint_id = context.partition_key
    ckpt_dir = storage.checkpoint_dir(checkpoint_id)
    if not ckpt_dir.exists():  # registered in the MLflow model registry from elsewhere
        source = tracking.registered_checkpoints(load_policy().registered_model).get(checkpoint_id)
        ckpt_dir = Path(source) if source else ckpt_dir
    ckpt = load_checkpoint_record(ckpt_dir, checkpoint_id)
    validation_path, dataset_hash = evaluation_data(ckpt, storage, context.log.info)
    scale = load_scale()
    production = ProductionRegistry(storage.production_pointer()).current()
    compare_with = production if (production is not None and production.checkpoint_id != checkpoint_id
                                  and Path(production.checkpoint_path).exists()) else None

    with (no_retry_on_permanent_llm_errors(f"judge {judge_llm.describe()['base_url'] or judge_llm.model}"),
          judge_llm.get_client() as judge):
        evaluation = evaluate_checkpoint(
            checkpoint_id, ckpt.path, validation_path,
            list(load_yaml("prompts/eval_prompts.yaml"))[: scale.evaluation.num_heldout_prompts],
            judge, read_text("prompts/judge.jinja"), scale.evaluation.max_new_tokens,
            production_path=compare_with.checkpoint_path if compare_with else None, log=context.log.info)
    result, win_rate = evaluation.result, evaluation.win_rate_vs_production
    loss, answers = result.loss, result.answers
    lineage = {"checkpoint_path": ckpt.path, "dataset_run_hash": dataset_hash, "validation_path": validation_path,
               "model_preset": ckpt.model_preset, "scale": ckpt.scale, "training_steps": ckpt.num_steps,
               "training_run_id": ckpt.training_run_id, "training_mlflow_run_id": ckpt.mlflow_run_id,
               "parent": ckpt.parent, "dagster_run_id": context.run.run_id}
    json_path, md_path = write_report(result, {**lineage, "win_rate_vs_production": win_rate},
                                      storage.report_dir(checkpoint_id))

    with tracking.start_run(run_name=f"eval-{checkpoint_id}", tags={"stage": "evaluation",
                                                                     "checkpoint_id": checkpoint_id}) as run:
        run.log_params(lineage)
        run.log_metrics({"validation_loss": loss.loss, "perplexity": loss.perplexity,
                         "judge_score": result.judge_score, "win_rate_vs_production": win_rate})

    report = EvalReport(
        checkpoint_id=checkpoint_id, checkpoint_path=ckpt.path, validation_loss=loss.loss,
        perplexity=loss.perplexity, validation_tokens=loss.tokens, judge_score=result.judge_score,
        judge_method=answers[0].method if answers else None, num_heldout_prompts=len(answers),
        dataset_run_hash=dataset_hash, win_rate_vs_production=win_rate,
        production_checkpoint_id=production.checkpoint_id if production else None,
        report_json=json_path, report_markdown=md_path, parent=ckpt.parent,
    )
    curve = loss_curve_markdown(ckpt)
    yield dg.Output(report, metadata={
        "validation_loss": round(loss.loss, 4),
        "perplexity": round(loss.perplexity, 2),
        "validation_tokens": loss.tokens,
        "judge_score": round(result.judge_score, 3) if result.judge_score is not None else None,
        "judge_method": report.judge_method,
        "win_rate_vs_production": round(win_rate, 3) if win_rate is not None else None,
        "production_checkpoint": report.production_checkpoint_id,
        "dataset_run_hash": dataset_hash,
        "parent": ckpt.parent or "",
        "report": dg.MetadataValue.md(render_markdown(result, lineage)),
        "report_json": dg.MetadataValue.path(json_path),
        **({"loss_curve": dg.MetadataValue.md(curve)} if curve else {}),
    })

    policy = load_policy()
    decision = decide(checkpoint_id, report_metric(report, policy.metric), production, policy)
    context.log.info(f"promotion gate for {checkpoint_id}: {'pass' if decision.passed else 'fail'} "
                     f"({decision.reason})")
    yield dg.AssetCheckResult(check_name="beats_production", passed=decision.passed,
                              severity=dg.AssetCheckSeverity.WARN,  # held back is a decision, not an outage
                              metadata={"decision": "promote" if decision.passed else "hold back",
                                        "reason": decision.reason, "metric": policy.metric,
                                        "candidate": decision.candidate, "production": decision.production})


@dg.asset(
    group_name="evaluation",
    ins={"eval_report": dg.AssetIn()},
    dagster_type=LeaderboardType,
    automation_condition=LEADERBOARD_CONDITION,
    kinds={"csv", "markdown"},
    description="One row per evaluated checkpoint (metrics, dataset, date, whether it is in production), best "
                "first; a Markdown table in the UI and results/evaluation/leaderboard.csv.",
)
def leaderboard(context: dg.AssetExecutionContext, eval_report: dict[str, EvalReport],
                storage: StorageResource) -> pd.DataFrame:
    production = ProductionRegistry(storage.production_pointer()).current()
    rows = [{
        "checkpoint_id": r.checkpoint_id, "validation_loss": r.validation_loss, "perplexity": r.perplexity,
        "judge_score": r.judge_score, "win_rate_vs_production": r.win_rate_vs_production,
        "dataset_run_hash": r.dataset_run_hash or "", "parent": r.parent or "", "evaluated_at": r.created_at,
        "in_production": production is not None and production.checkpoint_id == r.checkpoint_id,
    } for r in eval_report.values()]
    board = pd.DataFrame(rows).sort_values("validation_loss").reset_index(drop=True)
    csv_path = io.join(storage.results_path("evaluation"), "leaderboard.csv")
    io.write_text(board.to_csv(index=False), csv_path)
    context.add_output_metadata({
        "dagster/row_count": len(board),
        "leaderboard": dg.MetadataValue.md(board.to_markdown(index=False, floatfmt=".4f")),
        "csv": dg.MetadataValue.path(csv_path),
        "production": production.checkpoint_id if production else None,
    })
    return board
