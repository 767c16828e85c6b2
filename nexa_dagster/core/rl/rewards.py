"""Reward functions for online RL, pluggable by name, in TRL's shape.

A reward function takes the completions of a batch and the batch's prompt columns, one list entry per completion,
and returns one float per completion: ``fn(completions: list[str], **columns: list[Any]) -> list[float]`` — what
TRL's ``GRPOTrainer`` calls its reward functions with (``prompts`` is among the columns: each row's ``prompt`` as
written, a string or a chat messages list). ``REWARDS`` maps a name to a *factory* of such a function, so that a
reward needing something built at run time (the judge's client) registers the same way as a pure one.

What is rewarded, and how each can be gamed (``docs/stages/rl.md``; each case is a test in
``tests/unit/core/rl/test_rewards.py``):

* ``exact_answer``: 1.0 when the completion's first answer span, normalised, is the row's ``answer`` (a standard
  library module name, the next words of a docstring), else 0.0. Checkable, so a tiny model whose text carries no
  meaning can still be shown to get better. Listing every choice, echoing the prompt, rambling past the answer and
  answering nothing all score 0.
* ``reference_f1``: F1 of the word *bigrams* (with start and end markers) of the completion against the row's
  reference answer. Not unigram F1, SQuAD's: a bag of words is blind to order, so the reference's own words
  shuffled (the project's negative-control transform) would score 1.0. A one-word answer still has two bigrams
  (start-word, word-end), so an exact short answer scores 1.0.
* ``judge_score``: the judge's pointwise score (``core/distill/judge.py``, 1-5) mapped to [0, 1]; optional, and
  only as good as the judge: the tiny judge's scores carry no information about quality, so the demo does not use
  it. Empty completions and echoes of the prompt get 0 without asking the judge.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

RewardFn = Callable[..., list[float]]
RewardFactory = Callable[..., RewardFn]

_PUNCT_EDGE = " \t\r\n\"'`*_.,;:!?()[]{}<>"
_SPAN_END = re.compile(r"\n|(?<=[.!?;])\s")  # the first line, or the first sentence of it
_WORD = re.compile(r"\w+(?:[.'-]\w+)*", re.UNICODE)  # dotted names (os.path) and contractions stay one word


# -- text normalisation ---------------------------------------------------------------------------------------
def normalize_answer(text: str) -> str:
    """An answer as compared: NFKC, lower case, whitespace collapsed, surrounding quotes, backticks, markdown
    emphasis, brackets and punctuation stripped. ``"`JSON`."`` and ``json`` are the same answer; ``os.path`` and
    ``os path`` are not (the dot is inside the name)."""
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join(text.split()).strip(_PUNCT_EDGE)


def words(text: str) -> list[str]:
    """The words of ``text`` after ``normalize_answer``'s case and Unicode folding (punctuation dropped)."""
    return _WORD.findall(unicodedata.normalize("NFKC", text).lower())


def first_span(completion: str) -> str:
    """The completion's first answer span: up to its first line break or sentence end, leading blanks skipped."""
    text = completion.strip()
    match = _SPAN_END.search(text)
    return text[: match.start()] if match else text


def prompt_text(prompt: Any) -> str:
    """A row's ``prompt`` as text: a string as it is, a messages list as its user turns joined."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence):
        return "\n".join(
            str(m.get("content", "")) for m in prompt if isinstance(m, Mapping) and m.get("role") == "user"
        )
    return ""


def echoes_prompt(completion: str, prompt: Any, min_words: int = 4) -> bool:
    """True when the completion holds a run of ``min_words`` or more of the prompt's words in a row: a copy of the
    question, not an answer to it (no answer here repeats four words of its own question)."""
    have, asked = words(completion), words(prompt_text(prompt))
    if len(have) < min_words or len(asked) < min_words:
        return False
    grams = {tuple(asked[i : i + min_words]) for i in range(len(asked) - min_words + 1)}
    return any(tuple(have[i : i + min_words]) in grams for i in range(len(have) - min_words + 1))


# -- the rewards ----------------------------------------------------------------------------------------------
def column(columns: Mapping[str, Any], *names: str) -> list[Any]:
    """The first of ``names`` among the columns, or a ValueError naming what the reward needs and what it got."""
    for name in names:
        if columns.get(name) is not None:
            return list(columns[name])
    raise ValueError(
        f"the reward needs a column {' or '.join(map(repr, names))}; the rows have {sorted(columns)}"
    )


def exact_answer_score(completion: str, answer: str, max_extra_words: int | None = None) -> float:
    """1.0 when ``first_span(completion)`` normalises to ``answer`` and the completion does not go on much past it.

    "Much" is more words than the answer has plus two (``max_extra_words``): "json." or "json." then a short sentence pass;
    "json" followed by a list of other modules, or any ramble, does not — a verifier that read only the start would
    reward a policy for saying the answer and then everything else.
    """
    expected = normalize_answer(str(answer))
    if not expected or normalize_answer(first_span(completion)) != expected:
        return 0.0
    extra = len(words(completion)) - len(words(expected))
    allowed = len(words(expected)) + 2 if max_extra_words is None else max_extra_words
    return 1.0 if extra <= allowed else 0.0


def exact_answer(completions: list[str], **columns: Any) -> list[float]:
    """``exact_answer``: the row's ``answer`` column checked exactly (``exact_answer_score``)."""
    answers = column(columns, "answer")
    return [exact_answer_score(c, a) for c, a in zip(completions, answers, strict=True)]


def bigrams(text: str) -> Counter[tuple[str, str]]:
    """Word bigrams of ``text`` with start and end markers (a one-word text has two)."""
    tokens = ["<s>", *words(text), "</s>"]
    return Counter(zip(tokens, tokens[1:], strict=False))


def bigram_f1(completion: str, reference: str) -> float:
    """F1 of the completion's word bigrams against the reference's (clipped counts); 0.0 for an empty side."""
    have, want = bigrams(completion), bigrams(reference)
    if not words(completion) or not words(reference):
        return 0.0
    overlap = sum((have & want).values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / sum(have.values()), overlap / sum(want.values())
    return 2 * precision * recall / (precision + recall)


def reference_f1(completions: list[str], **columns: Any) -> list[float]:
    """``reference_f1``: ``bigram_f1`` against the row's ``reference`` (or ``reference_answer``, what
    ``rl_prompts`` writes) column."""
    references = column(columns, "reference", "reference_answer")
    return [bigram_f1(c, str(r)) for c, r in zip(completions, references, strict=True)]


def make_judge_score(judge: Any = None) -> RewardFn:
    """``judge_score``: a ``core.distill.judge.Judge``'s pointwise score, 1-5 mapped to 0-1 (no verdict: 0)."""
    if judge is None:
        raise ValueError(
            "judge_score needs a judge (core.distill.judge.Judge) built with a client; none was given (the training "
            "worker has no judge client: use it where a judge is served, or another reward)"
        )

    def judge_score(completions: list[str], **columns: Any) -> list[float]:
        prompts = [prompt_text(p) for p in column(columns, "prompts")]
        scores = [0.0] * len(completions)
        asked = [
            i
            for i, (c, p) in enumerate(zip(completions, prompts, strict=True))
            if words(c) and not echoes_prompt(c, p)
        ]
        verdicts = judge.judge_many([(prompts[i], completions[i]) for i in asked])
        for i, verdict in zip(asked, verdicts, strict=True):
            scores[i] = 0.0 if verdict.score is None else (float(verdict.score) - 1.0) / 4.0
        return scores

    return judge_score


def _plain(fn: RewardFn) -> RewardFactory:
    def factory(**deps: Any) -> RewardFn:
        return fn

    return factory


REWARDS: dict[str, RewardFactory] = {
    "exact_answer": _plain(exact_answer),
    "reference_f1": _plain(reference_f1),
    "judge_score": make_judge_score,
}
NEEDED_COLUMNS: dict[str, tuple[str, ...]] = {  # any one of them: what check_columns asks of a prompts file
    "exact_answer": ("answer",),
    "reference_f1": ("reference", "reference_answer"),
    "judge_score": ("prompts",),
}


def reward_function(name: str, **deps: Any) -> RewardFn:
    """The reward function registered as ``name``, built with ``deps`` (a judge, for ``judge_score``)."""
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; registered rewards are {sorted(REWARDS)}")
    return REWARDS[name](**deps)


def check_columns(names: Sequence[str], columns: set[str], where: str) -> None:
    """Fail before any training when a reward needs a column the prompts do not have (``where``: the file)."""
    for name in names:
        if name not in REWARDS:
            raise ValueError(f"{where}: unknown reward {name!r}; registered rewards are {sorted(REWARDS)}")
        needed = NEEDED_COLUMNS.get(name, ())
        if needed and not any(c in columns or c == "prompts" for c in needed):
            raise ValueError(
                f"{where}: reward {name!r} needs a column {' or '.join(map(repr, needed))}; the rows have "
                f"{sorted(columns)}"
            )


@dataclass
class CombinedReward:
    """The weighted sum of named rewards (TRL's ``reward_weights``), with each one's values kept for the logs."""

    functions: dict[str, RewardFn]
    weights: dict[str, float]

    def __call__(self, completions: list[str], **columns: Any) -> tuple[list[float], dict[str, list[float]]]:
        per_name = {
            name: [float(v) for v in fn(completions, **columns)] for name, fn in self.functions.items()
        }
        for name, values in per_name.items():
            if len(values) != len(completions):
                raise ValueError(
                    f"reward {name!r} returned {len(values)} values for {len(completions)} completions"
                )
        totals = [
            sum(self.weights[name] * per_name[name][i] for name in per_name) for i in range(len(completions))
        ]
        return totals, per_name


def combined_reward(specs: Sequence[Any], **deps: Any) -> CombinedReward:
    """A ``CombinedReward`` from ``(name, weight)`` pairs or objects with ``name`` and ``weight`` (``RewardSpec``)."""
    pairs = [(s.name, s.weight) if hasattr(s, "name") else (s[0], s[1]) for s in specs]
    if not pairs:
        raise ValueError("at least one reward is needed")
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"a reward is named twice in {names}")
    return CombinedReward({n: reward_function(n, **deps) for n in names}, dict(pairs))
