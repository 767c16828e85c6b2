"""The reward gate's sampled answers (``rl.eval_samples``): k answers per prompt from a real model, grouped by
prompt, and the same draws for the same seed (what makes two models' evaluations comparable and reruns equal)."""

from __future__ import annotations

from pathlib import Path

from nexa_dagster.core.evaluation.scoring import AnswerSampling, sample_answers
from nexa_dagster.core.llm.local import LocalTransformersClient

PROMPTS = [
    "Rate from 1 to 5 how well the json module documents dumps.",
    "Which Python reference topic is this passage from? Choices: assert, for, while, with",
    "Explain the pass statement in one sentence.",
]


def test_k_answers_per_prompt_grouped_by_prompt_and_repeatable_with_the_seed(teacher_dir: Path) -> None:
    sampling = AnswerSampling(samples=4, temperature=1.0, seed=7, batch_size=8)  # two prompts per call
    with LocalTransformersClient(teacher_dir, batch_size=2) as client:
        first = sample_answers(client, PROMPTS, 6, sampling)
        again = sample_answers(client, PROMPTS, 6, sampling)
        assert client.batch_size == 2, "the client's own batch size is back after sampling"
    assert [len(group) for group in first] == [4, 4, 4]
    assert first == again, "the same seed draws the same answers"
    assert any(len(set(group)) > 1 for group in first), "answers are sampled, not one greedy answer repeated"


def test_one_prompt_repeated_in_every_call_gets_new_draws_in_each(teacher_dir: Path) -> None:
    """Each generate call has a seed of its own: the same prompt asked in three calls (one per call) is not
    answered with the same draws three times, as it would be under one seed reset per call."""
    sampling = AnswerSampling(samples=6, temperature=1.0, seed=3, batch_size=6)
    with LocalTransformersClient(teacher_dir, batch_size=2) as client:
        groups = sample_answers(client, [PROMPTS[0]] * 3, 6, sampling)
    assert len({tuple(g) for g in groups}) == 3, groups
