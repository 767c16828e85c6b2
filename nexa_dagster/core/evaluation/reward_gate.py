"""The RL stage's promotion rule: the paired per-prompt reward difference on prompts never trained on.

The candidate (GRPO from production) and production both answer the frozen held-out RL prompts greedily, and
the same verifiable reward scores both answers: ``d_i = reward(candidate_i) - reward(production_i)`` per prompt.
Pairing removes the prompts' own difficulty (a hard prompt is hard for both). The decision is in ONE function,
``decide_reward``, that takes those differences, so a later guard (rare regressions, a skewness refusal) slots in
there. Its interval is the project's (``promotion.yaml``'s ``interval_method``: Hall's skew-corrected t by default,
``core.evaluation.paired``) of the mean difference; its minimum n is ``rl.min_prompts``; then the guards every gate
shares (``promotion.conclude``): the eval-set loss must be shown no worse than ``rl.max_eval_loss_regression`` (a
non-inferiority test: RL must not buy its reward with the language model), the benchmarks likewise, the reward
must survive the length control, the training data must not hold the eval set. Dagster-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from nexa_dagster.core.evaluation.benchmarks import BenchmarkComparison
from nexa_dagster.core.evaluation.guards import GuardPolicy, GuardReport, paired_guards
from nexa_dagster.core.evaluation.paired import (
    INTERVAL_METHODS,
    Interval,
    LengthControlled,
    PairedLoss,
    length_controlled_win_rate,
    paired_loss_difference,
    pointwise_verdicts,
)
from nexa_dagster.core.evaluation.promotion import (
    Evidence,
    GateDecision,
    ProductionEntry,
    PromotionPolicy,
    conclude,
)
from nexa_dagster.core.rl.rewards import combined_reward


def mean_difference_interval(
    differences: Sequence[float], confidence: float, method: str, resamples: int = 2000
) -> Interval:
    """The mean of the per-prompt differences with the policy's interval over prompts: the paired statistic of
    ``paired_loss_difference`` with every prompt weighing one (its "tokens" all 1), so the reward gate and the
    loss gate compute their intervals with one implementation."""
    d = np.asarray(differences, dtype=np.float64)
    return paired_loss_difference(
        d, np.zeros_like(d), np.ones_like(d), confidence, resamples, 0, method
    ).difference


def decide_reward(
    checkpoint_id: str,
    production: ProductionEntry | None,
    policy: PromotionPolicy,
    differences: Sequence[float],
    paired_loss: PairedLoss | None = None,
    means: tuple[float, float] | None = None,
    slices: Sequence[str] | None = None,
    *,
    benchmarks: Sequence[BenchmarkComparison] = (),
    length_controlled: LengthControlled | None = None,
    contamination: float | None = None,
) -> GateDecision:
    """Promote iff the interval of the mean reward difference (candidate - production) lies above
    ``rl.margin`` on at least ``rl.min_prompts`` prompts and every gate's guards hold (``promotion.conclude``): the
    eval-set loss shown no worse than ``rl.max_eval_loss_regression`` (not measured: insufficient evidence), each
    benchmark no worse than ``rl.max_benchmark_regression``, the reward verdicts' length-controlled win rate
    (``reward_length_control``) above ``rl.min_length_controlled_win_rate``, the training data no more
    contaminated than ``max_contamination``, and the guards on the per-prompt differences. ``means``: both
    models' mean rewards, for the figures. Fewer prompts: "insufficient evidence" (promoted with a warning only
    where ``on_insufficient_evidence`` says so and nothing shows the candidate worse)."""
    if production is None:
        return GateDecision(True, "no production model yet", decision="promote", rule="first model")
    if production.checkpoint_id == checkpoint_id:
        return GateDecision(
            True, f"{checkpoint_id} is production", decision="promote", rule="already production"
        )
    n = len(differences)
    if n < 2:
        return GateDecision(False, f"{n} held-out prompts scored: nothing to compare", n=n, rule="n >= 2")
    d = mean_difference_interval(
        differences, policy.confidence, policy.interval_method, policy.bootstrap_resamples
    )
    diffs = np.asarray(differences, dtype=np.float64)
    counts = (n, int(np.sum(diffs > 0)), int(np.sum(diffs < 0)))
    guard = reward_guards(differences, policy, slices) if n >= policy.rl.min_prompts else None
    evidence = Evidence(
        contamination,
        None,
        guard,
        **policy.rl.limits(),
        paired_loss=paired_loss,
        benchmarks=tuple(benchmarks),
        length_controlled=length_controlled,
    )
    return reward_decision(policy, d, counts, evidence, means)


def reward_decision(
    policy: PromotionPolicy,
    d: Interval,
    counts: tuple[int, int, int],
    evidence: Evidence,
    means: tuple[float, float] | None = None,
) -> GateDecision:
    """The reward gate's rule on a comparison's figures: the interval ``d`` of the mean reward difference,
    ``counts`` (n prompts, how many better, how many worse) and what the guards look at (``evidence``).
    ``decide_reward`` computes them from one set of differences; ``interval_coverage.reward_decisions`` for
    thousands of simulated sets at once (the same vectorised statistics), so the simulation decides with this one
    copy of the rule, and ``promotion.conclude`` applies the guards every gate shares."""
    gate, (n, wins, losses) = policy.rl, counts
    cand, prod = means if means is not None else (None, None)
    passed = d.low > gate.margin
    measured = GateDecision(
        passed,
        f"mean held-out reward difference {d.estimate:+.4f}, {policy.confidence:.0%} interval "
        f"[{d.low:+.4f}, {d.high:+.4f}] over n = {n} prompts ({wins} better, {losses} worse, {n - wins - losses} "
        f"equal); the interval {'is' if passed else 'is not'} above {gate.margin}",
        candidate=cand,
        production=prod,
        difference=d.estimate,
        interval=(d.low, d.high),
        n=n,
        method=f"{INTERVAL_METHODS[policy.interval_method]} over per-prompt reward differences",
        rule=f"reward interval low > {gate.margin}",
        worse=d.high < 0,
    )
    return conclude(measured, policy, (gate.min_prompts, "held-out prompts, rl.min_prompts"), evidence)


def reward_guard_policy(policy: PromotionPolicy) -> GuardPolicy:
    """The guards of ``promotion.yaml`` with the reward gate's own margin (``rl.regression_margin``, reward units)."""
    return policy.guards.model_copy(update={"regression_margin": policy.rl.regression_margin})


def reward_guards(
    differences: Sequence[float], policy: PromotionPolicy, slices: Sequence[str] | None = None
) -> GuardReport:
    """Issue 40's guards on the per-prompt reward differences (``core.evaluation.guards``): a reward gain built
    from many small wins and a few prompts that went from right to wrong is the same trap as a loss mean hiding rare
    regressions. The regressed share counts prompts whose reward fell by more than ``rl.regression_margin``;
    slices are the held-out rows' ``task`` (a candidate may not break one kind of task to win another)."""
    return paired_guards(
        differences,
        higher_is_better=True,
        policy=reward_guard_policy(policy),
        slices=slices,
        confidence=policy.confidence,
        unit="reward",
    )


def reward_length_control(
    candidate: Sequence[float],
    production: Sequence[float],
    candidate_lengths: Sequence[float],
    production_lengths: Sequence[float],
) -> LengthControlled:
    """The length guard of a reward gate: each prompt's verdict from the two rewards (the higher wins, equal is a
    tie and counts for neither, as the pointwise judge's scores), fitted on the answers' length difference as the
    judge's verdicts are (``paired.length_controlled_win_rate``, AlpacaEval's control): a reward that rises only
    because the answers got longer (a similarity reward that longer answers overlap more) wins at most half the
    prompts once the length is controlled for."""
    verdicts = [v if v != "tie" else None for v in pointwise_verdicts(list(candidate), list(production))]
    return length_controlled_win_rate(verdicts, verdicts, list(candidate_lengths), list(production_lengths))


def answer_lengths(scores: dict[str, Any]) -> list[float]:
    """Each held-out prompt's answer length in characters for one model's ``ModelScores`` JSON: the mean over its
    sampled answers when the evaluation sampled some (as ``prompt_rewards`` scores them), else its greedy answer's."""
    sampled = scores.get("sampled_answers")
    if sampled:
        return [float(np.mean([len(a) for a in answers])) for answers in sampled]
    return [float(len(a)) for a in scores["answers"]]


def prompt_rewards(
    rows: Sequence[dict[str, Any]], scores: dict[str, Any], rewards: Sequence[tuple[str, float]]
) -> list[float]:
    """Each held-out prompt's reward for one model's ``ModelScores`` JSON: the mean over its sampled answers when
    the evaluation sampled some (pass@1 from k samples), else its greedy answer's."""
    sampled = scores.get("sampled_answers")
    if not sampled:
        return held_out_rewards(rows, scores["answers"], rewards)
    k = len(sampled[0])
    if len(sampled) != len(rows) or any(len(s) != k for s in sampled):
        raise ValueError(f"sampled answers of {len(sampled)} prompts for {len(rows)} held-out prompts")
    per_draw = [held_out_rewards(rows, [s[j] for s in sampled], rewards) for j in range(k)]
    return [float(np.mean(column)) for column in zip(*per_draw, strict=True)]


def held_out_rewards(
    rows: Sequence[dict[str, Any]], answers: Sequence[str], rewards: Sequence[tuple[str, float]]
) -> list[float]:
    """Each held-out row's summed reward for its answer, by the same reward functions (``core.rl.rewards``,
    TRL's shape: completions plus the rows' columns by name) that training maximised."""
    if len(rows) != len(answers):
        raise ValueError(f"{len(answers)} answers for {len(rows)} held-out prompts")
    columns: dict[str, list[Any]] = {"prompts": [r["prompt"] for r in rows]}
    for name in sorted({k for r in rows for k in r} - {"prompt"}):
        columns[name] = [r.get(name) for r in rows]
    totals, _ = combined_reward(list(rewards))(list(answers), **columns)
    return [float(t) for t in totals]
