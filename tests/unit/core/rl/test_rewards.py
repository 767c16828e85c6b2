"""The reward functions on hand-made cases: what a right answer scores, and each way a policy can game a reward
(an empty answer, the reference's words shuffled by the project's negative-control transform, the prompt echoed,
an over-long answer, every choice listed at once) scoring low."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nexa_dagster.core.packaging.transforms import shuffle_answer_words
from nexa_dagster.core.rl.rewards import (
    REWARDS,
    check_columns,
    combined_reward,
    exact_answer,
    first_span,
    normalize_answer,
    reference_f1,
    reward_function,
)

MODULE_PROMPT = (
    "Which Python standard-library module does this docstring belong to? "
    '"Serialize obj as a JSON formatted stream to fp." Answer with the module name only.'
)
MODULES = ["json", "pickle", "os", "sys", "re", "csv", "shelve", "marshal"]
NEXT_PROMPT = 'Continue this Python docstring with its next words: "Return a new view of the dictionary\'s"'
REFERENCE = (
    "The json module encodes Python objects as JSON text and decodes JSON text back into Python objects"
)


def shuffled(text: str, seed: int = 0) -> str:
    """``text``'s words in the order the project's negative-control transform puts an answer's words."""
    record = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]}
    return shuffle_answer_words(seed)(record)["messages"][1]["content"]


def exact(completions: list[str], answer: str, prompt: str = MODULE_PROMPT) -> list[float]:
    n = len(completions)
    return exact_answer(completions, answer=[answer] * n, task=["module"] * n, prompts=[prompt] * n)


def f1(completions: list[str], reference: str = REFERENCE) -> list[float]:
    n = len(completions)
    return reference_f1(completions, reference=[reference] * n, prompts=[MODULE_PROMPT] * n)


# -- exact_answer -----------------------------------------------------------------------------------------------
def test_exact_answer_accepts_the_answer_in_its_usual_wrappings() -> None:
    right = ["json", "JSON", "`json`.", "json.", "**json**", "  json\n", "json.\nIt encodes.", "'json'"]
    assert exact(right, "json") == [1.0] * len(right)
    assert exact(
        ["return a new view of the dictionary's keys"], "Return a new view of the dictionary's keys"
    ) == [1.0]


def test_exact_answer_refuses_wrong_and_gamed_answers() -> None:
    """Each case is a way to collect the reward without knowing the answer; each must score 0."""
    gamed = {
        "empty": "",
        "blank": "   \n ",
        "wrong": "pickle",
        "prefix of a longer name": "json.decoder",
        "every choice listed": ", ".join(MODULES),
        "every choice, one per line": "\n".join(MODULES),
        "the prompt echoed": MODULE_PROMPT,
        "over-long: the answer, then a ramble": "json " + "and also pickle and os and sys " * 8,
        "over-long: the answer repeated": " ".join(["json"] * 40),
        "answer inside a sentence": "I think the module is json",
    }
    scores = exact(list(gamed.values()), "json")
    assert dict(zip(gamed, scores, strict=True)) == dict.fromkeys(gamed, 0.0)


def test_exact_answer_next_words_task_needs_those_words_not_more_or_fewer() -> None:
    answer = "keys and values"
    cases = {
        "keys and values": 1.0,
        "keys and values.": 1.0,
        "keys": 0.0,
        "values and keys": 0.0,
        "keys and values and items and everything else it holds in any order": 0.0,
        NEXT_PROMPT: 0.0,
    }
    assert exact(list(cases), answer, NEXT_PROMPT) == list(cases.values())


def test_normalisation_and_first_span() -> None:
    assert normalize_answer("  `OS.Path`. ") == "os.path"
    assert normalize_answer("os path") != normalize_answer("os.path")
    assert first_span("json. Then pickle.") == "json."
    assert first_span("\n  json\npickle") == "json"


# -- reference_f1 -----------------------------------------------------------------------------------------------
def test_reference_f1_is_one_for_the_reference_and_low_for_gamed_answers() -> None:
    assert f1([REFERENCE, REFERENCE.upper() + "."]) == [1.0, 1.0]
    gamed = {
        "empty": "",
        "the reference's words shuffled": shuffled(REFERENCE),
        "the prompt echoed": MODULE_PROMPT,
        "over-long: the reference buried in repetition": " ".join([REFERENCE] * 6),
        "every choice listed": " ".join(MODULES),
    }
    scores = dict(zip(gamed, f1(list(gamed.values())), strict=True))
    assert shuffled(REFERENCE) != REFERENCE and sorted(shuffled(REFERENCE).split()) == sorted(
        REFERENCE.split()
    )
    for case, score in scores.items():
        assert score < 0.35, (case, score)
    half = " ".join(
        REFERENCE.split()[:9]
    )  # a real partial answer earns partial credit, above every gamed one
    assert max(scores.values()) < f1([half])[0] < 1.0


def test_reference_f1_of_a_one_word_reference() -> None:
    assert f1(["json", "json pickle os sys", ""], reference="json") == [
        1.0,
        pytest.approx(2 * 0.2 * 0.5 / 0.7),
        0.0,
    ]


def test_reference_f1_reads_rl_prompts_reference_answer_column() -> None:
    assert reference_f1([REFERENCE], reference_answer=[REFERENCE], prompts=["q"]) == [1.0]
    with pytest.raises(ValueError, match="'reference' or 'reference_answer'"):
        reference_f1([REFERENCE], answer=["x"], prompts=["q"])


# -- judge_score --------------------------------------------------------------------------------------------------
class _Verdict:
    def __init__(self, score: float | None) -> None:
        self.score = score


class _RecordingJudge:
    """Stands in for ``core.distill.judge.Judge`` only to show which answers judge_score sends to the judge; the
    real judge is exercised in test_judge_score_with_the_tiny_judge."""

    def __init__(self, score: float | None) -> None:
        self.asked: list[tuple[str, str]] = []
        self.score = score

    def judge_many(self, items: list[tuple[str, str]]) -> list[_Verdict]:
        self.asked.extend(items)
        return [_Verdict(self.score) for _ in items]


def test_judge_score_never_asks_about_empty_or_echoed_answers() -> None:
    judge = _RecordingJudge(5.0)
    fn = reward_function("judge_score", judge=judge)
    prompts = [[{"role": "system", "content": "s"}, {"role": "user", "content": MODULE_PROMPT}]] * 3
    assert fn(["", MODULE_PROMPT, "json"], prompts=prompts) == [0.0, 0.0, 1.0]
    assert judge.asked == [(MODULE_PROMPT, "json")]
    assert reward_function("judge_score", judge=_RecordingJudge(None))(["json"], prompts=["q"]) == [0.0]
    with pytest.raises(ValueError, match="needs a judge"):
        reward_function("judge_score")


def test_judge_score_with_the_tiny_judge(teacher_dir: Path) -> None:
    """The real pointwise judge of the project (logprobs method on the tiny model): a score in [0, 1] per answer."""
    from nexa_dagster.core.common.config import read_text
    from nexa_dagster.core.distill.judge import Judge
    from nexa_dagster.core.llm.local import LocalTransformersClient

    client = LocalTransformersClient(teacher_dir, batch_size=4)
    judge = Judge(client, read_text("prompts/judge.jinja"), read_text("prompts/judge_verdict.jinja"))
    scores = reward_function("judge_score", judge=judge)(["json", "", "pickle"], prompts=[MODULE_PROMPT] * 3)
    assert scores[1] == 0.0 and all(0.0 <= s <= 1.0 for s in scores)
    assert (
        scores[0] > 0.0
    )  # an expected score over 1..5 mapped to [0, 1]: above 0 unless the judge is certain of 1


# -- the registry -------------------------------------------------------------------------------------------------
def test_registry_combines_weighted_rewards_and_refuses_what_it_cannot_score() -> None:
    assert {"exact_answer", "reference_f1", "judge_score"} <= set(REWARDS)
    combined = combined_reward([("exact_answer", 2.0), ("reference_f1", 0.5)])
    totals, per_name = combined(
        ["json", "pickle"], answer=["json"] * 2, reference=["json"] * 2, prompts=["q"] * 2
    )
    assert per_name == {"exact_answer": [1.0, 0.0], "reference_f1": [1.0, 0.0]}
    assert totals == [2.5, 0.0]
    with pytest.raises(ValueError, match="unknown reward 'exact'"):
        combined_reward([("exact", 1.0)])
    with pytest.raises(ValueError, match="named twice"):
        combined_reward([("exact_answer", 1.0), ("exact_answer", 1.0)])
    with pytest.raises(ValueError, match="prompts.jsonl: reward 'exact_answer' needs a column 'answer'"):
        check_columns(["exact_answer"], {"prompt", "reference_answer"}, "prompts.jsonl")
    check_columns(["reference_f1"], {"prompt", "reference_answer"}, "prompts.jsonl")


def test_a_reward_returning_the_wrong_number_of_values_is_refused(monkeypatch: Any) -> None:
    monkeypatch.setitem(REWARDS, "broken", lambda **deps: lambda completions, **columns: [1.0])
    with pytest.raises(ValueError, match="returned 1 values for 2 completions"):
        combined_reward([("broken", 1.0)])(["a", "b"], prompts=["q", "q"])
