"""Preference pairs: which answer is chosen and which rejected, when a prompt gives no pair and why, and that the
eval set's held-out prompts never become pairs."""

from __future__ import annotations

import pandas as pd

from nexa_dagster.core.data.splits import is_held_out
from nexa_dagster.core.distill.pairs import choose_pair, gap_histogram, training_prompts
from nexa_dagster.core.distill.sample_gate import load_gate_config

GATE = load_gate_config("filters.production.yaml")
PROMPT = "Explain what a context manager does in Python."
GOOD = (
    "A context manager sets something up before a block runs and tears it down after, even when the block "
    "raises. Example: `with open(path) as f: data = f.read()` closes the file for you."
)
FAIR = (
    "It wraps a block: the with statement calls __enter__ first and __exit__ when the block ends or raises."
)
WEAK = "A context manager is a thing that manages a context in Python, it is used for managing contexts well."
REFUSAL = "As an AI language model, I think this is a fine explanation of the topic at hand for you to read."


def test_the_best_passing_answer_is_chosen_against_the_worst() -> None:
    candidates = [("teacher", FAIR, 7.0, 30), ("policy:0", GOOD, 9.0, 40), ("policy:1", WEAK, 3.0, 25)]
    pair, why = choose_pair(PROMPT, candidates, GATE, min_score_gap=1.0)
    assert why == ""
    (chosen, rejected) = pair
    assert (chosen[0], rejected[0]) == ("policy:0", "policy:1")


def test_an_answer_failing_the_heuristics_is_never_chosen_but_may_be_rejected() -> None:
    candidates = [("policy:0", REFUSAL, 10.0, 25), ("teacher", GOOD, 8.0, 40), ("policy:1", WEAK, 2.0, 25)]
    (chosen, rejected), _ = choose_pair(PROMPT, candidates, GATE, min_score_gap=1.0)
    assert chosen[0] == "teacher" and rejected[0] == "policy:1"
    only_refusal_low = [("teacher", GOOD, 8.0, 40), ("policy:0", REFUSAL, 1.0, 25)]
    (chosen, rejected), _ = choose_pair(PROMPT, only_refusal_low, GATE, min_score_gap=1.0)
    assert (chosen[0], rejected[0]) == ("teacher", "policy:0")


def test_no_pair_says_why() -> None:
    assert choose_pair(PROMPT, [("teacher", GOOD, 8.0, 40), ("policy:0", FAIR, 7.5, 30)], GATE, 1.0) == (
        None,
        "score gap below 1.0",
    )
    assert choose_pair(
        PROMPT, [("teacher", GOOD, 8.0, 40), ("policy:0", GOOD + "  ", 2.0, 40)], GATE, 1.0
    ) == (
        None,
        "every answer is the same text",
    )
    assert choose_pair(PROMPT, [("policy:0", REFUSAL, 8.0, 25), ("policy:1", "", 1.0, 0)], GATE, 1.0) == (
        None,
        "no answer passes the heuristics",
    )


def test_ties_are_broken_the_same_way_every_time() -> None:
    a = [("policy:1", GOOD, 9.0, 40), ("policy:0", FAIR, 9.0, 30), ("teacher", WEAK, 2.0, 25)]
    first, _ = choose_pair(PROMPT, a, GATE, 1.0)
    second, _ = choose_pair(PROMPT, list(reversed(a)), GATE, 1.0)
    assert first == second and first[0][0] == "policy:0"


def test_held_out_prompts_are_left_out() -> None:
    samples = pd.DataFrame({"sample_id": [f"s{i}" for i in range(200)]})
    usable, held = training_prompts(samples, 0.2)
    expected = sum(is_held_out(f"s{i}", 0.2) for i in range(200))
    assert held == expected and 0 < held < 200
    assert not any(is_held_out(s, 0.2) for s in usable["sample_id"])
    assert len(usable) + held == 200


def test_gap_histogram_counts_every_pair_once() -> None:
    counts = gap_histogram(pd.DataFrame({"score_gap": [0.2, 0.5, 0.99, 1.0, 2.5, 7.0]}))
    assert counts["[0.0, 0.5)"] == 1 and counts["[0.5, 1.0)"] == 2 and counts["[1.0, 1.5)"] == 1
    assert counts["[2.0, 3.0)"] == 1 and counts["[4.0, inf)"] == 1 and sum(counts.values()) == 6
