"""Preference pairs: the production model answers the day's training prompts K times, every answer is scored (and the
reference answer: the teacher's, already scored by SampleGate, or a checkable item's right answer), and the best
answer that passes SampleGate's heuristics against the worst one becomes a pair when their scores differ by at
least ``min_score_gap``.

What scores the answers is pluggable (``AnswerScorer``, the scale preset's ``preference.rank_by``): ``JudgeScorer``,
the judge's pointwise score (as the stage always did); ``RewardScorer``, a verifiable reward of ``core.rl.rewards``
on checkable prompts (``core.rl.tasks``), the same reward the RL stage maximises. The tiny judge's scores carry no
information about quality, so pairs it ranks teach DPO noise; a pair ranked by a checkable answer says which answer
is right. A verifier needs no heuristics (a one-word answer is a right answer), so ``RewardScorer`` turns them off.

On-policy: the answers come from the model in production, so the pairs say what to change in the model users get.
The answers go through the generation store like the teacher's (keyed by prompt, policy model identity, sampling
and generation index): a killed run resumes without paying twice, and a rerun on the same data reuses every answer.
The table keeps TRL's conversational columns (``prompt``, ``chosen``, ``rejected``), both scores, both models' ids,
the answers' lengths and the day; ``core/data/schemas.PreferencePairs`` checks it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import pandas as pd

from nexa_dagster.core.data.splits import is_held_out
from nexa_dagster.core.distill.generation_store import GenerationStore
from nexa_dagster.core.distill.judge import Judge
from nexa_dagster.core.distill.sample_gate import GateConfig, heuristic_reason
from nexa_dagster.core.distill.teacher import PromptSpec, for_generation, generate_teacher_samples, sample_key
from nexa_dagster.core.llm.base import LLMClient, SamplingParams

PAIR_COLUMNS = [
    "pair_id",
    "sample_id",
    "day",
    "prompt",
    "chosen",
    "rejected",
    "chosen_score",
    "rejected_score",
    "score_gap",
    "chosen_source",
    "rejected_source",
    "chosen_length",
    "rejected_length",
    "judge_model",
    "policy_model",
]
GAP_BUCKETS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0)


@dataclass
class PairStats:
    """What making one day's pairs did: prompts, answers generated and reused, pairs, and why prompts gave none."""

    prompts: int = 0
    held_out_prompts: int = 0  # on the eval set's side: never used
    generated: int = 0
    reused: int = 0
    failed: int = 0
    first_error: str | None = None  # of the failed requests (the endpoint's answer, for the pairs check)
    pairs: int = 0
    no_pair: dict[str, int] = field(default_factory=dict)  # reason -> prompts

    @property
    def no_pair_share(self) -> float:
        return 1 - self.pairs / self.prompts if self.prompts else 0.0


class AnswerScorer(Protocol):
    """Scores answers to the day's prompts: ``model_id`` names it in the pairs' ``judge_model`` column."""

    model_id: str
    heuristics: bool  # whether SampleGate's heuristics must pass for an answer to be chosen

    def score(self, rows: Sequence[Any], answers: Sequence[str]) -> list[float | None]:
        """One score per (prompt row, answer), None where there is no verdict."""
        ...

    def reference_score(self, row: Any) -> float:
        """The score of the row's reference answer (its ``response``)."""
        ...


@dataclass
class JudgeScorer:
    """The judge's pointwise score; the teacher's answer keeps the score SampleGate gave it."""

    judge: Judge
    heuristics: bool = True

    @property
    def model_id(self) -> str:
        return self.judge.client.model_id

    def score(self, rows: Sequence[Any], answers: Sequence[str]) -> list[float | None]:
        verdicts = self.judge.judge_many([(r.prompt, a) for r, a in zip(rows, answers, strict=True)])
        return [v.score for v in verdicts]

    def reference_score(self, row: Any) -> float:
        return float(row.judge_score)


@dataclass
class RewardScorer:
    """A verifiable reward (``fn(completions, **columns)``, TRL's shape) on the rows' own columns (``answer``,
    ``task``, ``choices``, ...): the right answer scores as the reward says, so does every policy answer."""

    reward: Callable[..., list[float]]
    name: str
    columns: Sequence[str] = ("answer", "task", "choices", "reference")
    heuristics: bool = False

    @property
    def model_id(self) -> str:
        return f"reward:{self.name}"

    def score(self, rows: Sequence[Any], answers: Sequence[str]) -> list[float | None]:
        if not rows:
            return []
        cols = {c: [getattr(r, c, None) for r in rows] for c in self.columns}
        cols = {c: v for c, v in cols.items() if any(x is not None for x in v)}
        cols["prompts"] = [r.prompt for r in rows]
        return [float(x) for x in self.reward(list(answers), **cols)]

    def reference_score(self, row: Any) -> float:
        return float(self.score([row], [row.response])[0] or 0.0)


def training_prompts(samples: pd.DataFrame, eval_fraction: float) -> tuple[pd.DataFrame, int]:
    """The judged samples whose prompt may be trained on (never the eval set's held-out side), and how many were
    held out."""
    held = samples["sample_id"].astype(str).map(lambda s: is_held_out(s, eval_fraction))
    return samples[~held].reset_index(drop=True), int(held.sum())


def policy_requests(
    samples: pd.DataFrame, policy_id: str, params: SamplingParams, k: int
) -> list[PromptSpec]:
    """K answers to ask of the policy per prompt, keyed as teacher answers are (so the store finds them again)."""
    specs = []  # a spec's doc_id holds the teacher sample the answer is for (the prompt's id)
    for row in samples.itertuples(index=False):
        for g in range(k):
            key = sample_key(row.prompt, row.system_prompt, policy_id, for_generation(params, g), g)
            specs.append(PromptSpec(key, str(row.sample_id), str(row.day), g, row.system_prompt, row.prompt))
    return specs


def make_pairs(
    samples: pd.DataFrame,
    policy: LLMClient,
    scorer: AnswerScorer,
    gate: GateConfig,
    store: GenerationStore,
    params: SamplingParams,
    k: int,
    min_score_gap: float,
    eval_fraction: float,
    batch_size: int = 16,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[pd.DataFrame, PairStats]:
    """The day's pairs from ``samples`` (rows with ``sample_id``, ``day``, ``prompt``, ``system_prompt``, the
    reference answer ``response`` with its ``completion_tokens``, and whatever ``scorer`` reads) with K answers
    of ``policy`` each, scored by ``scorer``."""
    usable, held_out = training_prompts(samples, eval_fraction)
    stats = PairStats(prompts=len(usable), held_out_prompts=held_out)
    specs = policy_requests(usable, policy.model_id, params, k)
    answers, generation = generate_teacher_samples(policy, specs, params, store, batch_size, progress)
    stats.generated, stats.reused, stats.failed = generation.generated, generation.reused, generation.failed
    errors = answers["error"].dropna()
    stats.first_error = str(errors.iloc[0])[:200] if len(errors) else None
    ok = answers[answers["error"].isna()]
    by_id = {str(r.sample_id): r for r in usable.itertuples(index=False)}
    rows_of = [by_id[str(d)] for d in ok["doc_id"]]  # an answer's doc_id is its prompt's sample id
    scores = dict(zip(ok["sample_id"], scorer.score(rows_of, list(ok["response"])), strict=True))
    by_prompt: dict[str, list[tuple[str, str, float, int]]] = {}  # sample id -> (source, text, score, tokens)
    for row in ok.itertuples(index=False):
        if scores[row.sample_id] is not None:
            by_prompt.setdefault(row.doc_id, []).append(
                (
                    f"policy:{row.generation_index}",
                    row.response,
                    float(scores[row.sample_id]),
                    row.completion_tokens,
                )
            )
    rows = []
    for sample in usable.itertuples(index=False):
        reference = (
            "teacher",
            sample.response,
            scorer.reference_score(sample),
            int(sample.completion_tokens),
        )
        candidates = [reference, *by_prompt.get(str(sample.sample_id), [])]
        pair, why = choose_pair(sample.prompt, candidates, gate if scorer.heuristics else None, min_score_gap)
        if pair is None:
            stats.no_pair[why] = stats.no_pair.get(why, 0) + 1
            continue
        rows.append(pair_row(sample, pair, scorer.model_id, policy.model_id))
    stats.pairs = len(rows)
    frame = (
        pd.DataFrame(rows, columns=PAIR_COLUMNS).sort_values("pair_id", kind="stable").reset_index(drop=True)
    )
    return frame, stats


def pair_row(sample: Any, pair: tuple, scorer_id: str, policy_id: str) -> dict[str, Any]:
    """One row of the pairs table: TRL's conversational prompt/chosen/rejected, both scores, sources, lengths."""
    (c_src, c_text, c_score, _), (r_src, r_text, r_score, _) = pair
    prompt = ([{"role": "system", "content": sample.system_prompt}] if sample.system_prompt else []) + [
        {"role": "user", "content": sample.prompt}
    ]
    return {
        "pair_id": pair_id(str(sample.sample_id), c_text, r_text),
        "sample_id": str(sample.sample_id),
        "day": str(sample.day),
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": c_text}],
        "rejected": [{"role": "assistant", "content": r_text}],
        "chosen_score": c_score,
        "rejected_score": r_score,
        "score_gap": c_score - r_score,
        "chosen_source": c_src,
        "rejected_source": r_src,
        "chosen_length": len(c_text),
        "rejected_length": len(r_text),
        "judge_model": scorer_id,
        "policy_model": policy_id,
    }


def choose_pair(
    prompt: str,
    candidates: Sequence[tuple[str, str, float, int]],
    gate: GateConfig | None,
    min_score_gap: float,
) -> tuple[tuple[tuple[str, str, float, int], tuple[str, str, float, int]] | None, str]:
    """(chosen, rejected) among ``(source, text, score, tokens)`` candidates: the best-scored one that passes the
    heuristics (``gate``; None: a verifier scored them, no heuristics) against the worst-scored other one; or None
    with why (ties are broken by source, for determinism)."""
    ranked = sorted(candidates, key=lambda c: (-c[2], c[0]))
    passing = [c for c in ranked if gate is None or heuristic_reason(prompt, c[1], None, gate, c[3]) is None]
    if not passing:
        return None, "no answer passes the heuristics"
    chosen = passing[0]
    others = [c for c in ranked if c is not chosen and c[1].strip() != chosen[1].strip()]
    if not others:
        return None, "every answer is the same text"
    rejected = others[-1]
    if chosen[2] - rejected[2] < min_score_gap:
        return None, f"score gap below {min_score_gap}"
    return (chosen, rejected), ""


def pair_id(sample_id: str, chosen: str, rejected: str) -> str:
    return hashlib.sha256(f"{sample_id}\0{chosen}\0{rejected}".encode()).hexdigest()[:24]


def gap_histogram(pairs: pd.DataFrame) -> dict[str, int]:
    """Pairs per score-gap bucket (``[0.5, 1.0)`` ...), for the asset's metadata."""
    edges = (*GAP_BUCKETS, float("inf"))
    counts = {f"[{lo}, {hi})": 0 for lo, hi in zip((0.0, *GAP_BUCKETS), edges, strict=True)}
    for gap in pairs["score_gap"] if len(pairs) else []:
        for lo, hi in zip((0.0, *GAP_BUCKETS), edges, strict=True):
            if lo <= gap < hi:
                counts[f"[{lo}, {hi})"] += 1
                break
    return counts


def pair_problems(pairs: pd.DataFrame, min_score_gap: float, eval_fraction: float) -> list[str]:
    """What makes a day's pairs untrustworthy (the ``preference_pairs`` asset check): a repeated ``pair_id``, a
    ``pair_id`` that is not the hash of its sample and answers, chosen and rejected with the same text, a score gap
    below ``min_score_gap`` or not the difference of the two scores, a prompt on the eval set's held-out side.
    Empty: none."""
    problems: list[str] = []
    repeated = pairs["pair_id"][pairs["pair_id"].duplicated()].tolist()
    if repeated:
        problems.append(f"pair_id repeated: {repeated[:3]}")
    for row in pairs.itertuples(index=False):
        chosen = "".join(m["content"] for m in row.chosen)
        rejected = "".join(m["content"] for m in row.rejected)
        where = f"pair {row.pair_id} (sample {row.sample_id})"
        if row.pair_id != pair_id(str(row.sample_id), chosen, rejected):
            problems.append(f"{where}: pair_id is not the hash of its sample and answers")
        if chosen.strip() == rejected.strip():
            problems.append(f"{where}: chosen and rejected are the same text")
        if (
            row.score_gap < min_score_gap
            or abs(row.score_gap - (row.chosen_score - row.rejected_score)) > 1e-6
        ):
            problems.append(
                f"{where}: score gap {row.score_gap} (chosen {row.chosen_score}, rejected {row.rejected_score}; "
                f"at least {min_score_gap})"
            )
        if is_held_out(str(row.sample_id), eval_fraction):
            problems.append(f"{where}: its prompt is on the eval set's held-out side")
    return problems
