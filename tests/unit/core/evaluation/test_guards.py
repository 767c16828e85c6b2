"""The guards on the examples that got worse hold back a model the mean alone would promote: skewed toward rare
regressions, too many regressed examples, one slice broken; the whole gate's false promotions stay at or below
2.5% on issue 40's populations at every n >= 30 (simulated with the code the gate runs)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from scipy.stats import beta

from nexa_dagster.core.common.config import REPO_ROOT
from nexa_dagster.core.evaluation import interval_coverage as sim
from nexa_dagster.core.evaluation.guards import (
    GuardPolicy,
    paired_guards,
    regressed_bounds,
    required_examples,
)
from nexa_dagster.core.evaluation.paired import paired_loss_difference, pointwise_win_rate
from nexa_dagster.core.evaluation.promotion import (
    ProductionEntry,
    PromotionPolicy,
    decide,
    decide_preference,
    eval_loss_guard,
    judge_score_guard,
)

PRODUCTION = ProductionEntry(checkpoint_id="prod", checkpoint_path="checkpoints/prod", metric="eval_loss")


def _losses(change: np.ndarray, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Candidate and production summed losses and tokens for per-example changes (nats per token)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(20, 80, size=len(change)).astype(float)
    production = rng.uniform(2.0, 4.0, size=len(change)) * tokens
    return production + change * tokens, production, tokens


def test_a_sample_skewed_toward_rare_regressions_is_insufficient_evidence_not_a_promotion() -> None:
    # 47 examples: 46 better by 0.1, one 0.3 worse (under the regression margin): the mean interval is below zero
    rng = np.random.default_rng(1)
    change = np.r_[np.full(46, -0.1), [0.3]] + rng.normal(0, 0.01, size=47)
    cand, prod, tokens = _losses(change)
    paired = paired_loss_difference(cand, prod, tokens)
    assert paired.difference.high < 0  # the mean alone promotes
    policy = PromotionPolicy()
    guard = eval_loss_guard(cand, prod, tokens, policy)
    assert guard.skewness > 1.5 and guard.skew_needs > 47 and guard.regressed == 0
    decision = decide("cand", PRODUCTION, policy, paired, guard=guard)
    assert decision.outcome == "insufficient evidence" and not decision.passed
    assert "skewed toward worse" in decision.reason and "Cochran" in decision.reason
    assert decision.metadata()["guard_verdict"] == "insufficient evidence"


def test_skew_toward_rare_gains_and_plain_noise_are_not_refused() -> None:
    rng = np.random.default_rng(2)
    gains = np.r_[np.full(45, 0.02), [-1.0, -1.2]] + rng.normal(0, 0.01, size=47)  # rare large gains
    policy = GuardPolicy(max_regressed_share=None, slice_by=None)
    report = paired_guards(gains, higher_is_better=False, policy=policy)
    assert report.skewness < 0 and report.verdict is None
    refused = [
        paired_guards(rng.normal(-0.1, 0.2, 30), higher_is_better=False, policy=policy).verdict is not None
        for _ in range(300)
    ]
    assert np.mean(refused) < 0.05  # Cochran's rule refuses a normal sample rarely (its skewness is noise)


def test_the_regressed_share_holds_back_or_asks_for_more_examples_with_its_exact_interval() -> None:
    policy = GuardPolicy(slice_by=None, skew_rule=False)
    many = np.r_[np.full(80, -0.2), np.full(20, 1.0)]  # 20% regressed by 1 nat/token
    report = paired_guards(many, higher_is_better=False, policy=policy)
    assert report.regressed == 20 and report.regressed_interval[0] > 0.10
    assert report.verdict == "hold back" and report.reasons[0].startswith("regressed: 20 of 100 examples")
    clean30 = paired_guards(np.full(30, -0.2), higher_is_better=False, policy=policy)
    assert (
        clean30.verdict == "insufficient evidence" and "n >= 36 needed with 0 regressed" in clean30.reasons[0]
    )
    assert paired_guards(np.full(36, -0.2), higher_is_better=False, policy=policy).verdict is None
    # the bounds are Clopper-Pearson's, the beta quantiles
    low, high = regressed_bounds(np.array([0, 3, 10]), 50, 0.95)
    assert high[0] == pytest.approx(1 - 0.025 ** (1 / 50))
    assert low[1] == pytest.approx(beta.ppf(0.025, 3, 48)) and high[2] == pytest.approx(
        beta.ppf(0.975, 11, 40)
    )
    assert [required_examples(p) for p in (0.10, 0.05)] == [36, 72]


def test_one_broken_slice_holds_back_a_candidate_better_on_most_examples() -> None:
    rng = np.random.default_rng(3)
    days = [f"2026-11-2{d}" for d in range(4) for _ in range(30)]
    change = np.where(np.array(days) == "2026-11-22", 0.15, -0.15) + rng.normal(0, 0.1, size=120)
    cand, prod, tokens = _losses(change, seed=3)
    paired = paired_loss_difference(cand, prod, tokens)
    assert paired.difference.high < 0
    policy = PromotionPolicy()
    guard = eval_loss_guard(cand, prod, tokens, policy, days)
    decision = decide("cand", PRODUCTION, policy, paired, guard=guard)
    assert decision.outcome == "hold back" and decision.rule == "interval high < -0.0; guards"
    (finding,) = decision.guards
    assert finding.startswith("slice day=2026-11-22 worse") and "Holm" in finding
    assert [s.significant for s in guard.slices] == [False, False, True, False]
    # the same candidate without the broken day is promoted: the slices find nothing to hold against it
    keep = np.array(days) != "2026-11-22"
    fine = eval_loss_guard(cand[keep], prod[keep], tokens[keep], policy, list(np.array(days)[keep]))
    kept = decide(
        "cand", PRODUCTION, policy, paired_loss_difference(cand[keep], prod[keep], tokens[keep]), guard=fine
    )
    assert kept.outcome == "promote" and "guards pass" in kept.reason


def test_holm_rejects_what_bonferroni_would_not_and_nothing_without_an_effect() -> None:
    rng = np.random.default_rng(4)
    policy = GuardPolicy(max_regressed_share=None, skew_rule=False, min_slice_examples=10)
    # three slices each mildly worse: Holm's step-down rejects all three where Bonferroni (x3) rejects fewer
    labels = [s for s in "abc" for _ in range(40)]
    worse = np.r_[rng.normal(0.05, 0.1, 40), rng.normal(0.045, 0.1, 40), rng.normal(0.04, 0.1, 40)]
    report = paired_guards(worse, higher_is_better=False, policy=policy, slices=labels)
    p = sorted(s.p_value for s in report.slices)
    holm = [s.adjusted_p for s in sorted(report.slices, key=lambda s: s.p_value)]
    assert holm == pytest.approx([max(3 * p[0], 0), max(3 * p[0], 2 * p[1]), max(3 * p[0], 2 * p[1], p[2])])
    # twenty slices of pure noise: the family-wise level holds (held back in at most about 5% of evaluations)
    held = 0
    for seed in range(200):
        noise = np.random.default_rng(seed).normal(0, 0.1, 400)
        labels20 = [str(i % 20) for i in range(400)]
        held += (
            paired_guards(noise, higher_is_better=False, policy=policy, slices=labels20).verdict is not None
        )
    assert held / 200 <= 0.08


def test_a_win_rate_built_from_many_small_wins_and_a_few_large_losses_is_not_promoted() -> None:
    # 48 prompts: 42 answers scored 0.5 higher than production's, 6 scored 3 points lower (the rare-loss trap)
    ours = [4.0] * 42 + [1.5] * 6
    theirs = [3.5] * 42 + [4.5] * 6
    policy = PromotionPolicy()
    win = pointwise_win_rate(ours, theirs)
    assert win.rate.low > 0.5  # the win rate alone promotes
    guard = judge_score_guard(ours, theirs, policy)
    decision = decide_preference("pref", PRODUCTION, policy, None, win, [], guard=guard)
    assert decision.outcome in ("hold back", "insufficient evidence") and not decision.passed
    assert any("worse by > 1 judge points" in g for g in decision.guards), decision.guards
    fair = judge_score_guard([4.0] * 48, [3.5] * 48, policy)
    assert decide_preference(
        "pref", PRODUCTION, policy, None, pointwise_win_rate([4.0] * 48, [3.5] * 48), [], guard=fair
    ).passed


ISSUE_POPULATIONS = ("normal_worse", "student_t2.5_worse", "rare_regressions")


@pytest.mark.parametrize("n", [30, 47, 100])
def test_the_gate_promotes_a_truly_worse_model_at_most_2_5_percent_of_the_time(n: int) -> None:
    """issue 40's populations (log-normal lengths, gamma per-token noise, truly worse by +0.01 nats/token): the
    whole gate with configs/promotion.yaml promotes in <= 2.5% of 3,000 simulated eval sets; the interval alone does
    not on rare regressions at n = 30 (the failing case the guards exist for)."""
    pops = {p.name: p for p in sim.GATE_POPULATIONS}
    for name in ISSUE_POPULATIONS:
        rates = sim.gate_rates(pops[name], n, draws=3000)
        assert rates["gate"] <= 0.025, (name, n, rates)
    if n == 30:
        assert sim.gate_rates(pops["rare_regressions"], n, draws=3000)["interval_alone"] > 0.04
    # beside it, the rare-gain mirror's coverage, and a real gain still promoted once the eval set can show it
    assert sim.gate_rates(pops["rare_gains"], n, draws=3000)["coverage"] >= 0.9
    if n == 100:
        assert sim.gate_rates(pops["broad_gain"], n, draws=3000)["gate"] >= 0.5


def test_a_lab_runs_the_simulation_on_its_own_eval_sets_differences(tmp_path) -> None:
    rng = np.random.default_rng(5)
    tokens = rng.integers(10, 90, size=120)
    change = np.where(rng.random(120) < 0.1, 1.0, -0.1)
    lines = [
        json.dumps({"difference": float(d), "tokens": int(t)}) for d, t in zip(change, tokens, strict=True)
    ]
    path = tmp_path / "diffs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "nexa_dagster.core.evaluation.interval_coverage",
            "--differences",
            str(path),
            "--weights",
            "tokens",
            "--draws",
            "2000",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = {r["n"]: r for r in result["gate"]}
    assert sorted(rows) == [30, 47, 100, 120]
    assert all(r["truth"] == pytest.approx(0.01) and r["gate"] <= 0.025 for r in rows.values()), rows
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "nexa_dagster.core.evaluation.interval_coverage",
            "--differences",
            str(path),
            "--column",
            "delta",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "no column 'delta'" in bad.stderr


def test_a_lab_that_waives_the_evidence_minimum_waives_the_guards_insufficiency_but_not_a_hold_back() -> None:
    policy = PromotionPolicy(min_examples=10, on_insufficient_evidence="promote")
    cand, prod, tokens = _losses(np.full(12, -0.2) + np.random.default_rng(6).normal(0, 0.01, 12))
    paired = paired_loss_difference(cand, prod, tokens)
    guard = eval_loss_guard(cand, prod, tokens, policy)
    assert guard.verdict == "insufficient evidence"  # 12 examples cannot rule out a tenth regressing
    waived = decide("cand", PRODUCTION, policy, paired, guard=guard)
    assert waived.passed and waived.reason.startswith("WARN insufficient evidence on regressions")
    assert waived.rule == "interval high < -0.0; guards (waived)"
    assert decide("cand", PRODUCTION, PromotionPolicy(min_examples=10), paired, guard=guard).outcome == (
        "insufficient evidence"
    )
    broken = np.r_[np.full(40, -0.2), np.full(20, 0.8)]  # a third regressed: held back, waiver or not
    cand, prod, tokens = _losses(broken)
    held = decide(
        "cand",
        PRODUCTION,
        policy.model_copy(update={"require_interval": False}),
        paired_loss_difference(cand, prod, tokens),
        guard=eval_loss_guard(cand, prod, tokens, policy),
    )
    assert held.outcome == "hold back" and held.guards[0].startswith("regressed: 20 of 60")
