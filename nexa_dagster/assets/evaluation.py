"""Evaluation stage: every checkpoint (one partition each) is scored on the frozen eval set together with the
production model, in the evaluation worker on the GPU cluster (never in the Dagster process); the judge scores its
answers and compares them with production's in both orders; the promotion gate, a check whose decision
model_deployment follows (held back is a recorded warning, not a failure), decides on the paired difference and its
confidence interval whether it is served.
"""

from pathlib import Path

import dagster as dg
import pandas as pd

from nexa_dagster.assets.common import MODEL_CALL_RETRY, no_retry_on_permanent_llm_errors
from nexa_dagster.assets.partitions import checkpoint_partitions
from nexa_dagster.assets.types import LeaderboardType
from nexa_dagster.core.common import storage as io
from nexa_dagster.core.common.artifacts import COMPLETION_MARKER, BaseModelEval, Checkpoint, EvalReport
from nexa_dagster.core.common.config import pipeline_config, read_text, resolve_path
from nexa_dagster.core.common.plots import loss_curve_png, markdown_image
from nexa_dagster.core.evaluation.benchmarks import BenchmarkError, compare_benchmark, flat_scores
from nexa_dagster.core.evaluation.eval_set import eval_prompts, load_eval_set
from nexa_dagster.core.evaluation.promotion import GateDecision, ProductionRegistry, decide, load_policy
from nexa_dagster.core.evaluation.scoring import (
    CheckpointEvaluation,
    ModelScores,
    compare,
    write_report,
)
from nexa_dagster.core.evaluation.worker import EvaluationJob
from nexa_dagster.resources.gpu_cluster import GPUClusterResource
from nexa_dagster.resources.io_manager import MISSING_OK
from nexa_dagster.resources.llm import LLMResource
from nexa_dagster.resources.scale import ScaleResource
from nexa_dagster.resources.storage import StorageResource
from nexa_dagster.resources.tracking import TrackingResource

GATE = dg.AssetCheckSpec("beats_production", asset="eval_report", blocking=False,
                         description="Promotion gate (configs/promotion.yaml): on the same frozen eval set, the "
                                     "checkpoint beats the production model on the configured metric (paired "
                                     "eval-set loss or order-consistent judge win rate) by the margin, its "
                                     "confidence interval included, or there is none yet. A checkpoint held back "
                                     "(a tie included) is a recorded decision, a warning, not a failed run: "
                                     "model_deployment then deploys nothing and is not materialized.")


# Eager, except that a checkpoint whose evaluation is missing (failed, or not run yet) does not hold the
# leaderboard back: plain eager() waits for every partition of eval_report, so one failed evaluation would freeze it.
LEADERBOARD_CONDITION = dg.AutomationCondition.eager().without(~dg.AutomationCondition.any_deps_missing())


def load_checkpoint_record(ckpt_dir: Path, checkpoint_id: str) -> Checkpoint:
    """The checkpoint's own record, or a minimal one for a checkpoint copied into the store by hand.

    The record is read for its lineage, never for where the model is or what it is called: a folder copied from
    another data root or host carries the absolute path it was written at, and a copy beside its original carries
    the original's id, so the model is always the folder it was found in and its id the folder's name (the
    partition). Under the record's id, a copy's report would overwrite the original's and the leaderboard would
    hold one id twice."""
    if not (ckpt_dir / COMPLETION_MARKER).exists():
        raise dg.Failure(f"checkpoint {ckpt_dir} is not complete (no {COMPLETION_MARKER} marker)", allow_retries=False)
    record = ckpt_dir / "checkpoint.json"
    try:
        if record.exists():
            return Checkpoint.model_validate({**io.read_json(record), "path": str(ckpt_dir),
                                              "checkpoint_id": checkpoint_id})
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


def frozen_eval_set(storage: StorageResource, version: int, checkpoint_id: str) -> dict:
    """The manifest of eval set ``version`` in this data root: all a checkpoint needs besides itself (it may have
    been copied in from anywhere); a clear failure, not retried, naming what to materialize when there is none."""
    try:
        return load_eval_set(storage.path("eval_sets"), version)
    except FileNotFoundError:
        raise dg.Failure(
            f"no eval set v{version} to evaluate checkpoint {checkpoint_id} on: none has been frozen under "
            f"{storage.path('eval_sets')}. Materialize it first (`dagster asset materialize -m "
            "nexa_dagster.definitions --select eval_set`, after the daily data; training_job does it too), then "
            "evaluate again: `dagster asset materialize -m nexa_dagster.definitions --select "
            f"eval_report,model_deployment --partition {checkpoint_id}`.", allow_retries=False) from None
    except ValueError as error:  # a frozen file was edited
        raise dg.Failure(str(error), allow_retries=False) from error


def loss_curve_markdown(ckpt: Checkpoint) -> str | None:
    metrics = Path(ckpt.path) / "metrics.jsonl"
    if not metrics.exists():
        return None
    rows = pd.read_json(metrics, lines=True)
    png = loss_curve_png(list(zip(rows["step"], rows["loss"], strict=True)), ckpt.checkpoint_id, ckpt.validation_loss)
    return markdown_image(png, "training loss")


def production_to_compare(storage: StorageResource, checkpoint_id: str, log) -> tuple[object, str | None]:
    """(production entry or None, the directory to score it from or None when it is this checkpoint or unreadable)."""
    production = ProductionRegistry(storage.production_pointer()).current()
    if production is None or production.checkpoint_id == checkpoint_id:
        return production, None
    if not Path(production.checkpoint_path).exists():
        log(f"production {production.checkpoint_id} is not readable at {production.checkpoint_path}: the gate has "
            "nothing to compare with and holds the checkpoint back")
        return production, None
    return production, production.checkpoint_path


@dg.asset(
    group_name="evaluation",
    partitions_def=checkpoint_partitions,
    pool="gpu",
    retry_policy=MODEL_CALL_RETRY,
    deps=["moe_checkpoint", "eval_set"],
    check_specs=[GATE],
    kinds={"pytorch", "markdown"},
    description="The checkpoint and the production model scored on the same frozen eval set (eval_set.version) "
                "in the evaluation worker on the GPU cluster: per-example loss, perplexity, answers to the eval "
                "set's questions; the judge's mean score and its pairwise preference in both answer orders; the "
                "paired difference with its bootstrap interval; JSON + Markdown report in "
                "results/evaluation/reports/<checkpoint_id>/.",
)
def eval_report(context: dg.AssetExecutionContext, judge_llm: LLMResource, gpu_cluster: GPUClusterResource,
                storage: StorageResource, tracking: TrackingResource, scale_preset: ScaleResource):
    checkpoint_id = context.partition_key
    ckpt_dir = storage.checkpoint_dir(checkpoint_id)
    if not ckpt_dir.exists():  # registered in the MLflow model registry from elsewhere
        source = tracking.registered_checkpoints(load_policy().registered_model).get(checkpoint_id)
        ckpt_dir = Path(source) if source else ckpt_dir
    ckpt = load_checkpoint_record(ckpt_dir, checkpoint_id)
    scale, policy, version = scale_preset.load(), load_policy(), pipeline_config().eval_set.version
    eval_set = frozen_eval_set(storage, version, checkpoint_id)
    prompts = eval_prompts(eval_set, scale.evaluation.num_heldout_prompts)
    production, production_path = production_to_compare(storage, checkpoint_id, context.log.warning)

    work_dir = io.local_dir(storage.path("runs", f"eval-{checkpoint_id}"))
    bench = scale.evaluation.benchmarks  # the worker runs in work_dir: its task folders must be absolute
    bench = bench.model_copy(update={"include_path": [str(resolve_path(p)) for p in bench.include_path]})
    job = EvaluationJob(run_id=checkpoint_id, models={"candidate": ckpt.path,
                                                      **({"production": production_path} if production_path else {})},
                        examples_path=eval_set["path"], eval_set_version=version, prompts=prompts,
                        max_new_tokens=scale.evaluation.max_new_tokens, accelerator=gpu_cluster.accelerator,
                        output_path=str(work_dir / "scores.json"), benchmarks=bench if bench.tasks else None,
                        # production's benchmark scores cost a second harness run: only when the gate needs them
                        benchmark_roles=["candidate", "production"] if policy.benchmark else ["candidate"])
    scores = gpu_cluster.run_evaluation(context, job, work_dir)["scores"]
    with (no_retry_on_permanent_llm_errors(f"judge {judge_llm.where()}"),
          judge_llm.get_client() as judge):
        evaluation = compare(checkpoint_id, version, ModelScores.from_json(scores["candidate"]),
                             ModelScores.from_json(scores["production"]) if "production" in scores else None,
                             prompts, judge, read_text("prompts/judge.jinja"), policy.confidence,
                             policy.bootstrap_resamples, log=context.log.info)
    benchmark = None
    if policy.benchmark and evaluation.production is not None:
        try:
            benchmark = compare_benchmark(policy.metric, evaluation.candidate.benchmarks,
                                          evaluation.production.benchmarks, policy.confidence)
        except BenchmarkError as error:  # e.g. a metric the task does not report: configs/promotion.yaml
            raise dg.Failure(f"promotion gate metric {policy.metric}: {error}", allow_retries=False) from error
    decision = decide(checkpoint_id, production, policy, evaluation.paired_loss, evaluation.win_rate, benchmark)
    report = _report(context, ckpt, evaluation, decision, production.checkpoint_id if production else None,
                     eval_set, storage, tracking)
    curve = loss_curve_markdown(ckpt)
    result, win = evaluation.result, evaluation.win_rate
    yield dg.Output(report, metadata={
        "eval_set_version": version,
        "eval_loss": round(result.loss.loss, 4),
        "perplexity": round(result.loss.perplexity, 2),
        "eval_examples": result.loss.sequences,
        "eval_tokens": result.loss.tokens,
        "validation_loss": ckpt.validation_loss,
        "judge_score": round(result.judge_score, 3) if result.judge_score is not None else None,
        "judge_method": report.judge_method,
        "win_rate_vs_production": round(win.rate.estimate, 3) if win else None,
        "production_checkpoint": report.production_checkpoint_id,
        "production_eval_loss": report.production_eval_loss,
        "eval_loss_difference": report.eval_loss_difference,
        "gate_decision": report.gate_decision,
        "dataset_run_hash": ckpt.dataset_run_hash,
        "parent": ckpt.parent or "",
        "report": dg.MetadataValue.md(_read_text(report.report_markdown)),
        "report_json": dg.MetadataValue.path(report.report_json),
        **{f"benchmark/{k}": v for k, v in flat_scores(result.benchmarks).items()},
        **({"loss_curve": dg.MetadataValue.md(curve)} if curve else {}),
    })

    context.log.info(f"promotion gate for {checkpoint_id}: {'pass' if decision.passed else 'fail'} "
                     f"({decision.reason})")
    yield dg.AssetCheckResult(check_name="beats_production", passed=decision.passed,
                              severity=dg.AssetCheckSeverity.WARN,  # held back is a decision, not an outage
                              metadata={
        "metric": policy.metric, "margin": policy.margin, "require_interval": policy.require_interval,
        "confidence": policy.confidence, "eval_set_version": version,
        "production_checkpoint": report.production_checkpoint_id, **gate_metadata(decision, evaluation)})


def _read_text(path: str) -> str:
    with io.open_read(path) as f:
        return f.read().decode("utf-8")


def gate_metadata(decision: GateDecision, evaluation: CheckpointEvaluation) -> dict[str, object]:
    """Both models' values, the difference and its interval, for the configured metric and the other one."""
    meta: dict[str, object] = dict(decision.metadata())
    if evaluation.paired_loss is not None:
        p = evaluation.paired_loss
        meta.update({"candidate_eval_loss": p.candidate, "production_eval_loss": p.production,
                     "eval_loss_difference": p.difference.estimate,
                     "eval_loss_difference_interval": [p.difference.low, p.difference.high],
                     "examples": p.examples})
    if evaluation.win_rate is not None:
        w = evaluation.win_rate
        meta.update({"win_rate": w.rate.estimate, "win_rate_interval": [w.rate.low, w.rate.high],
                     "judge_wins": w.wins, "judge_losses": w.losses, "judge_order_inconsistent": w.inconsistent})
    return {k: (dg.MetadataValue.json(v) if isinstance(v, list) else v) for k, v in meta.items()}


def _report(context: dg.AssetExecutionContext, ckpt: Checkpoint, evaluation: CheckpointEvaluation,
            decision: GateDecision, production_id: str | None, eval_set: dict, storage: StorageResource,
            tracking: TrackingResource) -> EvalReport:
    """Write the JSON/Markdown report and the MLflow run; return the report artifact."""
    result, paired, win = evaluation.result, evaluation.paired_loss, evaluation.win_rate
    checkpoint_id = ckpt.checkpoint_id
    lineage = {"checkpoint_path": ckpt.path, "dataset_run_hash": ckpt.dataset_run_hash,
               "eval_set_version": evaluation.eval_set_version,
               "eval_set_sha256": eval_set["files"]["examples.parquet"], "model_preset": ckpt.model_preset,
               "scale": ckpt.scale, "training_steps": ckpt.num_steps, "training_run_id": ckpt.training_run_id,
               "training_mlflow_run_id": ckpt.mlflow_run_id, "parent": ckpt.parent,
               "dagster_run_id": context.run.run_id}
    json_path, md_path = write_report(result, {
        **lineage, "production_checkpoint": production_id,
        "paired_loss": paired.to_json() if paired else None, "win_rate": win.to_json() if win else None,
        "gate": decision.metadata()}, storage.report_dir(checkpoint_id))
    with tracking.start_run(run_name=f"eval-{checkpoint_id}", tags={"stage": "evaluation",
                                                                     "checkpoint_id": checkpoint_id}) as run:
        run.log_params(lineage)
        run.log_metrics({"eval_loss": result.loss.loss, "perplexity": result.loss.perplexity,
                         "judge_score": result.judge_score,
                         "win_rate_vs_production": win.rate.estimate if win else None,
                         "eval_loss_difference": paired.difference.estimate if paired else None,
                         **{f"benchmark/{k}": v for k, v in flat_scores(result.benchmarks).items()}})
        run.log_stored_file(json_path, "report.json")
        run.log_stored_file(md_path, "report.md")
    answers = result.answers
    return EvalReport(
        checkpoint_id=checkpoint_id, checkpoint_path=ckpt.path, eval_set_version=evaluation.eval_set_version,
        eval_loss=result.loss.loss, eval_examples=result.loss.sequences, eval_tokens=result.loss.tokens,
        perplexity=result.loss.perplexity, validation_loss=ckpt.validation_loss, judge_score=result.judge_score,
        judge_method=answers[0].method if answers else None, num_heldout_prompts=len(answers),
        dataset_run_hash=ckpt.dataset_run_hash, win_rate_vs_production=win.rate.estimate if win else None,
        production_checkpoint_id=production_id, production_eval_loss=paired.production if paired else None,
        eval_loss_difference=paired.difference.estimate if paired else None,
        eval_loss_difference_interval=(paired.difference.low, paired.difference.high) if paired else None,
        win_rate_interval=(win.rate.low, win.rate.high) if win else None,
        gate_decision=decision.metadata()["decision"], gate_reason=decision.reason, report_json=json_path,
        report_markdown=md_path, parent=ckpt.parent, benchmarks=result.benchmarks,
        production_benchmarks=result.production_benchmarks)


@dg.asset(
    group_name="evaluation",
    ins={"eval_report": dg.AssetIn(), "base_model_eval": dg.AssetIn(metadata={MISSING_OK: True})},
    dagster_type=LeaderboardType,
    automation_condition=LEADERBOARD_CONDITION,
    kinds={"csv", "markdown"},
    description="One row per evaluated checkpoint (eval-set version, metrics, the paired difference with the "
                "production model of its day and the gate's decision, dataset, date, whether it is in production), "
                "and per evaluated base model (stage base: loss on the eval set's frozen corpus documents), best "
                "first within an eval-set version and stage; a Markdown table in the UI and "
                "results/evaluation/leaderboard.csv.",
)
def leaderboard(context: dg.AssetExecutionContext, eval_report: dict[str, EvalReport],
                base_model_eval: dict[str, BaseModelEval], storage: StorageResource) -> pd.DataFrame:
    production = ProductionRegistry(storage.production_pointer()).current()
    rows = [{
        "checkpoint_id": r.checkpoint_id, "stage": "sft", "eval_set_version": r.eval_set_version,
        "eval_loss": r.eval_loss,
        "perplexity": r.perplexity, "judge_score": r.judge_score,
        "win_rate_vs_production": r.win_rate_vs_production, "vs_production": r.production_checkpoint_id or "",
        "eval_loss_difference": r.eval_loss_difference, "gate": r.gate_decision or "",
        "dataset_run_hash": r.dataset_run_hash or "", "parent": r.parent or "", "evaluated_at": r.created_at,
        "in_production": production is not None and production.checkpoint_id == r.checkpoint_id,
        **flat_scores(r.benchmarks),  # one column per benchmark metric and its standard error
    } for r in eval_report.values()]
    # base models: measured on the version's frozen corpus documents, not on its SFT samples (a stage of its own)
    rows += [{"checkpoint_id": r.checkpoint_id, "stage": "base", "eval_set_version": r.eval_set_version,
              "eval_loss": r.loss, "eval_loss_interval": f"[{r.loss_interval[0]:.4f}, {r.loss_interval[1]:.4f}]",
              "perplexity": r.perplexity, "dataset_run_hash": r.corpus_run_hash or "", "parent": "scratch",
              "evaluated_at": r.created_at, "in_production": False} for r in base_model_eval.values()]
    # rows of one eval-set version and stage are comparable: the newest version first, SFT checkpoints before
    # base models, best loss first within them
    board = pd.DataFrame(rows).astype({"eval_set_version": "Int64"}).sort_values(
        ["eval_set_version", "stage", "eval_loss"], ascending=[False, False, True],
        na_position="last").reset_index(drop=True)
    csv_path = io.join(storage.results_path("evaluation"), "leaderboard.csv")
    io.write_text(board.to_csv(index=False), csv_path)
    context.add_output_metadata({
        "dagster/row_count": len(board),
        "leaderboard": dg.MetadataValue.md(board.to_markdown(index=False, floatfmt=".4f")),
        "csv": dg.MetadataValue.path(csv_path),
        "production": production.checkpoint_id if production else None,
    })
    return board
