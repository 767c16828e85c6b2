"""Pairs ranked by a verifiable reward: the right answer is chosen over a wrong one, a one-word answer needs no
heuristics, and answers the reward cannot tell apart make no pair."""

from __future__ import annotations

from types import SimpleNamespace

from nexa_dagster.core.distill.pairs import RewardScorer, choose_pair
from nexa_dagster.core.rl.rewards import reward_function

ROW = SimpleNamespace(
    prompt="Which Python reference topic is this passage from?\n\nThe assert statement ...\n\n"
    "Choices: lambda, assert, with, for\nAnswer with one of the choices.",
    answer="assert",
    task="topic",
    choices=["lambda", "assert", "with", "for"],
    reference="assert",
    response="assert",
)
SCORER = RewardScorer(reward_function("exact_answer"), "exact_answer")


def test_the_reward_scores_the_right_answer_over_wrong_ones_and_the_gamed_ones() -> None:
    answers = ["assert", "lambda", "lambda, assert, with, for", "", ROW.prompt]
    assert SCORER.score([ROW] * len(answers), answers) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert SCORER.reference_score(ROW) == 1.0 and SCORER.model_id == "reward:exact_answer"


def test_a_reward_ranked_pair_chooses_the_right_answer_without_heuristics() -> None:
    policy = ["lambda", "for"]
    scores = SCORER.score([ROW] * 2, policy)
    candidates = [("teacher", ROW.response, SCORER.reference_score(ROW), 1)]
    candidates += [(f"policy:{i}", a, s, 1) for i, (a, s) in enumerate(zip(policy, scores, strict=True))]
    pair, why = choose_pair(ROW.prompt, candidates, None, min_score_gap=0.5)
    assert why == "" and pair is not None
    (chosen, rejected) = pair
    assert (chosen[1], chosen[2]) == ("assert", 1.0) and rejected[2] == 0.0


def test_answers_the_reward_cannot_tell_apart_make_no_pair() -> None:
    candidates = [("policy:0", "lambda", 0.0, 1), ("policy:1", "for", 0.0, 1)]
    assert choose_pair(ROW.prompt, candidates, None, min_score_gap=0.5) == (None, "score gap below 0.5")


def test_the_pairs_schema_takes_a_reward_scale_and_keeps_the_judges_1_to_5() -> None:
    import pandas as pd
    import pytest

    from nexa_dagster.core.data import schemas

    row = {
        "pair_id": "p",
        "sample_id": "topic:0123456789abcdef",
        "day": "2026-11-20",
        "prompt": [{"role": "user", "content": ROW.prompt}],
        "chosen": [{"role": "assistant", "content": "assert"}],
        "rejected": [{"role": "assistant", "content": "lambda"}],
        "chosen_score": 1.0,
        "rejected_score": 0.0,
        "score_gap": 1.0,
        "chosen_source": "teacher",
        "rejected_source": "policy:0",
        "chosen_length": 6,
        "rejected_length": 6,
        "judge_model": "reward:exact_answer",
        "policy_model": "ckpt-1",
    }
    schemas.PreferencePairs.validate(pd.DataFrame([row]))
    with pytest.raises(Exception, match="_scores_in_range"):  # a judge's score of 0 is no judge score
        schemas.PreferencePairs.validate(pd.DataFrame([{**row, "judge_model": "tiny-judge"}]))
    with pytest.raises(Exception, match="_scores_in_range"):
        schemas.PreferencePairs.validate(pd.DataFrame([{**row, "chosen_score": float("inf")}]))
