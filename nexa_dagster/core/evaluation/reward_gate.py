"""The RL stage's promotion rule: the paired per-prompt reward difference on prompts never trained on.

The candidate (GRPO from production) and production both answer the frozen held-out RL prompts greedily, and
the same verifiable reward scores both answers: ``d_i = reward(candidate_i) - reward(production_i)`` per prompt.
Pairing removes the prompts' own difficulty (a hard prompt is hard for both). The decision is in ONE function,
``decide_reward``, that takes those differences, so a later guard (rare regressions, a skewness refusal) slots in
there. Its interval is the project's (``promotion.yaml``'s ``interval_method``: Hall's skew-corrected t by default,
``core.evaluation.paired``) of the mean difference; its minimum n is ``rl.min_prompts``; the eval-set loss guards
(a candidate whose loss is worse than production's by more than ``rl.max_eval_loss_regression``, the whole
interval included, is held back: RL must not buy its reward with the language model). Dagster-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from nexa_dagster.core.evaluation.guards import GuardPolicy, GuardReport, paired_guards
from nexa_dagster.core.evaluation.paired import INTERVAL_METHODS, Interval, PairedLoss, paired_loss_difference
from nexa_dagster.core.evaluation.promotion import (
    GateDecision,
    ProductionEntry,
    PromotionPolicy,
    apply_guards,
)


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
) -> GateDecision:
    """Promote iff the interval of the mean reward difference (candidate - production) lies above
    ``rl.margin`` on at least ``rl.min_prompts`` prompts and the eval-set loss guard holds. ``means``: both
    models' mean rewards, for the figures. Fewer prompts: "insufficient evidence", held back whatever the
    interval says (promoted with a warning only where ``on_insufficient_evidence`` says so)."""
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
    return reward_decision(policy, d, counts, guard, paired_loss, means)


def reward_decision(
    policy: PromotionPolicy,
    d: Interval,
    counts: tuple[int, int, int],
    guard: GuardReport | None,
    paired_loss: PairedLoss | None = None,
    means: tuple[float, float] | None = None,
) -> GateDecision:
    """The reward gate's rule on a comparison's figures: the interval ``d`` of the mean reward difference,
    ``counts`` (n prompts, how many better, how many worse) and the guards' report. ``decide_reward`` computes them
    from one set of differences; ``interval_coverage.reward_decisions`` for thousands of simulated sets at once
    (the same vectorised statistics), so the simulation decides with this one copy of the rule."""
    gate, (n, wins, losses) = policy.rl, counts
    cand, prod = means if means is not None else (None, None)
    passed = d.low > gate.margin
    decision = GateDecision(
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
    )
    if n < gate.min_prompts:
        shortfall = f"insufficient evidence: n = {n} < {gate.min_prompts} held-out prompts"
        if policy.on_insufficient_evidence == "promote":
            return replace(
                decision, passed=True, decision="promote", reason=f"WARN {shortfall}; {decision.reason}"
            )
        return replace(
            decision,
            passed=False,
            decision="insufficient evidence",
            reason=f"{shortfall}; held back whatever the interval says; {decision.reason}",
            rule=f"n >= {gate.min_prompts}",
        )
    guarded = loss_guard(decision, paired_loss, gate.max_eval_loss_regression)
    return apply_guards(guarded, guard)


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


def loss_guard(decision: GateDecision, paired_loss: PairedLoss | None, limit: float) -> GateDecision:
    """A passed decision held back when the eval-set loss got worse by more than ``limit``, the whole interval
    included (the candidate's loss minus production's, low end above the limit)."""
    rule = f"{decision.rule}; guard eval_loss regression <= {limit}"
    if not decision.passed or paired_loss is None or paired_loss.difference.low <= limit:
        return replace(decision, rule=rule)
    loss = paired_loss.difference
    guard = f"eval_loss worse by {loss.estimate:+.4f} nats/token, interval low {loss.low:+.4f} > {limit}"
    return replace(
        decision,
        passed=False,
        decision="hold back",
        guards=(guard,),
        reason=f"non-regression guard: {guard}; {decision.reason}",
        rule=rule,
    )


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
    from nexa_dagster.core.rl.rewards import combined_reward

    if len(rows) != len(answers):
        raise ValueError(f"{len(answers)} answers for {len(rows)} held-out prompts")
    columns: dict[str, list[Any]] = {"prompts": [r["prompt"] for r in rows]}
    for name in sorted({k for r in rows for k in r} - {"prompt"}):
        columns[name] = [r.get(name) for r in rows]
    totals, _ = combined_reward(list(rewards))(list(answers), **columns)
    return [float(t) for t in totals]
