"""One evaluation, one record: the ``EvalReport`` built once from what was measured and decided.

The report's files (``report.json``, ``report.md``), the asset's metadata, the MLflow metrics and the leaderboard
row are all derived from that one record (``report_figures``, ``mlflow_metrics``, ``leaderboard_row``), so a figure
has one name and one value everywhere a person reads it. ``read_checkpoint`` is the other half: which checkpoint
was measured, from the record in its folder (our own, or a folder copied in by hand).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from nexa_dagster.core.common import roots, storage
from nexa_dagster.core.common.artifacts import COMPLETION_MARKER, BaseModelEval, Checkpoint, EvalReport
from nexa_dagster.core.evaluation.benchmarks import flat_scores
from nexa_dagster.core.evaluation.promotion import GateDecision
from nexa_dagster.core.evaluation.scoring import CheckpointEvaluation, write_report


def read_checkpoint(ckpt_dir: Path, checkpoint_id: str, data_root: str | None = None) -> Checkpoint:
    """The checkpoint's own record, or a minimal one for a checkpoint copied into the store by hand.

    The record is read for its lineage, never for where the model is or what it is called: a folder copied from
    another data root or host carries the absolute path it was written at, and a copy beside its original carries
    the original's id, so the model is always the folder it was found in and its id the folder's name (the
    partition). Under the record's id, a copy's report would overwrite the original's and the leaderboard would
    hold one id twice. The dataset path it names (relative to the data root it was trained in, or absolute in older
    records) is resolved under ``data_root``. Raises ``ValueError`` (naming the folder) for an incomplete or
    unloadable checkpoint."""
    if not (ckpt_dir / COMPLETION_MARKER).exists():
        raise ValueError(f"checkpoint {ckpt_dir} is not complete (no {COMPLETION_MARKER} marker)")
    record = ckpt_dir / "checkpoint.json"
    try:
        if record.exists():
            fields = storage.read_json(record)
            return Checkpoint.model_validate(
                {
                    **fields,
                    "path": str(ckpt_dir),
                    "checkpoint_id": checkpoint_id,
                    "dataset_validation_path": _dataset_path(
                        fields.get("dataset_validation_path"), data_root
                    ),
                }
            )
        job, summary = ckpt_dir / "training_job.json", ckpt_dir / "training_summary.json"
        if job.exists() and summary.exists():
            # written by the training worker before its completion marker, so always there for our own
            # checkpoints (checkpoint.json, with the MLflow ids, follows a moment later from the training asset)
            j, r = storage.read_json(job), storage.read_json(summary)
            return Checkpoint(
                checkpoint_id=checkpoint_id,
                path=str(ckpt_dir),
                num_steps=r["steps"],
                training_loss=r["final_loss"],
                validation_loss=r["validation_loss"],
                dataset_run_hash=j.get("dataset_run_hash") or None,
                dataset_validation_path=_dataset_path(j["validation_path"], data_root),
                model_preset=j["model_preset"],
                parent=j.get("parent"),
                init_requested=j.get("init_requested") or None,
                stage=_STAGE_OF_DATA.get(j.get("data_kind", "packed_sft"), "sft"),
            )
        return Checkpoint(checkpoint_id=checkpoint_id, path=str(ckpt_dir), num_steps=0)  # copied in by hand
    except ValueError as error:  # pydantic's ValidationError: no config.json or weights in the folder
        raise ValueError(f"checkpoint {checkpoint_id} in {ckpt_dir} cannot be evaluated: {error}") from error


# what a training job's data kind makes of its checkpoint (``Checkpoint.stage``)
_STAGE_OF_DATA = {
    "packed_sft": "sft",
    "preference": "preference",
    "pretrain_corpus": "pretrain",
    "rl_prompts": "rl",
}


def _dataset_path(stored: str | None, data_root: str | None) -> str | None:
    return roots.resolve_under(stored, data_root) if stored and data_root else stored


def gate_figures(decision: GateDecision, evaluation: CheckpointEvaluation) -> dict[str, Any]:
    """The gate's decision with both models' values, the difference and its interval, for the configured metric
    and the other one (lists stay lists: the caller renders them)."""
    figures: dict[str, Any] = dict(decision.metadata())
    if evaluation.paired_loss is not None:
        p = evaluation.paired_loss
        figures.update(
            {
                "candidate_eval_loss": p.candidate,
                "production_eval_loss": p.production,
                "eval_loss_difference": p.difference.estimate,
                "eval_loss_difference_interval": [p.difference.low, p.difference.high],
                "examples": p.examples,
            }
        )
    if evaluation.win_rate is not None:
        w = evaluation.win_rate
        figures.update(
            {
                "win_rate": w.rate.estimate,
                "win_rate_interval": [w.rate.low, w.rate.high],
                "win_rate_headline": w.headline,
                "judge_mode": w.mode,
                "judge_wins": w.wins,
                "judge_losses": w.losses,
                "judge_order_inconsistent": w.inconsistent,
                "judge_order_consistency": w.order_consistency,
                "judge_ties": w.ties,
                "judge_unreadable": w.unreadable,
            }
        )
    return figures


def build_eval_report(
    ckpt: Checkpoint,
    evaluation: CheckpointEvaluation,
    decision: GateDecision,
    production_id: str | None,
    eval_set: dict[str, Any],
    report_dir: str,
    run_id: str,
    metric: str = "eval_loss",
    contamination: float | None = None,
    contaminated_items: list[str] | None = None,
) -> EvalReport:
    """Write ``report.json`` and ``report.md`` under ``report_dir`` and return the record they describe."""
    result, paired, win = evaluation.result, evaluation.paired_loss, evaluation.win_rate
    json_path, md_path = write_report(
        result,
        {
            **report_lineage(ckpt, evaluation, eval_set, run_id),
            "production_checkpoint": production_id,
            "paired_loss": paired.to_json() if paired else None,
            "win_rate": win.to_json() if win else None,
            "gate": decision.metadata(),
            "guards": decision.guard.summary() if decision.guard else None,
            "guard_findings": list(decision.guard.reasons) if decision.guard else [],
        },
        report_dir,
        win,
    )
    answers = result.answers
    return EvalReport(
        checkpoint_id=ckpt.checkpoint_id,
        checkpoint_path=ckpt.path,
        eval_set_version=evaluation.eval_set_version,
        eval_set_sha256=eval_set.get("content_sha256"),
        eval_loss=result.loss.loss,
        eval_examples=result.loss.sequences,
        eval_tokens=result.loss.tokens,
        perplexity=result.loss.perplexity,
        validation_loss=ckpt.validation_loss,
        judge_score=result.judge_score,
        judge_method=answers[0].method if answers else None,
        num_heldout_prompts=len(answers),
        dataset_run_hash=ckpt.dataset_run_hash,
        production_checkpoint_id=production_id,
        **_comparison_fields(evaluation),
        **_gate_fields(decision, metric),
        contamination=contamination,
        contaminated_items=contaminated_items or [],
        stage=ckpt.stage,
        preference_metrics=ckpt.preference_metrics,
        report_json=json_path,
        report_markdown=md_path,
        parent=ckpt.parent,
        init_requested=ckpt.init_requested,
        benchmarks=result.benchmarks,
        production_benchmarks=result.production_benchmarks,
    )


def _comparison_fields(evaluation: CheckpointEvaluation) -> dict[str, Any]:
    """The report's fields that compare the candidate with production: the paired loss, the judge's win rate and
    its length control (None each where that comparison was not made)."""
    paired, win, lc = evaluation.paired_loss, evaluation.win_rate, evaluation.length_controlled
    return {
        "win_rate_vs_production": win.rate.estimate if win else None,
        "production_eval_loss": paired.production if paired else None,
        "eval_loss_difference": paired.difference.estimate if paired else None,
        "eval_loss_difference_interval": _bounded(paired.difference) if paired else None,
        "win_rate_interval": (win.rate.low, win.rate.high) if win else None,
        "win_rate_verdicts": win.prompts if win else None,
        "judge_mode": win.mode if win else None,
        "win_rate_headline": win.headline if win else None,
        "judge_order_consistency": win.order_consistency if win else None,
        "judge_flips": win.inconsistent if win else None,
        "judge_ties": win.ties if win else None,
        "judge_unreadable": win.unreadable if win else None,
        "length_controlled_win_rate": lc.win_rate if lc else None,
        "mean_length_change": lc.mean_length_change if lc else None,
    }


def _gate_fields(decision: GateDecision, metric: str) -> dict[str, Any]:
    """The report's fields of the promotion gate's decision: what it decided on which metric, how, and its guards."""
    return {
        "gate_decision": decision.metadata()["decision"],
        "gate_reason": decision.reason,
        "gate_metric": metric,
        "gate_n": decision.n,
        "gate_method": decision.method or None,
        "gate_rule": decision.rule or None,
        "gate_attempt": decision.attempt.number if decision.attempt else None,
        "gate_confidence": decision.attempt.confidence if decision.attempt else None,
        "guards": list(decision.guards),
        "guard": decision.guard.to_json() if decision.guard else None,
    }


def _bounded(interval: Any) -> tuple[float, float] | None:
    """An interval both of whose ends are finite (below two examples there is none: ``None``)."""
    return (
        (interval.low, interval.high)
        if math.isfinite(interval.low) and math.isfinite(interval.high)
        else None
    )


def report_lineage(
    ckpt: Checkpoint, evaluation: CheckpointEvaluation, eval_set: dict[str, Any], run_id: str
) -> dict[str, Any]:
    """What the evaluation measured and came from: the MLflow run's params and the report's lineage section."""
    return {
        "checkpoint_path": ckpt.path,
        "dataset_run_hash": ckpt.dataset_run_hash,
        "eval_set_version": evaluation.eval_set_version,
        "eval_set_sha256": eval_set.get("content_sha256"),  # the whole version's content
        "eval_set_examples_sha256": eval_set["files"]["examples.parquet"],
        "model_preset": ckpt.model_preset,
        "scale": ckpt.scale,
        "training_steps": ckpt.num_steps,
        "training_run_id": ckpt.training_run_id,
        "training_mlflow_run_id": ckpt.mlflow_run_id,
        "parent": ckpt.parent,
        "dagster_run_id": run_id,
    }


def report_figures(report: EvalReport) -> dict[str, Any]:
    """Every figure of the report under its one name: the asset's metadata, MLflow and the leaderboard use these."""
    return {
        "eval_set_version": report.eval_set_version,
        "eval_set_sha256": report.eval_set_sha256 or "",
        "eval_loss": report.eval_loss,
        "perplexity": report.perplexity,
        "eval_examples": report.eval_examples,
        "eval_tokens": report.eval_tokens,
        "validation_loss": report.validation_loss,
        "judge_score": report.judge_score,
        "judge_method": report.judge_method,
        "win_rate_vs_production": report.win_rate_vs_production,
        "win_rate_headline": report.win_rate_headline,
        "judge_mode": report.judge_mode,
        "judge_order_consistency": report.judge_order_consistency,
        "judge_flips": report.judge_flips,
        "judge_ties": report.judge_ties,
        "judge_unreadable": report.judge_unreadable,
        "production_checkpoint": report.production_checkpoint_id,
        "production_eval_loss": report.production_eval_loss,
        "eval_loss_difference": report.eval_loss_difference,
        "gate_decision": report.gate_decision,
        "gate_n": report.gate_n,
        "gate_method": report.gate_method,
        "gate_rule": report.gate_rule,
        "gate_attempt": report.gate_attempt,
        "gate_confidence": report.gate_confidence,
        **guard_figures(report.guard),
        "contamination": report.contamination,
        "stage": report.stage,
        "length_controlled_win_rate": report.length_controlled_win_rate,
        "mean_length_change": report.mean_length_change,
        **{f"heldout_{k}": v for k, v in (report.preference_metrics or {}).items()},
        "eval_loss_difference_interval": list(report.eval_loss_difference_interval)
        if report.eval_loss_difference_interval
        else None,
        "dataset_run_hash": report.dataset_run_hash,
        "parent": report.parent or "",
        **{f"benchmark/{k}": v for k, v in flat_scores(report.benchmarks).items()},
    }


def guard_figures(guard: dict[str, Any] | None) -> dict[str, Any]:
    """The guards' figures under the report's names (core.evaluation.guards): the verdict and each reason (the UI
    shows why a candidate was held back), the skewness, the regressed share with its interval, the worst slice."""
    if not guard:
        return {}
    slices = [s for s in guard["guard_slices"] if s["p_value"] is not None]
    worst = max(slices, key=lambda s: s["worse_by"], default=None)
    return {
        "guard_verdict": guard["guard_verdict"],
        "guard_reasons": "; ".join(guard["guard_reasons"]) or "none",
        "guard_summary": guard["summary"],
        "guard_skewness": guard["guard_skewness"],
        "guard_regressed_share": guard["guard_regressed_share"],
        "guard_regressed_interval": guard["guard_regressed_interval"],
        "guard_slices_tested": len(slices),
        "guard_worst_slice": f"{worst['label']} ({worst['worse_by']:+.4f}, n = {worst['n']})"
        if worst
        else "",
    }


def mlflow_metrics(report: EvalReport) -> dict[str, float]:
    """The numeric figures (MLflow keeps numbers only)."""
    return {
        k: float(v)
        for k, v in report_figures(report).items()
        if isinstance(v, int | float)
        and not isinstance(v, bool)
        and k != "eval_set_version"
        and math.isfinite(float(v))
    }


def leaderboard_row(report: EvalReport, in_production: bool, outcome: str = "") -> dict[str, Any]:
    """The report's row on the leaderboard (stage ``sft`` or ``preference``; base models have rows of their own): its figures, the
    gate's decision with the n, interval, method and rule behind it, and what happened (``outcome``: deployed, or
    held back and why, as the deployment recorded it)."""
    figures = report_figures(report)
    interval = (
        report.eval_loss_difference_interval
        if report.gate_metric in (None, "eval_loss")
        else (report.win_rate_interval if report.gate_metric == "win_rate" else None)
    )
    return {
        "checkpoint_id": report.checkpoint_id,
        "stage": report.stage,
        "eval_set_version": report.eval_set_version,
        "eval_set_sha256": report.eval_set_sha256 or "",  # the same for every row measured on the same data
        **{
            k: figures[k]
            for k in (
                "eval_loss",
                "perplexity",
                "judge_score",
                "win_rate_vs_production",
                "win_rate_headline",
                "judge_order_consistency",
                "length_controlled_win_rate",
                "eval_loss_difference",
            )
        },
        "vs_production": report.production_checkpoint_id or "",
        "gate": report.gate_decision or "",
        "gate_n": report.gate_n,
        "gate_interval": f"[{interval[0]:+.4f}, {interval[1]:+.4f}]" if interval else "",
        "gate_method": report.gate_method or "",
        "gate_rule": report.gate_rule or "",
        # what the guards on the examples that got worse said (core/evaluation/guards.py): pass, or each reason
        "gate_guards": ("; ".join(report.guard["guard_reasons"]) or "pass") if report.guard else "",
        "contamination": report.contamination,
        "outcome": outcome,
        "dataset_run_hash": report.dataset_run_hash or "",
        "parent": report.parent or "",
        "evaluated_at": report.created_at,
        "in_production": in_production,
        **flat_scores(report.benchmarks),  # one column per benchmark metric and its standard error
    }


def base_leaderboard_row(report: BaseModelEval) -> dict[str, Any]:
    """A base model's row (stage ``base``): measured on the eval-set version's frozen corpus documents, not on its
    SFT samples, so its loss compares with other base models' of the same version only."""
    low, high = report.loss_interval
    return {
        "checkpoint_id": report.checkpoint_id,
        "stage": "base",
        "eval_set_version": report.eval_set_version,
        "eval_set_sha256": report.eval_set_sha256 or "",
        "eval_loss": report.loss,
        "eval_loss_interval": f"[{low:.4f}, {high:.4f}]",
        "perplexity": report.perplexity,
        "dataset_run_hash": report.corpus_run_hash or "",
        "parent": "scratch",
        "evaluated_at": report.created_at,
        "in_production": False,
    }
