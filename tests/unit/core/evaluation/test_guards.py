"""The guards on the examples that got worse hold back a model the mean alone would promote: skewed toward rare
regressions, too many regressed examples, one slice broken; wherever the whole gate decides, its false promotions
stay at or below 2.5% on every guaranteed population of its simulation, the loss gate's and the RL reward gate's
(simulated with the code the gate runs), and the residual is what docs/stages/evaluation.md states."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from scipy.stats import beta
from scipy.stats import t as t_dist

from nexa_dagster.core.common.config import REPO_ROOT
from nexa_dagster.core.evaluation import interval_coverage as sim
from nexa_dagster.core.evaluation.guards import (
    GuardPolicy,
    detectable_examples,
    paired_guards,
    regressed_bounds,
    required_examples,
    skew_refuses,
    skewness,
    unseen_probability,
)
from nexa_dagster.core.evaluation.paired import paired_loss_difference, pointwise_win_rate
from nexa_dagster.core.evaluation.promotion import (
    ProductionEntry,
    PromotionPolicy,
    decide,
    decide_preference,
    eval_loss_guard,
    judge_score_guard,
    load_policy,
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
    # the skewness rule alone (the detectable-share rule would refuse n = 47 and 30 on their size alone)
    policy = GuardPolicy(max_regressed_share=None, min_detectable_regressed_share=None, slice_by=None)
    report = paired_guards(gains, higher_is_better=False, policy=policy)
    assert report.skewness < 0 and report.verdict is None
    refused = [
        paired_guards(rng.normal(-0.1, 0.2, 30), higher_is_better=False, policy=policy).verdict is not None
        for _ in range(300)
    ]
    assert np.mean(refused) < 0.05  # Cochran's rule refuses a normal sample rarely (its skewness is noise)


def test_the_regressed_share_holds_back_or_asks_for_more_examples_with_its_exact_interval() -> None:
    policy = GuardPolicy(
        slice_by=None, skew_rule=False, min_detectable_regressed_share=None
    )  # this guard alone
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


def test_a_sample_too_small_to_hold_the_rarest_regressions_the_lab_names_is_insufficient_evidence() -> None:
    """The detectable-share rule: a sample of n holds none of a share p with probability (1 - p)^n; above half the
    gate's one-sided error (1.25 %: the other half is the interval's own) the decision is insufficient evidence,
    naming that probability and the n needed, the smallest n with (1 - p)^n <= 0.0125 (``detectable_examples``);
    the regressed-share guard's n for p with none regressed (``required_examples``) spends the whole 2.5 %."""
    for p in (0.10, 0.05, 0.03, 0.02):
        n, whole = detectable_examples(p), required_examples(p)
        assert unseen_probability(p, n) <= 0.0125 < unseen_probability(p, n - 1)
        assert unseen_probability(p, whole) < 0.025 <= unseen_probability(p, whole - 1) and whole < n
    assert [detectable_examples(p) for p in (0.10, 0.05, 0.03)] == [42, 86, 144]
    policy = GuardPolicy(max_regressed_share=None, skew_rule=False, slice_by=None)  # the rule alone
    (reason,) = paired_guards(np.full(85, -0.2), higher_is_better=False, policy=policy).reasons
    assert "n = 85 holds none of a 5% share" in reason and "0.95^85 = 1.28% > 1.25%" in reason
    assert "n >= 86 needed" in reason
    assert paired_guards(np.full(86, -0.2), higher_is_better=False, policy=policy).verdict is None
    off = policy.model_copy(update={"min_detectable_regressed_share": None})
    assert paired_guards(np.full(40, -0.2), higher_is_better=False, policy=off).verdict is None
    # a lab that waives insufficient evidence waives this too, with a WARN naming it
    cand, prod, tokens = _losses(np.full(50, -0.2) + np.random.default_rng(8).normal(0, 0.01, 50))
    waiving = PromotionPolicy(on_insufficient_evidence="promote")
    guard = eval_loss_guard(cand, prod, tokens, waiving)
    waived = decide("cand", PRODUCTION, waiving, paired_loss_difference(cand, prod, tokens), guard=guard)
    assert waived.passed and "WARN insufficient evidence: a sample of n = 50" in waived.reason


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


def _slice_with_p_value(p: float, n: int, sd: float = 0.1) -> np.ndarray:
    """n differences whose one-sided t-test for "worse" has p-value ``p`` exactly: a fixed standardized pattern
    (mean 0, sample standard deviation 1) scaled by ``sd`` around the mean that t quantile gives."""
    z = np.linspace(-1.0, 1.0, n)
    z = (z - z.mean()) / z.std(ddof=1)
    return float(t_dist.ppf(1 - p, n - 1)) * sd / np.sqrt(n) + sd * z


def test_holm_rejects_what_bonferroni_would_not_and_nothing_without_an_effect() -> None:
    policy = GuardPolicy(
        max_regressed_share=None, min_detectable_regressed_share=None, skew_rule=False, min_slice_examples=10
    )
    # three slices, each a little worse, with one-sided p-values 0.012, 0.02 and 0.03: Bonferroni (each p against
    # 0.05 / 3 = 0.0167) rejects only the first; Holm's step-down (0.012 <= 0.05/3, 0.02 <= 0.05/2, 0.03 <= 0.05)
    # rejects all three, and the gate names all three slices
    targets = {"a": 0.012, "b": 0.02, "c": 0.03}
    worse = np.concatenate([_slice_with_p_value(p, 40) for p in targets.values()])
    labels = [s for s in targets for _ in range(40)]
    report = paired_guards(worse, higher_is_better=False, policy=policy, slices=labels)
    by = {s.label: s for s in report.slices}
    assert {k: by[k].p_value for k in targets} == pytest.approx(targets, rel=1e-6)
    bonferroni = [k for k in targets if by[k].p_value * len(targets) <= 0.05]
    assert bonferroni == ["a"]
    assert all(by[k].significant for k in targets) and [s.adjusted_p for s in report.slices] == pytest.approx(
        [0.036, 0.04, 0.04]
    )  # Holm's adjusted p: max(3 * 0.012), max(0.036, 2 * 0.02), max(0.04, 1 * 0.03)
    assert report.verdict == "hold back" and sum(r.startswith("slice day=") for r in report.reasons) == 3
    # twenty slices of pure noise: Holm holds the family-wise error at 5 % (under independence exactly
    # 1 - (1 - 0.05/20)^20 = 4.9 % of good candidates held back). 2,000 evaluations: the Monte-Carlo error of a
    # rate of 5 % is 0.49 %, so the bound is 5 % plus 2.33 of them (a one-sided 99 % allowance for the simulation's
    # own noise, not for the test)
    reps = 2000
    held = 0
    labels20 = [str(i % 20) for i in range(200)]
    for seed in range(reps):
        noise = np.random.default_rng(seed).normal(0, 0.1, 200)
        held += (
            paired_guards(noise, higher_is_better=False, policy=policy, slices=labels20).verdict is not None
        )
    assert held / reps <= 0.05 + 2.33 * np.sqrt(0.05 * 0.95 / reps), held / reps


def test_a_win_rate_built_from_many_small_wins_and_a_few_large_losses_is_not_promoted() -> None:
    # 48 prompts: 42 answers scored 0.5 higher than production's, 6 scored 3 points lower (the rare-loss trap)
    ours = [4.0] * 42 + [1.5] * 6
    theirs = [3.5] * 42 + [4.5] * 6
    policy = PromotionPolicy()
    win = pointwise_win_rate(ours, theirs)
    assert win.rate.low > 0.5  # the win rate alone promotes
    guard = judge_score_guard(ours, theirs, policy)
    decision = decide_preference("pref", PRODUCTION, policy, sim.UNCHANGED_LOSS, win, [], guard=guard)
    assert decision.outcome in ("hold back", "insufficient evidence") and not decision.passed
    assert any("worse by > 1 judge points" in g for g in decision.guards), decision.guards
    # a fair win passes; on 100 prompts, since 48 cannot see a 5 % share of regressed prompts (n >= 86:
    # guards.min_detectable_regressed_share)
    fair = judge_score_guard([4.0] * 100, [3.5] * 100, policy)
    assert decide_preference(
        "pref",
        PRODUCTION,
        policy,
        sim.UNCHANGED_LOSS,
        pointwise_win_rate([4.0] * 100, [3.5] * 100),
        [],
        guard=fair,
    ).passed


POPS = {p.name: p for p in sim.GATE_POPULATIONS + sim.REWARD_POPULATIONS}
# every population of the simulation the gate must hold: the eval-loss gate's and the RL reward gate's
GUARANTEED = [p for p in sim.GATE_POPULATIONS + sim.REWARD_POPULATIONS if p.guaranteed]
LEVEL = 0.025  # the gate's one-sided level, (1 - confidence) / 2 at promotion.yaml's confidence 0.95
# 2,000 sets a cell, seed 20261126 (the module's): the Monte-Carlo error of a rate of 2.5 % is 0.35 %. Fixed seed, so
# the test is deterministic; its margin is stated where a cell is close (test docstrings)
DRAWS = 2000


def _mc_error(rate: float, draws: int = DRAWS) -> float:
    return float(np.sqrt(rate * (1 - rate) / draws))


def _rates(name: str, n: int, draws: int = DRAWS, policy: PromotionPolicy | None = None) -> dict[str, float]:
    """The simulated gate on a population: the RL reward gate's for ``REWARD_POPULATIONS``, else the loss gate's."""
    pop = POPS[name]
    rates = sim.reward_rates if pop in sim.REWARD_POPULATIONS else sim.gate_rates
    return rates(pop, n, draws, policy=policy)


def _without_detectable_rule(policy: PromotionPolicy) -> PromotionPolicy:
    return policy.model_copy(
        update={"guards": policy.guards.model_copy(update={"min_detectable_regressed_share": None})}
    )


@pytest.mark.parametrize("n", [30, 47, 72])
def test_below_the_n_its_rules_need_the_gate_refuses_every_eval_set_whatever_it_holds(n: int) -> None:
    """Structural, not a measured rate: below n = 36 (``required_examples(0.10)``) no sample can show that fewer
    than a tenth of examples regressed (0 of 30 has the exact interval [0, 11.6 %]), and below n = 86
    (``detectable_examples(0.05)``, guards.min_detectable_regressed_share) a sample holds none of a 5 % share too
    often (0.95^72 = 2.5 %, more than half the one-sided error). So at n = 30, 47 and 72 the gate promotes nothing,
    however good the candidate: the refusal is asserted with its reasons, on every population, gains included."""
    policy = load_policy()
    assert required_examples(policy.guards.max_regressed_share) == 36
    assert detectable_examples(policy.guards.min_detectable_regressed_share) == 86
    for pop in sim.GATE_POPULATIONS:
        for d in sim.decisions(*pop.draw(np.random.default_rng(7), 300, n), policy):
            assert not d.passed and d.outcome in ("insufficient evidence", "hold back"), (pop.name, d.reason)
            assert any("min_detectable_regressed_share" in g and "n >= 86 needed" in g for g in d.guards)
            if n < 36:  # the regressed-share guard refuses too, whatever the sample holds
                assert any("max_regressed_share" in g for g in d.guards), d.guards


def test_wherever_the_gate_decides_a_sample_misses_the_stated_share_in_at_most_half_its_level() -> None:
    """The rule that makes the simulated bound below hold (issue 47): the gate decides on a clean gain from n = 86
    on, and at every such n a sample holds none of min_detectable_regressed_share with probability at most half the
    one-sided level (the other half is the interval's own error on the samples that hold a few). Before, it decided
    from n = 72, where that probability alone is 2.49 % and the interval's misses came on top (3.0 % promoted)."""
    policy = load_policy()
    share = policy.guards.min_detectable_regressed_share
    assert share == sim.DETECTABLE_SHARE  # the simulation's guaranteed/residual split is the config's share
    clean = {
        n: paired_guards(np.full(n, -0.2), higher_is_better=False, policy=policy.guards)
        for n in range(30, 201)
    }
    deciding = [n for n, report in clean.items() if report.verdict is None]
    assert deciding == list(range(86, 201))
    assert all(unseen_probability(share, n) <= LEVEL / 2 for n in deciding)


@pytest.mark.simulation  # thousands of simulated eval sets: left out of make mutation
@pytest.mark.parametrize("n", [72, 86, 107, 128])
def test_wherever_the_gate_decides_it_promotes_a_truly_worse_model_at_most_2_5_percent_of_the_time(
    n: int,
) -> None:
    """Every guaranteed population of the simulation (``guaranteed``: the loss gate's, all truly worse by +0.01
    nats/token, and the RL reward gate's, no better or worse by 0.01 reward), at 72 (where the gate decided before
    issue 47), 86 (the first n it decides at now), 107 (make run's eval set) and 128 (the RL gate's held-out
    prompts): the gate with configs/promotion.yaml either refuses every set or promotes in <= 2.5 % of 2,000.
    Failed before at 72: log-normal regressions 3.0 %. The closest cell is that population at 86: 2.31 % on
    10,000 sets (Monte-Carlo error 0.15 %), 2.0 % on the 2,000 here. ``reward_equal`` is the boundary (a candidate
    exactly as good): a calibrated interval promotes it in 2.5 % by construction (2.37-2.43 % on 10,000 sets), so
    its bound adds three Monte-Carlo errors (0.35 % each). Beside them the power (a real gain promoted) at make
    run's and the RL gate's n, and the failing case the guards exist for: the interval alone above 5 %."""
    share, measured = load_policy().guards.min_detectable_regressed_share, {}
    for pop in GUARANTEED:
        measured[pop.name] = _rates(pop.name, n)
        rate = measured[pop.name]["gate"]
        if n < detectable_examples(share):
            assert rate == 0, (pop.name, n, rate)
            continue
        slack = 3 * _mc_error(LEVEL) if pop.name == "reward_equal" else 0.0
        assert rate <= LEVEL + slack, (pop.name, n, rate)
    if n in (107, 128):
        assert _rates("broad_gain", n)["gate"] >= 0.6
        assert _rates("reward_gain", n)["gate"] >= 0.85
        assert measured["lognormal_regressions"]["interval_alone"] > 0.05
        assert _rates("rare_gains", n)["coverage"] >= 0.9


@pytest.mark.simulation  # thousands of simulated eval sets: left out of make mutation
def test_a_lab_that_turns_the_detectable_share_rule_off_decides_at_n_47_and_pays_on_rarer_regressions() -> (
    None
):
    """n = 47 with the rule off (``min_detectable_regressed_share: null``), where the other guards let the gate
    promote (a real gain in about a fifth of eval sets): issue 40's three populations stay <= 2.5 % (the real test
    at 47), and 5 % of examples 2.0 worse is promoted in about 8 % (the measured limit the rule exists for), nearly
    all of it eval sets that hold none of the regressed examples (0.95^47 = 9.0 % of them)."""
    policy = _without_detectable_rule(load_policy())

    def rate(name: str) -> float:
        return _rates(name, 47, 4000, policy=policy)["gate"]

    for name in ("normal_worse", "student_t2.5_worse", "rare_regressions"):
        assert rate(name) <= LEVEL, name
    assert rate("broad_gain") >= 0.1
    rarer = rate("rarer_regressions")
    assert (
        LEVEL + 3 * _mc_error(LEVEL, 4000) < rarer <= unseen_probability(0.05, 47) + 3 * _mc_error(0.09, 4000)
    )


@pytest.mark.simulation  # thousands of simulated eval sets: left out of make mutation
@pytest.mark.parametrize("n", [107, 128])
def test_the_residual_regressions_rarer_than_the_stated_share_are_promoted_at_the_stated_rate(n: int) -> None:
    """The residual docs/stages/evaluation.md states: regressions rarer than min_detectable_regressed_share. A
    sample that holds none of them is distributed exactly as a sample of the clean gain around them, so no rule
    that promotes that gain can refuse it: 3 % of examples 3.0 worse is promoted in about the share of samples
    holding none, 0.97^107 = 3.8 % (0.97^128 = 2.0 %), and a share drawn per fine-tune, Beta(2, 38) (59 % of
    fine-tunes under 5 %), at most E[(1 - p)^n] = 38 * 39 / ((38 + n)(39 + n)) (7.0 %, 5.3 %) plus the interval's
    half of the level. Its fine-tunes at or above the share (``drawn_share_detectable``) are held above. Measured
    at 2,000 sets: 3.65 % / 4.05 % at 107, 2.1 % / 3.25 % at 128; at make run's n they exceed 2.5 %, which is
    why they are stated, not hidden: a lab that must catch 3 % sets that share (n >= 144)."""
    sparse = _rates("sparse_regressions", n)["gate"]
    assert sparse <= unseen_probability(0.03, n) + LEVEL / 2, sparse
    drawn = _rates("drawn_share", n)["gate"]
    assert LEVEL < drawn <= 38 * 39 / ((38 + n) * (39 + n)) + LEVEL / 2, drawn
    if n == 107:
        assert sparse > LEVEL, sparse
    assert detectable_examples(0.03) == 144
    # the RL reward gate's residual stays under the level: a pass@1 moves by at most 1, so 3 % of prompts from
    # right to wrong cannot hide behind the mean as 3-nats/token examples do (1.03 % / 0.98 % on 10,000 sets)
    assert _rates("reward_sparse_regressions", n)["gate"] <= LEVEL


def test_the_simulation_decides_with_the_gates_own_code_row_by_row() -> None:
    """``interval_coverage.decisions`` computes the figures of many eval sets at once and calls ``decide``; the
    per-row path a real evaluation runs (``paired_loss_difference``, ``eval_loss_guard``, ``decide``) gives the same
    decision, rule, guard findings and interval on 1,000 eval sets of varied shape and size (promoted, held back
    and refused ones among them)."""
    policy = _without_detectable_rule(load_policy())  # so that n = 47 can promote too
    outcomes = set()
    for name, n in [
        ("broad_gain", 47),
        ("broad_gain", 100),
        ("rare_regressions", 60),
        ("rarer_regressions", 100),
    ]:
        d, t = POPS[name].draw(np.random.default_rng(11), 250, n)
        for row, fast in zip(range(250), sim.decisions(d, t, policy), strict=True):
            zeros = np.zeros(n)
            paired = paired_loss_difference(
                d[row], zeros, t[row], policy.confidence, method=policy.interval_method
            )
            guard = eval_loss_guard(d[row], zeros, t[row], policy)
            slow = decide("candidate", sim.SIMULATED_PRODUCTION, policy, paired, guard=guard)
            assert (slow.outcome, slow.rule, slow.guards) == (fast.outcome, fast.rule, fast.guards), (
                name,
                row,
            )
            assert slow.interval == pytest.approx(fast.interval, rel=1e-9, abs=1e-12)
            outcomes.add(slow.outcome)
    assert outcomes == {"promote", "hold back", "insufficient evidence"}


@pytest.mark.simulation  # thousands of simulated eval sets: left out of make mutation
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


def _holm(p_values: dict[str, float]) -> dict[str, float]:
    """Holm's adjusted p-values, written out from the definition: sorted ascending, (m - rank) p, running max,
    capped at 1."""
    adjusted, running = {}, 0.0
    for rank, (label, p) in enumerate(sorted(p_values.items(), key=lambda kv: kv[1])):
        running = max(running, min(1.0, (len(p_values) - rank) * p))
        adjusted[label] = running
    return adjusted


def test_each_slice_gets_its_weighted_one_sided_t_and_holm_exactly_and_a_small_one_is_only_listed() -> None:
    """The slice guard's figures, recomputed from their definitions: per slice the token-weighted mean change
    toward worse, the one-sided t p-value on n - 1 degrees of freedom of the delta-method residuals, Holm's adjusted
    p over the tested slices; a slice with fewer than ``min_slice_examples`` is listed with its n and mean, untested;
    one with exactly that many is tested; a slice with no spread is worse for sure (p = 0), better for sure (p = 1)
    or unchanged (p = 0.5). Significant: rejected by Holm's step-down at 5 % and worse."""
    rng = np.random.default_rng(3)
    parts = {
        "a": rng.normal(0.02, 0.3, 12),  # a little worse, far from significant
        "b": rng.normal(-0.1, 0.2, 10),  # better, exactly min_slice_examples: tested
        "c": rng.normal(0.5, 0.1, 9),  # much worse but one short of min_slice_examples: listed only
        "d": np.full(10, 0.25),  # worse on every example alike (exactly: no spread at all)
        "e": np.full(10, -0.25),  # better on every example alike
        "f": np.zeros(10),  # unchanged
        "g": rng.normal(0.4, 0.2, 11),  # worse, significant
    }
    labels = [label for label, d in parts.items() for _ in d]
    worse = np.concatenate(list(parts.values()))
    w = rng.integers(5, 50, len(worse)).astype(float)
    policy = GuardPolicy(max_regressed_share=None, min_detectable_regressed_share=None, skew_rule=False)
    report = paired_guards(worse, higher_is_better=False, policy=policy, weights=w, slices=labels)
    by = {s.label: s for s in report.slices}
    assert [s.label for s in report.slices] == sorted(parts)
    expected_p = {}
    for label, d in parts.items():
        mask = np.asarray(labels) == label
        mean = float(np.average(worse[mask], weights=w[mask]))
        assert by[label].n == len(d) and by[label].worse_by == pytest.approx(mean, rel=1e-12, abs=1e-15)
        z = w[mask] * (worse[mask] - mean) / w[mask].mean()
        se = float(np.sqrt(np.sum(z**2) / (len(d) - 1) / len(d)))
        if label != "c" and se > 1e-12:
            expected_p[label] = float(t_dist.sf(mean / se, len(d) - 1))
    assert by["c"].p_value is None and by["c"].adjusted_p is None and not by["c"].significant
    expected_p.update({"d": 0.0, "e": 1.0, "f": 0.5})
    assert {k: s.p_value for k, s in by.items() if k != "c"} == pytest.approx(expected_p, rel=1e-9)
    holm = _holm(expected_p)
    assert {k: s.adjusted_p for k, s in by.items() if k != "c"} == pytest.approx(holm, rel=1e-9)
    assert max(holm.values()) == 1.0  # capped
    assert {k for k, s in by.items() if s.significant} == {"d", "g"}
    assert report.verdict == "hold back" and sum("slice day=" in r for r in report.reasons) == 2
    assert "over 6 slices" in next(r for r in report.reasons if "slice day=d" in r)
    with pytest.raises(ValueError, match="need one slice label per example, got 3 labels for 72 examples"):
        paired_guards(worse, higher_is_better=False, policy=policy, weights=w, slices=labels[:3])


def test_a_slice_worse_on_every_example_is_rejected_even_at_a_family_wise_error_of_zero() -> None:
    """Holm's step-down rejects while the adjusted p is at most the family-wise error, the bound included: a slice
    worse on every example (p = 0) is significant at confidence 1 (error 0), a noisy worse one is not."""
    worse = np.concatenate([np.full(10, 0.3), np.random.default_rng(1).normal(0.3, 0.2, 10)])
    policy = GuardPolicy(max_regressed_share=None, min_detectable_regressed_share=None, skew_rule=False)
    report = paired_guards(
        worse, higher_is_better=False, policy=policy, slices=["x"] * 10 + ["y"] * 10, confidence=1.0
    )
    assert [(s.label, s.significant) for s in report.slices] == [("x", True), ("y", False)]


def test_the_guard_report_names_every_figure_in_its_metadata_summary_and_json() -> None:
    """What the UI, the report and make run's summary read (``guard_*`` metadata, ``summary()``, ``to_json()``):
    every figure under its name, on a report with slices and a skew toward worse, and on one skewed toward better."""
    worse = np.array([0.0] * 18 + [0.6, 2.0])
    policy = GuardPolicy(min_detectable_regressed_share=None, min_slice_examples=10)
    labels = ["d1"] * 10 + ["d2"] * 10
    report = paired_guards(worse, higher_is_better=False, policy=policy, slices=labels)
    low, high = report.regressed_interval
    meta = report.metadata()
    assert meta == {
        "guard_verdict": report.verdict,
        "guard_reasons": report.reasons,
        "guard_skewness": report.skewness,
        "guard_skew_needs_n": report.skew_needs,
        "guard_regressed": 2,
        "guard_regressed_share": 0.1,
        "guard_regressed_interval": [low, high],
        "guard_regression_margin": 0.5,
        "guard_max_regressed_share": 0.1,
        "guard_min_detectable_share": None,
        "guard_slices": [
            {
                "label": s.label,
                "n": 10,
                "worse_by": s.worse_by,
                "p_value": s.p_value,
                "adjusted_p": s.adjusted_p,
                "significant": s.significant,
            }
            for s in report.slices
        ],
    }
    assert report.verdict == "insufficient evidence" and report.skewness > 0 and report.skew_needs > 20
    worst = report.slices[1]
    assert report.summary() == (
        f"skewness toward worse {report.skewness:+.2f} (Cochran's rule needs n >= {report.skew_needs}, n = 20); "
        f"2 of 20 examples worse by > 0.5 (10.0%, 95% CI [{low:.1%}, {high:.1%}]); 2 slices tested (Holm), "
        f"worst d2 worse by {worst.worse_by:+.4f}"
    )
    assert report.to_json() == {**meta, "n": 20, "summary": report.summary()}
    better = paired_guards(
        -worse, higher_is_better=False, policy=policy.model_copy(update={"max_regressed_share": None})
    )
    assert better.metadata()["guard_verdict"] == "pass" and better.skew_needs == 0
    assert better.summary().startswith(
        f"skewness toward worse {better.skewness:+.2f} (toward better: no limit, n = 20); "
    )
    assert better.summary().endswith("CI [0.0%, 16.8%])")


def test_the_guards_refuse_input_that_is_not_one_finite_difference_per_example() -> None:
    """Each malformed input is refused naming what is wrong, before any figure is computed; integer differences
    are taken as numbers (unsigned bytes are not negated into 255)."""
    policy = GuardPolicy(slice_by=None, min_detectable_regressed_share=None)
    bad = {
        "need a finite difference per example, got shape (2, 2)": np.zeros((2, 2)),
        "need a finite difference per example, got shape (0,)": np.zeros(0),
        "need a finite difference per example, got shape (3,)": np.array([0.1, np.nan, 0.2]),
    }
    for message, d in bad.items():
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            paired_guards(d, higher_is_better=False, policy=policy)
    with pytest.raises(ValueError, match=r"need one weight per difference, got \(2,\) weights for \(3,\)"):
        paired_guards(np.zeros(3), higher_is_better=False, policy=policy, weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="example 2 has a weight <= 0"):
        paired_guards(np.zeros(4), higher_is_better=False, policy=policy, weights=[1.0, 2.0, 0.0, 1.0])
    scores = paired_guards(np.ones(40, dtype=np.uint8), higher_is_better=True, policy=policy)
    assert scores.regressed == 0 and scores.verdict is None
    counts = paired_guards(
        np.ones(40), higher_is_better=False, policy=policy, weights=np.full(40, 3, np.uint8)
    )
    assert counts.regressed == 40 and counts.verdict == "hold back"


def _weighted_g1(d: np.ndarray, w: np.ndarray) -> float:
    """The adjusted skewness of the weighted mean's delta-method residuals, from its definition."""
    z = w * (d - np.sum(w * d) / np.sum(w)) / np.mean(w)
    n, m2, m3 = len(d), np.mean(z**2), np.mean(z**3)
    return float(m3 / m2**1.5 * np.sqrt(n * (n - 1)) / (n - 2))


def test_the_skewness_cochrans_rule_and_the_exact_interval_match_their_definitions_at_their_bounds() -> None:
    """``skewness`` row by row on unequal weights (each row its own weights and mean), 0 with fewer than three
    examples or no spread; Cochran's rule refusing at n = 25 G1^2 itself and only toward worse; the Clopper-Pearson
    bounds 0 with none regressed and 1 with all, the beta quantiles between."""
    rng = np.random.default_rng(12)
    d, w = rng.gamma(1.0, 1.0, (3, 9)), rng.integers(1, 40, (3, 9)).astype(float)
    w[1] *= 10.0
    assert skewness(d, w) == pytest.approx([_weighted_g1(d[i], w[i]) for i in range(3)], rel=1e-9)
    assert skewness(d[0, :3], w[0, :3]) == pytest.approx(_weighted_g1(d[0, :3], w[0, :3]), rel=1e-9)
    assert skewness(d[0, :2], w[0, :2]) == 0.0 and skewness(np.full(5, 0.3), np.ones(5)) == 0.0
    assert bool(skew_refuses(np.array(2.0), 100)) and not bool(skew_refuses(np.array(2.0), 101))
    assert bool(skew_refuses(np.array(0.9), 20)) and not bool(skew_refuses(np.array(2.0), 150))
    assert not bool(skew_refuses(np.array(-3.0), 10)) and not bool(skew_refuses(np.array(0.0), 1))
    low, high = regressed_bounds(np.array([0, 1, 20]), 20, 0.95)
    assert (low[0], high[2]) == (0.0, 1.0)
    assert low[1] == pytest.approx(beta.ppf(0.025, 1, 20)) and low[2] == pytest.approx(beta.ppf(0.025, 20, 1))
    assert high[0] == pytest.approx(beta.ppf(0.975, 1, 20)) and high[1] == pytest.approx(
        beta.ppf(0.975, 2, 19)
    )


def test_the_judge_score_guard_leaves_out_prompts_missing_a_score_with_their_slice_and_keeps_the_level() -> (
    None
):
    """A prompt either answer of which has no finite score is left out (and its slice label with it); two scored
    prompts are enough to guard, one is not; the guards decide at the policy's confidence."""
    ours = [4.0, None, float("nan"), 4.0, 4.0, 3.0]
    theirs = [3.0, 3.0, 3.0, None, float("nan"), 3.0]
    policy = PromotionPolicy(confidence=0.9)
    guard = judge_score_guard(ours, theirs, policy, slices=["a", "b", "c", "d", "e", "f"])
    assert guard is not None and guard.n == 2
    assert [s.label for s in guard.slices] == ["a", "f"] and guard.confidence == 0.9
    assert "90% CI" in guard.reasons[0]
    assert judge_score_guard(ours[:5], theirs[:5], policy) is None  # one scored prompt: nothing to guard
    with pytest.raises(ValueError):  # scores of different prompt lists are never paired silently
        judge_score_guard([4.0, 4.0, 4.0], [3.0, 3.0], policy)


def test_an_unchanged_slice_is_never_worse_even_at_a_lenient_confidence() -> None:
    """promotion.yaml allows any confidence in (0, 1): at 0.5 the family-wise level is 0.5, and a slice whose
    examples did not change at all (p = 0.5) reaches it, but a slice that got no worse cannot hold a candidate back."""
    policy = GuardPolicy(min_detectable_regressed_share=None, max_regressed_share=None)
    report = paired_guards(
        np.zeros(10), higher_is_better=False, policy=policy, slices=["x"] * 10, confidence=0.5
    )
    assert [(s.label, s.worse_by, s.p_value, s.significant) for s in report.slices] == [
        ("x", 0.0, 0.5, False)
    ]
    assert report.verdict is None


def test_the_regressed_share_finding_states_the_share_it_decided_on() -> None:
    policy = GuardPolicy(skew_rule=False, min_detectable_regressed_share=None, slice_by=None)
    report = paired_guards(np.r_[np.full(20, 1.0), np.full(80, -0.2)], higher_is_better=False, policy=policy)
    low, high = report.regressed_interval
    assert report.reasons == [
        f"regressed: 20 of 100 examples worse by > 0.5 (20.0%, 95% CI [{low:.1%}, {high:.1%}]), above "
        "max_regressed_share 10%"
    ]
