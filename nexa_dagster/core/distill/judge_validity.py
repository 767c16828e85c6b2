"""Does the judge see the difference between an answer and the same words in random order?

A judge's pass rate and score spread say how it scores, not whether its scores mean anything: a judge that
answers the same number whatever it reads (a broken model, a prompt it does not follow) passes or rejects by
accident. The cheapest test of meaning is a pair the judge must rank: a teacher answer it scored, and the same
answer's words shuffled (same length, same vocabulary, no syntax left). A judge that reads the answer scores the
original higher on most pairs; one that does not wins about half of them at best (ties count as not winning).

The day's check (``sample_gate``'s ``judge_prefers_real_answers``) judges up to ``pairs`` shuffled answers and
decides with a one-sided exact sign test: valid when P(wins >= observed | a coin-flip judge) <= ``alpha``. With
fewer than ``min_pairs`` rankable answers (a day whose samples were nearly all rejected before the judge) it
does not decide: 6 is the fewest pairs where even 6 wins out of 6 can reach p <= 0.05 (1/64 = 0.016). The
default of 24 pairs (``judge.validity_pairs``) gives a judge that ranks correctly 3 times in 4 a 0.77 chance to
pass (17 wins needed); 12 pairs would give it 0.39.

Passing is necessary, not sufficient: the test counts wins, not by how much. Measured on documentation
answers, the tiny model with *random* weights ranked 17 of 24 real answers above their shuffles (p = 0.032;
some bias of its own towards fluent token sequences); the pretrained tiny judge won 16 of 24 (p = 0.076,
fails) and 30 of 46 (p = 0.027, passes) by a median of 0.003 of a point
(``tests/integration/test_judge_validity.py``), and SmolLM2-135M-Instruct won 3 of 8 on its own answers (0 of
8 on another run; ``tests/e2e/test_real_teacher_day.py``). A failing check says the scores do not read the
answers; a passing one only that they may: read the examples' score gaps beside it.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from math import comb

import pandas as pd

from nexa_dagster.core.distill.judge import Judge

MIN_WORDS = 4  # fewer distinct orders than that cannot be told apart from the answer by its words' order


@dataclass(frozen=True)
class JudgeValidity:
    """The pairs judged and the sign test's answer."""

    pairs: int
    wins: int  # the real answer scored strictly higher than its shuffled words
    ties: int
    losses: int
    p_value: float  # one-sided exact sign test against a judge that cannot tell them apart
    alpha: float
    min_pairs: int
    shuffled_errors: int = 0  # shuffled answers the judge gave no verdict on (left out of the pairs)
    examples: list[dict[str, object]] = field(default_factory=list)

    @property
    def decided(self) -> bool:
        return self.pairs >= self.min_pairs

    @property
    def valid(self) -> bool:
        """True unless there were enough pairs and the judge did not rank real answers reliably higher."""
        return not self.decided or self.p_value <= self.alpha

    @property
    def win_rate(self) -> float:
        return self.wins / self.pairs if self.pairs else 0.0


def shuffled_words(text: str, seed: str) -> str | None:
    """``text``'s words (whitespace-separated) in a random order that differs from theirs, or None when too short."""
    words = re.split(r"\s+", text.strip())
    if len(words) < MIN_WORDS or len(set(words)) < 2:
        return None
    rng = random.Random(seed)
    shuffled = words[:]
    while shuffled == words:
        rng.shuffle(shuffled)
    return " ".join(shuffled)


def sign_test_p(wins: int, pairs: int) -> float:
    """P(X >= wins) for X ~ Binomial(pairs, 1/2): how often a coin-flip judge would win this often."""
    return sum(comb(pairs, k) for k in range(wins, pairs + 1)) / 2**pairs if pairs else 1.0


def judge_validity(
    judge: Judge, judged: pd.DataFrame, pairs: int = 24, min_pairs: int = 6, alpha: float = 0.05
) -> JudgeValidity:
    """Rank up to ``pairs`` judged answers (``judge_score`` set; by ``sample_id``, so a re-run asks the same) against
    their shuffled words, with the same judge, prompt and method."""
    scored = judged[judged["judge_score"].notna()].sort_values("sample_id")
    chosen: list[tuple[str, str, float, str]] = []
    for row in scored.itertuples(index=False):
        shuffled = shuffled_words(str(row.response), str(row.sample_id))
        if shuffled is not None:
            chosen.append((str(row.sample_id), str(row.prompt), float(row.judge_score), shuffled))
        if len(chosen) == pairs:
            break
    verdicts = judge.judge_many([(prompt, shuffled) for _, prompt, _, shuffled in chosen])
    wins = ties = losses = errors = 0
    examples = []
    for (sample_id, _, real, _), verdict in zip(chosen, verdicts, strict=True):
        if verdict.score is None:
            errors += 1
            continue
        if real > verdict.score:
            wins += 1
        elif real == verdict.score:
            ties += 1
        else:
            losses += 1
        if len(examples) < 5:
            examples.append(
                {"sample_id": sample_id, "real": round(real, 3), "shuffled": round(verdict.score, 3)}
            )
    n = wins + ties + losses
    return JudgeValidity(n, wins, ties, losses, sign_test_p(wins, n), alpha, min_pairs, errors, examples)
