"""The RL gate decides on the paired per-prompt reward difference with enough prompts, holds back a candidate that
is no better, refuses too small an n, guards the eval-set loss, and rarely promotes a worse model on real-shaped
(skewed, rare-regression) differences."""

from __future__ import annotations

import numpy as np
import pytest

from nexa_dagster.core.evaluation import interval_coverage as sim
from nexa_dagster.core.evaluation.paired import Interval, PairedLoss
from nexa_dagster.core.evaluation.promotion import ProductionEntry, PromotionPolicy
from nexa_dagster.core.evaluation.reward_gate import decide_reward

PRODUCTION = ProductionEntry(checkpoint_id="prod", checkpoint_path="checkpoints/prod", metric="eval_loss")
POLICY = PromotionPolicy()  # promotion.yaml's defaults: skew_t, 95 %, rl.min_prompts 30
# a gate that promotes needs n >= 86 prompts: fewer cannot see a 5 % share of regressed prompts often enough
# (guards.min_detectable_regressed_share, guards.detectable_examples; 48 held-out prompts are "insufficient evidence")
PROMPTS = 100
SAME = sim.UNCHANGED_LOSS  # the eval-set loss measured and unchanged: its non-inferiority guard holds


def exact_match_rewards(n: int, candidate_accuracy: float, production_accuracy: float, seed: int):
    """Per-prompt exact-match rewards (0 or 1) of both models on the same prompts: what the topic task gives."""
    rng = np.random.default_rng(seed)
    difficulty = rng.uniform(0, 1, size=n)  # a hard prompt is hard for both: paired
    return (
        (difficulty < candidate_accuracy).astype(float),
        (difficulty < production_accuracy).astype(float) * (rng.uniform(0, 1, size=n) < 0.9),
    )


def test_a_candidate_that_learned_the_task_is_promoted_with_n_method_and_rule_stated() -> None:
    candidate, production = exact_match_rewards(PROMPTS, 0.6, 0.1, seed=1)
    decision = decide_reward(
        "rl-1", PRODUCTION, POLICY, candidate - production, SAME, means=(candidate.mean(), production.mean())
    )
    assert decision.passed and decision.outcome == "promote" and decision.n == PROMPTS
    assert decision.interval is not None and decision.interval[0] > 0
    assert decision.method.startswith("skew-corrected t-interval")
    assert decision.rule == (
        "reward interval low > 0.0; guards eval_loss regression <= 0.05, benchmarks regression <= 0.05, "
        "length-controlled win rate > 0.5"
    )
    assert decision.metadata()["candidate"] == pytest.approx(candidate.mean())


def test_a_candidate_no_better_than_production_is_held_back() -> None:
    rng = np.random.default_rng(7)
    candidate, production = (
        (rng.uniform(0, 1, size=48) < 0.3).astype(float),
        (rng.uniform(0, 1, size=48) < 0.3),
    )
    decision = decide_reward("rl-1", PRODUCTION, POLICY, candidate - production, SAME)
    assert not decision.passed and decision.outcome == "hold back"
    assert decision.interval is not None and decision.interval[0] <= 0 < decision.interval[1]


@pytest.mark.parametrize("n", [1, 10, 29])
def test_too_few_held_out_prompts_decide_nothing_however_good_the_candidate_looks(n: int) -> None:
    decision = decide_reward("rl-1", PRODUCTION, POLICY, np.ones(n), SAME)
    assert not decision.passed and decision.outcome in ("insufficient evidence", "hold back")
    if n >= 2:
        assert decision.outcome == "insufficient evidence" and decision.rule.startswith("n >= 30; guards")
        assert f"insufficient evidence: n = {n} < 30" in decision.reason


def test_a_reward_bought_with_a_worse_language_model_is_held_back_by_the_loss_guard() -> None:
    candidate, production = exact_match_rewards(PROMPTS, 0.6, 0.1, seed=1)
    worse = PairedLoss(3.4, 3.0, Interval(0.4, 0.3, 0.5, 0.95), examples=47, tokens=2000)
    decision = decide_reward("rl-1", PRODUCTION, POLICY, candidate - production, worse)
    assert not decision.passed and decision.outcome == "hold back"
    assert decision.guards and "eval_loss worse by +0.4000" in decision.reason
    slightly = PairedLoss(3.02, 3.0, Interval(0.02, -0.01, 0.045, 0.95), examples=47, tokens=2000)
    assert decide_reward("rl-1", PRODUCTION, POLICY, candidate - production, slightly).passed


def test_no_production_model_or_a_reevaluation_is_not_a_comparison() -> None:
    assert decide_reward("rl-1", None, POLICY, []).rule == "first model"
    same = ProductionEntry(checkpoint_id="rl-1", checkpoint_path="checkpoints/rl-1", metric="eval_loss")
    assert decide_reward("rl-1", same, POLICY, []).rule == "already production"


def _rate(differences: np.ndarray, policy: PromotionPolicy = POLICY) -> float:
    """The share of simulated held-out sets (rows) the reward gate promotes: its own rule
    (``reward_gate.reward_decision``) on figures computed for all rows at once (``interval_coverage``)."""
    return float(np.mean([d.passed for d in sim.reward_decisions(differences, policy)]))


def _worse_or_equal(rng: np.random.Generator, sets: int, n: int) -> dict[str, np.ndarray]:
    """Three realistic shapes of a candidate no better than production (per-prompt reward differences; the
    populations' means are 0, 0 and -0.015)."""
    gain = rng.uniform(0.0, 0.1, size=(sets, n))
    rare = rng.uniform(0, 1, size=(sets, n)) < 0.1
    return {
        # exact-match rewards, equal accuracy: differences -1/0/+1, mostly 0 (ties), symmetric; 15 % of prompts
        # went from right to wrong, which the regressed-share guard sees
        "ties": rng.choice([-1.0, 0.0, 1.0], p=[0.15, 0.7, 0.15], size=(sets, n)),
        # equal accuracy with few flips (4 % each way): below max_regressed_share, so the interval decides
        "few_flips": rng.choice([-1.0, 0.0, 1.0], p=[0.04, 0.92, 0.04], size=(sets, n)),
        # F1-like rewards: a small gain on 90 % of prompts, a large loss on a rare 10 % (mean -0.015: worse)
        "skewed": np.where(rare, -rng.uniform(0.4, 0.8, size=(sets, n)), gain),
    }


@pytest.mark.simulation  # thousands of simulated eval sets: left out of make mutation
def test_a_worse_or_equal_candidate_is_promoted_at_most_2_5_percent_of_the_time() -> None:
    """The error that hurts: a candidate no better than production promoted. The one-sided 95 % interval's level
    is 2.5 %, and the bound is that, on 10,000 simulated held-out sets where the rate is near it (the Monte-Carlo
    error of a rate of 2.5 % is 0.16 %: a gate truly at 3 % passes the bound by chance in about 0.2 % of seeds) and 4,000
    where it is far below (0 - 0.7 %; error 0.25 %). At n = 100 with promotion.yaml;
    at the demo's n = 48 with the detectable-share rule off (which would refuse every set of 48), so that the
    interval and the other guards carry the test there. The few-flips shape sits near the level (about 2 % at
    n = 100): there the bound is the interval's own calibration, not a guard's margin."""
    rng = np.random.default_rng(2026)
    off = POLICY.model_copy(
        update={"guards": POLICY.guards.model_copy(update={"min_detectable_regressed_share": None})}
    )
    for n, policy in ((100, POLICY), (48, off)):
        for name, differences in _worse_or_equal(rng, 10_000, n).items():
            sets = 10_000 if name == "few_flips" else 4000  # far below the level (< 0.7 %): 4,000 are enough
            assert _rate(differences[:sets], policy) <= 0.025, (name, n)
    # the rule is what refuses at 48: every set, whatever it shows
    assert _rate(_worse_or_equal(rng, 500, 48)["few_flips"]) == 0


def test_the_reward_simulation_decides_exactly_as_decide_reward() -> None:
    """``interval_coverage.reward_decisions`` (vectorised figures, the gate's rule once per set) gives
    ``decide_reward``'s decision, rule, findings and reason on 600 sets of varied shape and size."""
    rng = np.random.default_rng(9)
    outcomes = set()
    for n in (48, 100):
        candidate, production = exact_match_rewards(n, 0.6, 0.1, seed=n)
        shapes = {**_worse_or_equal(rng, 100, n), "gain": (candidate - production) + np.zeros((100, 1))}
        for differences in shapes.values():
            for row, fast in zip(differences, sim.reward_decisions(differences, POLICY), strict=True):
                slow = decide_reward("rl", PRODUCTION, POLICY, row, SAME)
                assert (slow.outcome, slow.rule, slow.guards, slow.reason) == (
                    fast.outcome,
                    fast.rule,
                    fast.guards,
                    fast.reason,
                )
                outcomes.add(slow.outcome)
    assert outcomes == {"promote", "hold back", "insufficient evidence"}


def test_a_reward_gain_that_breaks_one_kind_of_task_is_held_back_by_the_guards() -> None:
    """Issue 40's trap in a reward gate: the mean gain's interval is above zero (many prompts went from wrong to
    right on one task), but an eighth of the prompts went from right to wrong, all on the other task. The mean
    alone promotes; the guards (the regressed share's exact interval, the broken slice) hold it back by name."""
    n_topic, n_next = 40, 24
    differences = np.concatenate(
        [np.r_[np.ones(30), np.zeros(n_topic - 30)], np.r_[-np.ones(8), np.zeros(n_next - 8)]]
    )
    tasks = ["topic"] * n_topic + ["next_words"] * n_next
    mean_only = decide_reward(
        "rl-1",
        PRODUCTION,
        POLICY.model_copy(
            update={
                "guards": POLICY.guards.model_copy(
                    update={
                        "max_regressed_share": 1.0,
                        "min_detectable_regressed_share": None,
                        "slice_by": None,
                        "skew_rule": False,
                    }
                )
            }
        ),
        differences,
        SAME,
    )
    assert mean_only.passed and mean_only.interval is not None and mean_only.interval[0] > 0
    guarded = decide_reward("rl-1", PRODUCTION, POLICY, differences, SAME, slices=tasks)
    assert not guarded.passed and guarded.outcome in ("hold back", "insufficient evidence")
    assert guarded.guard is not None and guarded.guard.verdict == guarded.outcome
    assert "next_words" in guarded.reason and "regressed" in guarded.reason, guarded.reason


def test_a_reward_gain_without_regressions_passes_the_guards() -> None:
    candidate, production = exact_match_rewards(96, 0.6, 0.1, seed=3)  # production right => candidate right
    tasks = ["topic", "next_words"] * 48
    decision = decide_reward("rl-1", PRODUCTION, POLICY, candidate - production, SAME, slices=tasks)
    assert decision.passed and decision.guard is not None and decision.guard.verdict is None
    assert "guards pass" in decision.reason


def test_held_out_rewards_score_both_models_answers_with_the_training_reward() -> None:
    from nexa_dagster.core.evaluation.reward_gate import held_out_rewards

    rows = [
        {
            "item_id": "topic:a",
            "prompt": "Which topic? ... Choices: assert, for",
            "task": "topic",
            "answer": "assert",
            "reference": "assert",
            "choices": ["assert", "for"],
            "doc_id": "a",
        },
        {
            "item_id": "topic:b",
            "prompt": "Which topic? ... Choices: with, del",
            "task": "topic",
            "answer": "del",
            "reference": "del",
            "choices": ["with", "del"],
            "doc_id": "b",
        },
    ]
    candidate = held_out_rewards(rows, ["assert", "del."], [("exact_answer", 1.0)])
    production = held_out_rewards(rows, ['The "x', "with, del"], [("exact_answer", 1.0)])
    assert candidate == [1.0, 1.0] and production == [0.0, 0.0]
    with pytest.raises(ValueError, match="1 answers for 2 held-out prompts"):
        held_out_rewards(rows, ["assert"], [("exact_answer", 1.0)])


def test_a_prompts_reward_is_the_mean_over_its_sampled_answers_when_the_evaluation_sampled() -> None:
    """rl.eval_samples > 0: each held-out prompt scores the mean reward of its k sampled answers (pass@1 from k
    samples), not its greedy answer; without samples the greedy answer decides; a ragged sample set is an error."""
    from nexa_dagster.core.evaluation.reward_gate import prompt_rewards

    rows = [
        {"prompt": "Which topic? Choices: assert, for", "answer": "assert", "choices": ["assert", "for"]},
        {"prompt": "Which topic? Choices: with, del", "answer": "del", "choices": ["with", "del"]},
    ]
    exact = [("exact_answer", 1.0)]
    greedy_right = {"answers": ["assert", "del"]}
    assert prompt_rewards(rows, greedy_right, exact) == [1.0, 1.0]
    sampled = {
        "answers": ["assert", "del"],  # the greedy answers are right, 3 of 4 and 1 of 4 samples are
        "sampled_answers": [["assert", "for", "assert", "assert."], ["with", "del", "The x", "with, del"]],
    }
    assert prompt_rewards(rows, sampled, exact) == [0.75, 0.25]
    with pytest.raises(ValueError, match="sampled answers of 1 prompts for 2 held-out prompts"):
        prompt_rewards(rows, {"answers": [], "sampled_answers": [["assert"]]}, exact)
    with pytest.raises(ValueError, match="sampled answers"):
        prompt_rewards(rows, {"answers": [], "sampled_answers": [["assert", "for"], ["del"]]}, exact)


def test_held_out_rewards_hand_each_reward_the_columns_training_hands_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reward functions see the held-out rows as GRPO training's see its prompts file
    (``grpo_rollout.load_prompts``, TRL's shape): each row's prompt as ``prompts``, every other field under its own
    name (None where a row lacks it), no ``prompt``; a reward missing its column names the columns there are."""
    from nexa_dagster.core.evaluation.reward_gate import held_out_rewards
    from nexa_dagster.core.rl import rewards

    seen: dict = {}

    def names_a_choice(completions: list[str], **columns) -> list[float]:
        seen.update(columns)
        return [float(c in p) for c, p in zip(completions, columns["prompts"], strict=True)]

    monkeypatch.setitem(rewards.REWARDS, "names_a_choice", lambda **deps: names_a_choice)
    rows = [
        {"prompt": "Which topic? Choices: assert, for", "answer": "assert"},
        {"prompt": "Which topic? Choices: with, del", "answer": "del", "task": "topic"},
    ]
    assert held_out_rewards(rows, ["for", "assert"], [("names_a_choice", 1.0)]) == [1.0, 0.0]
    assert seen == {
        "prompts": [r["prompt"] for r in rows],
        "answer": ["assert", "del"],
        "task": [None, "topic"],
    }
    with pytest.raises(ValueError, match=r"the rows have \['answer', 'prompts', 'task'\]"):
        held_out_rewards(rows, ["for", "assert"], [("reference_f1", 1.0)])


def test_answer_lengths_are_what_the_length_control_compares() -> None:
    """Each prompt's answer length in characters: the greedy answer's, or the mean over the sampled answers when
    the evaluation sampled (the answers ``prompt_rewards`` scored)."""
    from nexa_dagster.core.evaluation.reward_gate import answer_lengths

    assert answer_lengths({"answers": ["assert", "del"]}) == [6.0, 3.0]
    sampled = {
        "answers": ["assert", "del"],
        "sampled_answers": [["for", "assert."], ["with", "del", "The x"]],
    }
    assert answer_lengths(sampled) == [5.0, 4.0]
    assert answer_lengths({"answers": ["assert", "del"], "sampled_answers": []}) == [6.0, 3.0]
