"""Evaluation stage: every checkpoint (one partition each) is scored on the frozen eval set together with the
production model, in the evaluation worker on the GPU cluster (never in the Dagster process); the judge scores its
answers and compares them with production's in both orders; the promotion gate, a check whose decision
model_deployment follows (held back is a recorded warning, not a failure), decides on the paired difference and its
confidence interval whether it is served.
"""

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import dagster as dg
import numpy as np
import pandas as pd

from nexa_dagster.assets.common import IMPORTS_MODELS, MODEL_CALL_RETRY, no_retry_on_permanent_llm_errors
from nexa_dagster.assets.packaging import contamination_index, load_student_tokenizer
from nexa_dagster.assets.partitions import checkpoint_partitions
from nexa_dagster.assets.types import LeaderboardType
from nexa_dagster.core.common import storage as io
from nexa_dagster.core.common.artifacts import BaseModelEval, Checkpoint, EvalReport
from nexa_dagster.core.common.config import ScalePreset, resolve_path
from nexa_dagster.core.common.plots import loss_curve_png, markdown_image
from nexa_dagster.core.common.spans import span, span_line
from nexa_dagster.core.data.contamination import ContaminationIndex
from nexa_dagster.core.evaluation.attempts import Attempt, GateAttempts, family
from nexa_dagster.core.evaluation.benchmarks import (
    BenchmarkComparison,
    BenchmarkError,
    compare_benchmark,
    parse_metric,
)
from nexa_dagster.core.evaluation.eval_set import eval_prompts, eval_slices, load_eval_set
from nexa_dagster.core.evaluation.guards import GuardReport
from nexa_dagster.core.evaluation.promotion import (
    GateDecision,
    ProductionEntry,
    ProductionRegistry,
    PromotionPolicy,
    decide,
    decide_preference,
    eval_loss_guard,
    judge_score_guard,
)
from nexa_dagster.core.evaluation.report import (
    base_leaderboard_row,
    build_eval_report,
    gate_figures,
    leaderboard_row,
    mlflow_metrics,
    read_checkpoint,
    report_figures,
    report_lineage,
)
from nexa_dagster.core.evaluation.reward_gate import (
    answer_lengths,
    decide_reward,
    prompt_rewards,
    reward_length_control,
)
from nexa_dagster.core.evaluation.rl_eval_set import load_rl_eval_set, read_prompts
from nexa_dagster.core.evaluation.scoring import CheckpointEvaluation, JudgeRubric, ModelScores, compare
from nexa_dagster.core.evaluation.worker import EvaluationJob
from nexa_dagster.core.packaging.decontaminate import (
    InputFile,
    TextsOf,
    chat_texts,
    decontaminate,
    document_texts,
    recorded_inputs,
    template_segments,
)
from nexa_dagster.core.packaging.preference_dataset import pair_texts
from nexa_dagster.core.packaging.pretrain_corpus import items_trained_on
from nexa_dagster.core.serving.outcomes import describe, read_outcome
from nexa_dagster.resources.configs import (
    EvalSetsResource,
    PackagingResource,
    PromotionResource,
    PromptsResource,
    SampleGateResource,
)
from nexa_dagster.resources.gpu_cluster import GPUClusterResource
from nexa_dagster.resources.io_manager import MISSING_OK
from nexa_dagster.resources.llm import LLMResource
from nexa_dagster.resources.scale import ScaleResource
from nexa_dagster.resources.storage import StorageResource
from nexa_dagster.resources.tracking import TrackingResource

GATE = dg.AssetCheckSpec(
    "beats_production",
    asset="eval_report",
    blocking=False,
    description="Promotion gate (configs/promotion.yaml): on the same frozen eval set, the "
    "checkpoint beats the production model on the configured metric (paired "
    "eval-set loss or order-consistent judge win rate) by the margin, its "
    "confidence interval included, or there is none yet. A checkpoint held back "
    "(a tie included) is a recorded decision, a warning, not a failed run: "
    "model_deployment then deploys nothing and is not materialized.",
)


# Eager, except that a checkpoint whose evaluation is missing (failed, or not run yet) does not hold the
# leaderboard back: plain eager() waits for every partition of eval_report, so one failed evaluation would freeze it.
# And never on an evaluation whose blocking check failed.
LEADERBOARD_CONDITION = (
    dg.AutomationCondition.eager().without(~dg.AutomationCondition.any_deps_missing())
    & dg.AutomationCondition.all_deps_blocking_checks_passed()
)


def load_checkpoint_record(ckpt_dir: Path, checkpoint_id: str, data_root: str | None = None) -> Checkpoint:
    """``core.evaluation.report.read_checkpoint``; an incomplete or unloadable folder fails, not retried."""
    try:
        return read_checkpoint(ckpt_dir, checkpoint_id, data_root)
    except ValueError as error:
        raise dg.Failure(str(error), allow_retries=False) from error


def frozen_eval_set(storage: StorageResource, version: int, checkpoint_id: str) -> dict:
    """The manifest of eval set ``version`` in this data root: all a checkpoint needs besides itself (it may have
    been copied in from anywhere); a clear failure, not retried, naming what to materialize when none was ever
    frozen, or the file and what to do when a frozen version is damaged (a file missing, changed, unreadable)."""
    try:
        return load_eval_set(storage.path("eval_sets"), version)
    except FileNotFoundError:
        raise dg.Failure(
            f"no eval set v{version} to evaluate checkpoint {checkpoint_id} on: none has been frozen under "
            f"{storage.path('eval_sets')}. Materialize it first (`dagster asset materialize -m "
            "nexa_dagster.definitions --select eval_set`, after the daily data; training_job does it too), then "
            "evaluate again: `dagster asset materialize -m nexa_dagster.definitions --select "
            f"eval_report,model_deployment --partition {checkpoint_id}`.",
            allow_retries=False,
        ) from None
    except (
        ValueError
    ) as error:  # a frozen version with a file missing, changed or unreadable (EvalSetDamaged)
        raise dg.Failure(str(error), allow_retries=False) from error


def loss_curve_markdown(ckpt: Checkpoint) -> str | None:
    metrics = Path(ckpt.path) / "metrics.jsonl"
    if not metrics.exists():
        return None
    rows = pd.read_json(metrics, lines=True)
    png = loss_curve_png(
        list(zip(rows["step"], rows["loss"], strict=True)), ckpt.checkpoint_id, ckpt.validation_loss
    )
    return markdown_image(png, "training loss")


def production_to_compare(storage: StorageResource, checkpoint_id: str, log) -> tuple[object, str | None]:
    """(production entry or None, the directory to score it from or None when it is this checkpoint or unreadable)."""
    production = ProductionRegistry(storage.production_pointer()).current()
    if production is None or production.checkpoint_id == checkpoint_id:
        return production, None
    if not Path(production.checkpoint_path).exists():
        log(
            f"production {production.checkpoint_id} is not readable at {production.checkpoint_path}: the gate has "
            "nothing to compare with and holds the checkpoint back"
        )
        return production, None
    return production, production.checkpoint_path


@dg.asset(
    op_tags=IMPORTS_MODELS,  # step_executor.py: torch and transformers in its own process
    group_name="evaluation",
    partitions_def=checkpoint_partitions,
    pool="gpu",
    retry_policy=MODEL_CALL_RETRY,
    deps=["moe_checkpoint", "preference_checkpoint", "rl_checkpoint", "eval_set", "rl_eval_set"],
    check_specs=[GATE],
    kinds={"pytorch", "markdown"},
    description="The checkpoint and the production model scored on the same frozen eval set (eval_set.version) "
    "in the evaluation worker on the GPU cluster: per-example loss, perplexity, answers to the eval "
    "set's questions; the judge's mean score and its pairwise preference in both answer orders; the "
    "paired difference with its bootstrap interval; JSON + Markdown report in "
    "results/evaluation/reports/<checkpoint_id>/.",
)
def eval_report(
    context: dg.AssetExecutionContext,
    judge_llm: LLMResource,
    gpu_cluster: GPUClusterResource,
    storage: StorageResource,
    tracking: TrackingResource,
    scale_preset: ScaleResource,
    eval_sets: EvalSetsResource,
    promotion_policy: PromotionResource,
    sample_gate_config: SampleGateResource,
    prompts: PromptsResource,
    packaging_config: PackagingResource,
):
    checkpoint_id = context.partition_key
    scale, policy, version = scale_preset.load(), promotion_policy.policy(), eval_sets.version
    ckpt = load_checkpoint_record(
        checkpoint_dir(storage, tracking, policy.registered_model, checkpoint_id), checkpoint_id, storage.root
    )
    eval_set = frozen_eval_set(storage, version, checkpoint_id)
    rewards = gate_rewards(ckpt, scale)
    rl_rows, questions, max_new_tokens = prompts_to_answer(storage, scale, checkpoint_id, eval_set, rewards)
    production, production_path = production_to_compare(storage, checkpoint_id, context.log.warning)
    # retries pay: this decision's place among those on the same evidence against the same production model
    attempt = gate_attempt(storage, scale, version, checkpoint_id, production, rewards, policy)
    policy = policy.for_attempt(attempt.number) if attempt else policy

    # 1. both models scored on the same frozen eval set, in the evaluation worker on the GPU cluster
    answers = Answers(questions, production_path, max_new_tokens)
    scores = score_both(context, gpu_cluster, storage, scale, policy, ckpt, eval_set, answers)
    # 2. the judge scores the answers and compares them with production's, in both orders
    evaluation = judged(
        context, judge_llm, prompts, sample_gate_config, policy, ckpt, version, scores, questions
    )
    # 3. how much of the eval set (or of the gate's benchmark) its training data holds
    contamination, contaminated = training_data_contamination(
        context, storage, tracking, ckpt, eval_sets, scale, prompts, packaging_config, policy
    )
    # 4. the promotion gate (the mean, and the guards on the examples that got worse), then one report from which
    # the metadata, MLflow and the leaderboard row derive
    evidence = GateEvidence(ckpt, production, policy, evaluation, scores, contamination, rewards, rl_rows)
    decision, reward_figures = promotion_gate(evidence, eval_set, scale, attempt)
    report = written_report(context, storage, evidence, decision, reward_figures, eval_set, contaminated)
    log_to_mlflow(tracking, report, report_lineage(ckpt, evaluation, eval_set, context.run.run_id))
    yield dg.Output(report, metadata=report_metadata(report, ckpt))

    context.log.info(
        f"promotion gate for {checkpoint_id}: {'pass' if decision.passed else 'fail'} ({decision.reason})"
    )
    yield gate_check(decision, evaluation, policy, version, report, reward_figures)


@dataclass(frozen=True)
class Answers:
    """What both models answer in the evaluation worker: the prompts, the production model's directory (None: the
    candidate alone), and the answers' length (None: the evaluation's own, ``evaluation.max_new_tokens``)."""

    questions: list[str]
    production_path: str | None
    max_new_tokens: int | None


@dataclass(frozen=True)
class GateEvidence:
    """What the promotion gate decides on: the checkpoint and the production model it is compared with (None: none
    yet), the policy at this attempt, both models' scores with the judge's verdicts, the share of the protected
    items its training data holds (None: unknown), and for a reward gate its rewards and the held-out RL prompts
    they are measured on (``rl_rows``; None: not a reward gate)."""

    ckpt: Checkpoint
    production: ProductionEntry | None
    policy: PromotionPolicy
    evaluation: CheckpointEvaluation
    scores: dict
    contamination: float | None
    rewards: list[tuple[str, float]]
    rl_rows: list[dict] | None

    def metric(self) -> str:
        """What the gate decided on, as the report names it."""
        if self.rewards:
            return "reward"
        return {"preference": "win_rate"}.get(self.ckpt.stage, self.policy.metric)


def promotion_gate(
    evidence: GateEvidence, eval_set: dict, scale: ScalePreset, attempt: Attempt | None
) -> tuple[GateDecision, dict | None]:
    """The gate's decision on ``evidence`` (the mean, and the guards on the examples that got worse), saying which
    attempt it was and at what level; with the reward gate's figures and on what they were measured."""
    stage = evidence.ckpt.stage
    guard = (
        None if evidence.rewards else example_guards(evidence.policy, evidence.evaluation, eval_set, stage)
    )
    decision, reward_figures = gate_decision(evidence, guard)
    if attempt is not None:  # the check, the report and the UI say which attempt it was and at what level
        decision = replace(decision, attempt=attempt, reason=f"{decision.reason}; {attempt.describe()}")
    if reward_figures is not None:  # the report and the check both say on what the reward gate decided
        reward_figures = with_rl_eval_set(reward_figures, scale)
    return decision, reward_figures


def written_report(
    context: dg.AssetExecutionContext,
    storage: StorageResource,
    evidence: GateEvidence,
    decision: GateDecision,
    reward_figures: dict | None,
    eval_set: dict,
    contaminated: list[str],
) -> EvalReport:
    """The report (JSON and Markdown under the checkpoint's report folder) from which the metadata, MLflow and the
    leaderboard row derive."""
    report = build_eval_report(
        evidence.ckpt,
        evidence.evaluation,
        decision,
        evidence.production.checkpoint_id if evidence.production else None,
        eval_set,
        storage.report_dir(evidence.ckpt.checkpoint_id),
        context.run.run_id,
        evidence.metric(),
        evidence.contamination,
        contaminated,
    )
    if reward_figures is not None:
        report = report.model_copy(update={"reward_gate": reward_figures})
    return report


def prompts_to_answer(
    storage: StorageResource,
    scale: ScalePreset,
    checkpoint_id: str,
    eval_set: dict,
    rewards: list[tuple[str, float]],
) -> tuple[list[dict] | None, list[str], int | None]:
    """The prompts both models answer, and at what length: an RL-gated checkpoint's frozen held-out RL prompts (for
    the reward gate, at training's completion length), else the eval set's questions (for the judge, at the
    evaluation's own length). (the RL rows or None, the prompts, the max new tokens or None)"""
    if not rewards:
        return None, eval_prompts(eval_set, scale.evaluation.num_heldout_prompts), None
    rl_rows = rl_held_out(storage, scale, checkpoint_id)
    max_new_tokens = scale.rl.max_completion_tokens if scale.rl else None
    return rl_rows, [r["prompt"] for r in rl_rows], max_new_tokens


def gate_attempt(
    storage: StorageResource,
    scale: ScalePreset,
    version: int,
    checkpoint_id: str,
    production: ProductionEntry | None,
    rewards: list[tuple[str, float]],
    policy: PromotionPolicy,
) -> Attempt | None:
    """This gate decision's attempt in its family (``core.evaluation.attempts``): the evidence it decides on (the
    frozen RL eval set for a reward gate, else the eval set) at its version, against the production model it is
    compared with; counted under the data root beside the production pointer. None when nothing is compared (no
    production model yet, or this checkpoint is production)."""
    if production is None or production.checkpoint_id == checkpoint_id:
        return None
    if rewards:
        key = family("rl_eval_set", scale.rl.eval_set_version if scale.rl else 1, production.checkpoint_id)
    else:
        key = family("eval_set", version, production.checkpoint_id)
    return GateAttempts.under(storage.root).reserve(key, checkpoint_id, policy.confidence)


def with_rl_eval_set(reward_figures: dict[str, Any], scale: ScalePreset) -> dict[str, Any]:
    """The reward gate's figures with the RL eval set's version and how the answers were drawn (the summary's and
    the UI's "on what")."""
    if scale.rl is None:
        return reward_figures
    return {
        **reward_figures,
        "rl_eval_set_version": scale.rl.eval_set_version,
        "answers": answers_label(scale),
    }


def judged(
    context: dg.AssetExecutionContext,
    judge_llm: LLMResource,
    prompts: PromptsResource,
    sample_gate_config: SampleGateResource,
    policy: PromotionPolicy,
    ckpt: Checkpoint,
    version: int,
    scores: dict,
    questions: list[str],
) -> CheckpointEvaluation:
    """Both models' scores with the judge's verdicts on their answers and the paired statistics."""
    rubric = JudgeRubric(
        prompts.text("judge"), prompts.text("judge_verdict"), sample_gate_config.config().judge
    )
    opening = time.perf_counter()
    with no_retry_on_permanent_llm_errors(f"judge {judge_llm.where()}"), judge_llm.get_client() as judge:
        context.log.info(span_line("fixed", "judge_start", time.perf_counter() - opening))
        with span(context.log.info, "work", "judging"):
            return compare(
                ckpt.checkpoint_id,
                version,
                ModelScores.from_json(scores["candidate"]),
                ModelScores.from_json(scores["production"]) if "production" in scores else None,
                questions,
                judge,
                rubric,
                policy.confidence,
                policy.bootstrap_resamples,
                log=context.log.info,
                interval_method=policy.interval_method,
                judge_mode=policy.preference.judge_mode,
                tie_epsilon=policy.preference.tie_epsilon,
            )


def score_both(
    context: dg.AssetExecutionContext,
    gpu_cluster: GPUClusterResource,
    storage: StorageResource,
    scale: ScalePreset,
    policy: PromotionPolicy,
    ckpt: Checkpoint,
    eval_set: dict,
    answers: Answers,
) -> dict:
    """Both models' eval-set losses and answers to ``answers.questions`` (and benchmarks), from the evaluation
    worker on the GPU cluster: ``{role: ModelScores JSON}``."""
    checkpoint_id, production_path = ckpt.checkpoint_id, answers.production_path
    work_dir = io.local_dir(storage.path("runs", f"eval-{checkpoint_id}"))
    bench = scale.evaluation.benchmarks  # the worker runs in work_dir: its task folders must be absolute
    bench = bench.model_copy(update={"include_path": [str(resolve_path(p)) for p in bench.include_path]})
    job = EvaluationJob(
        run_id=checkpoint_id,
        models={"candidate": ckpt.path, **({"production": production_path} if production_path else {})},
        examples_path=eval_set["path"],
        eval_set_version=eval_set["version"],
        prompts=answers.questions,
        max_new_tokens=answers.max_new_tokens or scale.evaluation.max_new_tokens,
        accelerator=gpu_cluster.accelerator,
        output_path=str(work_dir / "scores.json"),
        benchmarks=bench if bench.tasks else None,
        # production's benchmark scores cost a second harness run: only when the gate needs them
        benchmark_roles=["candidate", "production"]
        if policy.benchmark or ckpt.stage == "preference"
        else ["candidate"],
        **answer_sampling(scale, sampled=answers.max_new_tokens is not None),
    )
    return gpu_cluster.run_evaluation(context, job, work_dir)["scores"]


def answers_label(scale: ScalePreset) -> str:
    """How the reward gate's answers were drawn, as the summary and the UI say it."""
    rl = scale.rl
    if rl is None or not rl.eval_samples:
        return "greedy"
    return f"pass@1 of {rl.eval_samples} samples at temperature {rl.temperature:g}"


def answer_sampling(scale: ScalePreset, sampled: bool) -> dict[str, Any]:
    """The evaluation job's sampled answers for a reward gate (``rl.eval_samples`` at the rollouts' temperature,
    seeded by the scale's training seed: the same draws for both models), or none."""
    if not sampled or scale.rl is None or not scale.rl.eval_samples:
        return {}
    return {
        "answer_samples": scale.rl.eval_samples,
        "answer_temperature": scale.rl.temperature,
        "answer_top_p": scale.rl.top_p,
        "answer_seed": scale.training.seed,
        "answer_engine": scale.rl.rollout_engine,  # what samples the RL stage's answers, rollouts and gate alike
    }


def gate_check(
    decision: GateDecision,
    evaluation: CheckpointEvaluation,
    policy: PromotionPolicy,
    version: int,
    report: EvalReport,
    reward_figures: dict | None,
) -> dg.AssetCheckResult:
    """The promotion gate as an asset check (a WARN when held back: a decision, not an outage), with the decision's
    attempt in its family and the confidence it decided at (``core.evaluation.attempts``)."""
    return dg.AssetCheckResult(
        check_name="beats_production",
        passed=decision.passed,
        severity=dg.AssetCheckSeverity.WARN,  # held back is a decision, not an outage
        metadata=as_metadata(
            {
                "metric": policy.metric,
                "margin": policy.margin,
                "require_interval": policy.require_interval,
                "confidence": policy.confidence,
                "eval_set_version": version,
                "production_checkpoint": report.production_checkpoint_id,
                **gate_figures(decision, evaluation),
                **{
                    f"reward_gate/{k}": v
                    for k, v in (reward_figures or {}).items()
                    if not isinstance(v, dict)
                },
            }
        ),
    )


def example_guards(
    policy: PromotionPolicy, evaluation: CheckpointEvaluation, eval_set: dict, stage: str
) -> GuardReport | None:
    """The guards on the per-example differences the gate decides on (core/evaluation/guards.py): the eval-set
    losses of an SFT checkpoint, sliced by the eval set's ``guards.slice_by`` field; the pointwise judge's scores of
    a preference checkpoint (its prompts are the eval set's first ones). None: nothing per example to guard."""
    if evaluation.production is None:
        return None
    try:
        slices = eval_slices(eval_set, policy.guards.slice_by)
    except ValueError as error:
        raise dg.Failure(str(error), allow_retries=False) from error
    if stage == "preference":
        # pairwise verdicts carry no size: the Wilson interval is the test
        if evaluation.judge_scores is None:
            return None
        ours, theirs = evaluation.judge_scores
        return judge_score_guard(ours, theirs, policy, slices[: len(ours)] if slices else None)
    return eval_loss_guard(
        evaluation.candidate.nll, evaluation.production.nll, evaluation.candidate.tokens, policy, slices
    )


def gate_rewards(ckpt: Checkpoint, scale: ScalePreset) -> list[tuple[str, float]]:
    """The rewards a checkpoint's gate decides on, or none: an RL checkpoint's (``rl.rewards``), and a preference
    checkpoint's when its pairs were ranked by a reward (``preference.rank_by: reward``): a model trained to prefer
    the right answer is judged on right answers to prompts it never saw, not on the judge's taste."""
    if scale.rl is None:
        return []
    if ckpt.stage == "rl":
        return [(r.name, r.weight) for r in scale.rl.rewards]
    if ckpt.stage == "preference" and scale.preference is not None and scale.preference.rank_by == "reward":
        return [(scale.preference.reward, 1.0)]
    return []


def gate_decision(
    evidence: GateEvidence, guard: GuardReport | None = None
) -> tuple[GateDecision, dict | None]:
    """The gate of the checkpoint's stage: on ``rewards`` (an RL checkpoint, a reward-ranked DPO one) the paired
    held-out reward difference (``decide_reward``); a preference checkpoint on the judge's win rate
    (``decide_preference``); an SFT checkpoint on the configured metric (``decide``). All three end in
    ``promotion.conclude``: the same contamination refusal, non-inferiority guards (eval-set loss, benchmarks, the
    length control, each where the gate has it) and per-example guards. With the reward figures when a reward
    decided."""
    ckpt, policy, evaluation = evidence.ckpt, evidence.policy, evidence.evaluation
    if evidence.rewards and evidence.rl_rows is not None:
        return reward_gate_decision(evidence, evidence.rl_rows)
    if ckpt.stage == "preference":  # the win rate decides; eval-set loss and benchmarks guard
        return decide_preference(
            ckpt.checkpoint_id,
            evidence.production,
            policy,
            evaluation.paired_loss,
            evaluation.win_rate,
            benchmark_guards(policy, evaluation),
            evidence.contamination,
            evaluation.length_controlled,
            guard,
        ), None
    return decide(
        ckpt.checkpoint_id,
        evidence.production,
        policy,
        evaluation.paired_loss,
        evaluation.win_rate,
        benchmark_comparison(policy, evaluation),
        evidence.contamination,
        guard if policy.metric == "eval_loss" else None,
    ), None


def reward_gate_decision(evidence: GateEvidence, rl_rows: list[dict]) -> tuple[GateDecision, dict]:
    """A reward gate's decision (``decide_reward``) on both models' per-prompt held-out rewards (of ``rl_rows``),
    with every guard the other gates run (contamination, eval-set loss, benchmarks, the length control of the reward
    verdicts), and its figures for the report and the check."""
    scores, rewards, ckpt = evidence.scores, evidence.rewards, evidence.ckpt
    candidate = prompt_rewards(rl_rows, scores["candidate"], rewards)
    baseline = prompt_rewards(rl_rows, scores["production"], rewards) if "production" in scores else []
    differences = [c - p for c, p in zip(candidate, baseline, strict=True)] if baseline else []
    means = (float(np.mean(candidate)), float(np.mean(baseline))) if baseline else None
    lengths = (
        reward_length_control(
            candidate,
            baseline,
            answer_lengths(scores["candidate"]),
            answer_lengths(scores["production"]),
        )
        if baseline
        else None
    )
    decision = decide_reward(
        ckpt.checkpoint_id,
        evidence.production,
        evidence.policy,
        differences,
        evidence.evaluation.paired_loss,
        means,
        slices=[str(row.get("task", "")) for row in rl_rows] if baseline else None,
        benchmarks=benchmark_guards(evidence.policy, evidence.evaluation),
        length_controlled=lengths,
        contamination=evidence.contamination,
    )
    figures = {
        "rewards": [name for name, _ in rewards],
        "candidate_reward": float(np.mean(candidate)),
        "production_reward": means[1] if means else None,
        **{k: decision.metadata()[k] for k in ("difference", "interval_low", "interval_high", "n")},
        "training": ckpt.rl_metrics or ckpt.preference_metrics or {},
        **({"length_controlled_win_rate": lengths.win_rate} if lengths else {}),
    }
    return decision, figures


def rl_held_out(storage: StorageResource, scale: ScalePreset, checkpoint_id: str) -> list[dict]:
    """The frozen held-out RL prompts an RL checkpoint is gated on; a clear failure when none was frozen."""
    version = scale.rl.eval_set_version if scale.rl else 1
    try:
        return read_prompts(load_rl_eval_set(storage.path("rl_eval_sets"), version))
    except FileNotFoundError:
        raise dg.Failure(
            f"no RL eval set v{version} to gate RL checkpoint {checkpoint_id} on: materialize rl_eval_set first",
            allow_retries=False,
        ) from None
    except ValueError as error:
        raise dg.Failure(str(error), allow_retries=False) from error


def training_data_contamination(
    context: dg.AssetExecutionContext,
    storage: StorageResource,
    tracking: TrackingResource,
    ckpt: Checkpoint,
    eval_sets: EvalSetsResource,
    scale: ScalePreset,
    prompts: PromptsResource,
    packaging_config: PackagingResource,
    policy: PromotionPolicy,
) -> tuple[float | None, list[str]]:
    """(the share of the gate's protected items, the eval set's or its benchmark task's, that the candidate's
    training data holds; those items) from the day files its datasets were packed from, each checked once per index
    (``core/packaging/decontaminate.py``'s receipts). A checkpoint learned from its own data and from everything
    its ancestors learned from (the production models it continued from, the base model's corpus), so its whole
    lineage is followed (``training_lineage``). None: unknown (a dataset of that lineage is not in this data root)."""
    lineage = training_lineage(storage, tracking, policy, ckpt)
    datasets = stage_datasets(storage, prompts)
    # an RL ancestor's task prompts were decontaminated against this index when rl_prompts built them (rl_prompts'
    # metadata: tasks_contaminated); its parent's data is checked next
    trained = [a for a in lineage if a.stage != "rl"]
    unknown = next(filter(None, (data_unknown(a, datasets) for a in trained)), "")
    if unknown:
        context.log.warning(f"{ckpt.checkpoint_id}: {unknown}: contamination unknown")
        return None, []
    index, _ = contamination_index(
        storage, eval_sets, scale, prompts, packaging_config.config().contamination
    )
    hit: set[int] = set()
    for ancestor in trained:
        hit |= items_trained_on_by(storage, ancestor, datasets[ancestor.stage], index)
    source = f"benchmark:{parse_metric(policy.metric)[0]}" if policy.benchmark else "eval_set"
    items = sorted(index.describe(i) for i in hit if index.items[i][0].startswith(source))
    context.log.info(
        f"contamination of {ckpt.checkpoint_id}'s lineage ({', '.join(a.describe() for a in lineage)}): "
        f"{len(items)} of the {source} items occur in what it trained on (index {index.key})"
    )
    return index.share(hit, source), items


@dataclass(frozen=True)
class Ancestor:
    """One training in a checkpoint's lineage: its stage, the dataset it trained on and, for a base model, the
    corpus documents it never saw. ``stage`` "training": a parent whose record is not here (its data unknown)."""

    stage: str
    dataset_run_hash: str | None
    checkpoint_id: str
    # a base model's: None when not recorded (a base model trained before its record held them)
    excluded_documents: frozenset[str] | None = None
    eval_side_fraction: float = 0.0

    def describe(self) -> str:
        return f"{self.stage} {self.checkpoint_id}"


def training_lineage(
    storage: StorageResource, tracking: TrackingResource, policy: PromotionPolicy, ckpt: Checkpoint
) -> list[Ancestor]:
    """The checkpoint, then every training its weights came from: ``production:<id>`` (nightly continual
    fine-tuning, DPO from production), ``base:<id>`` (the base model and its corpus), back to random weights. A
    parent whose record is not in this data root, or a model from elsewhere (``path:<dir>``), ends the lineage with
    an unknown stage."""
    lineage, seen = [], set()
    while True:
        lineage.append(
            Ancestor(
                ckpt.stage,
                ckpt.dataset_run_hash,
                ckpt.checkpoint_id,
                None if ckpt.excluded_documents is None else frozenset(ckpt.excluded_documents),
                ckpt.eval_side_fraction or 0.0,
            )
        )
        seen.add(ckpt.checkpoint_id)
        kind, _, parent = (ckpt.parent or "scratch").partition(":")
        if kind == "scratch" or parent in seen:
            return lineage
        if kind == "base":
            parent_dir = Path(storage.path("base_models", parent))
        elif kind == "production":
            parent_dir = checkpoint_dir(storage, tracking, policy.registered_model, parent)
        else:  # path:<dir>: trained elsewhere, on data this root does not hold
            return [*lineage, Ancestor("training", None, ckpt.parent or parent)]
        try:
            ckpt = read_checkpoint(parent_dir, parent, storage.root)
        except ValueError:  # its stage is unknown too: an SFT, base or preference checkpoint
            return [*lineage, Ancestor("training", None, parent)]


@dataclass(frozen=True)
class StageData:
    """Where one stage's datasets lie, how a record of them reads as texts, and the record's id field."""

    root: str
    texts: TextsOf
    id_field: str

    def files(self, run_hash: str | None) -> list[InputFile] | None:
        """The day files the dataset ``run_hash`` was packed from (None: not in this data root)."""
        return recorded_inputs(io.join(self.root, run_hash), self.root) if run_hash else None


def stage_datasets(storage: StorageResource, prompts: PromptsResource) -> dict[str, StageData]:
    """The stages whose training data this data root holds, by the stage a checkpoint records."""
    segments = template_segments(prompts.text("teacher"))
    return {
        "sft": StageData(storage.path("sft"), chat_texts(segments), "sample_id"),
        "preference": StageData(storage.path("preference"), pair_texts(segments), "pair_id"),
        "pretrain": StageData(storage.path("pretrain"), document_texts, "doc_id"),
    }


def data_unknown(ancestor: Ancestor, datasets: dict[str, StageData]) -> str:
    """Why what ``ancestor`` trained on is not known here, or "": a stage whose data is not known here, a dataset
    not in this data root, a base model whose record does not say which documents it left out."""
    data = datasets.get(ancestor.stage)
    if data is None or data.files(ancestor.dataset_run_hash) is None:
        return f"the {ancestor.stage} data of {ancestor.checkpoint_id} is not in this data root"
    if ancestor.stage == "pretrain" and ancestor.excluded_documents is None:
        return (
            f"base model {ancestor.checkpoint_id} records no documents it left out (trained before its record "
            "held them)"
        )
    return ""


def items_trained_on_by(
    storage: StorageResource, ancestor: Ancestor, data: StageData, index: ContaminationIndex
) -> set[int]:
    """The protected items of ``index`` that what ``ancestor`` trained on holds, from the day files its dataset was
    packed from (each checked once per index: ``core/packaging/decontaminate.py``'s receipts); of a base model's
    corpus, only the documents it did not leave out."""
    files = data.files(ancestor.dataset_run_hash)
    _, report = decontaminate(files, index, data.root, "report", data.texts, data.id_field, lambda _: None)
    if ancestor.stage != "pretrain":
        return set(report.items_hit)
    tokenizer, _ = load_student_tokenizer(storage)
    left_out = frozenset(ancestor.excluded_documents or ())
    return items_trained_on(report, tokenizer, data.root, left_out, ancestor.eval_side_fraction)


def checkpoint_dir(
    storage: StorageResource, tracking: TrackingResource, registered_model: str, checkpoint_id: str
) -> Path:
    """The checkpoint's folder: in the checkpoint store, else where the MLflow registry says it is."""
    ckpt_dir = storage.checkpoint_dir(checkpoint_id)
    if not ckpt_dir.exists():  # registered in the MLflow model registry from elsewhere
        source = tracking.registered_checkpoints(registered_model).get(checkpoint_id)
        ckpt_dir = Path(source) if source else ckpt_dir
    return ckpt_dir


def benchmark_guards(policy: PromotionPolicy, evaluation: CheckpointEvaluation) -> list[BenchmarkComparison]:
    """Every benchmark task both models were scored on, by its first metric: the preference stage's guards."""
    if evaluation.production is None or not evaluation.candidate.benchmarks:
        return []
    out = []
    for task, metrics in (evaluation.candidate.benchmarks.get("tasks") or {}).items():
        metric = f"benchmark:{task}/{next(iter(metrics))}"
        try:
            out.append(
                compare_benchmark(
                    metric,
                    evaluation.candidate.benchmarks,
                    evaluation.production.benchmarks,
                    policy.confidence,
                )
            )
        except BenchmarkError:  # production was not scored on it: no guard to apply
            continue
    return out


def benchmark_comparison(
    policy: PromotionPolicy, evaluation: CheckpointEvaluation
) -> BenchmarkComparison | None:
    """The gate's benchmark metric on both models, when the gate decides on a benchmark and production was scored."""
    if not policy.benchmark or evaluation.production is None:
        return None
    try:
        return compare_benchmark(
            policy.metric,
            evaluation.candidate.benchmarks,
            evaluation.production.benchmarks,
            policy.confidence,
        )
    except BenchmarkError as error:  # e.g. a metric the task does not report: configs/promotion.yaml
        raise dg.Failure(f"promotion gate metric {policy.metric}: {error}", allow_retries=False) from error


def log_to_mlflow(tracking: TrackingResource, report: EvalReport, lineage: dict) -> None:
    with tracking.start_run(
        run_name=f"eval-{report.checkpoint_id}",
        tags={"stage": "evaluation", "checkpoint_id": report.checkpoint_id},
    ) as run:
        run.log_params(lineage)
        run.log_metrics(mlflow_metrics(report))
        run.log_stored_file(report.report_json, "report.json")
        run.log_stored_file(report.report_markdown, "report.md")


def report_metadata(report: EvalReport, ckpt: Checkpoint) -> dict[str, object]:
    """The report's figures (rounded for reading), the Markdown report, its JSON and the loss curve."""
    figures = {k: round(v, 4) if isinstance(v, float) else v for k, v in report_figures(report).items()}
    curve = loss_curve_markdown(ckpt)
    with io.open_read(report.report_markdown) as f:
        markdown = f.read().decode("utf-8")
    return {
        **figures,
        "report": dg.MetadataValue.md(markdown),
        "report_json": dg.MetadataValue.path(report.report_json),
        **({"loss_curve": dg.MetadataValue.md(curve)} if curve else {}),
    }


def as_metadata(values: dict[str, object]) -> dict[str, object]:
    """Lists as JSON metadata values (Dagster takes scalars as they are)."""
    return {k: (dg.MetadataValue.json(v) if isinstance(v, list) else v) for k, v in values.items()}


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
def leaderboard(
    context: dg.AssetExecutionContext,
    eval_report: dict[str, EvalReport],
    base_model_eval: dict[str, BaseModelEval],
    storage: StorageResource,
) -> pd.DataFrame:
    production = ProductionRegistry(storage.production_pointer()).current()
    in_production = production.checkpoint_id if production else None
    rows = [
        leaderboard_row(
            r,
            r.checkpoint_id == in_production,
            describe(read_outcome(storage.deployment_dir(r.checkpoint_id))),
        )
        for r in eval_report.values()
    ]
    # base models: measured on the version's frozen corpus documents, not on its SFT samples (a stage of its own)
    rows += [base_leaderboard_row(r) for r in base_model_eval.values()]
    # rows of one eval-set version and stage are comparable: the newest version first, SFT checkpoints before
    # base models, best loss first within them
    board = (
        pd.DataFrame(rows)
        .astype({"eval_set_version": "Int64"})
        .sort_values(
            ["eval_set_version", "stage", "eval_loss"], ascending=[False, False, True], na_position="last"
        )
        .reset_index(drop=True)
    )
    csv_path = io.join(storage.results_path("evaluation"), "leaderboard.csv")
    io.write_text(board.to_csv(index=False), csv_path)
    context.add_output_metadata(
        {
            "dagster/row_count": len(board),
            "leaderboard": dg.MetadataValue.md(board.to_markdown(index=False, floatfmt=".4f")),
            "csv": dg.MetadataValue.path(csv_path),
            "production": production.checkpoint_id if production else None,
        }
    )
    return board
