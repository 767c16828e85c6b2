"""Evaluation on the frozen eval set and the promotion gate's paired comparison, from a notebook, no Dagster.

The models' quality is known by construction: the tiny random-init model, and a copy of it trained a few dozen
steps on training-side samples (a plain PyTorch loop), which must score better on the held-out examples.
"""

from __future__ import annotations

import math
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from support.openai_stub import chat_payload, stub_server
from support.tiny_training import train_steps
from support.worker_launch import run_worker_command

from nexa_dagster.core.data.splits import is_held_out
from nexa_dagster.core.evaluation.eval_set import eval_prompts, freeze_eval_set, load_eval_set
from nexa_dagster.core.evaluation.paired import Interval, WinRate
from nexa_dagster.core.evaluation.promotion import ProductionEntry, PromotionPolicy, decide
from nexa_dagster.core.evaluation.scoring import (
    JudgeRubric,
    ModelScores,
    compare,
    evaluate_checkpoint,
    pairwise_win_rate,
    perplexity_of,
)
from nexa_dagster.core.evaluation.worker import EvaluationJob
from nexa_dagster.core.llm.local import LocalTransformersClient
from nexa_dagster.core.llm.openai_compat import OpenAICompatibleClient
from nexa_dagster.core.packaging.packing import ChatTokenizer, conversation

FRACTION = 0.25


def _samples(n: int = 48) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "sample_id": [f"id{i:03d}" for i in range(n)],
            "day": ["2026-11-20"] * n,
            "system_prompt": ["Be brief."] * n,
            "prompt": [f"What is {i} + 1?" for i in range(n)],
            "response": [f"It is {i + 1}." for i in range(n)],
        }
    )


@pytest.fixture(scope="module")
def eval_setup(tiny_model_dir: Path, tiny_tokenizer, tmp_path_factory: pytest.TempPathFactory):
    """(eval-set manifest, random-init model dir, trained copy dir)."""
    import torch
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("evalgate")
    samples = _samples()
    eval_set = freeze_eval_set(
        samples, tiny_tokenizer, str(root / "eval_sets"), 1, FRACTION, 128, log=lambda m: None
    )
    manifest = load_eval_set(str(root / "eval_sets"), 1)
    assert eval_set["examples"] >= 8
    trained = root / "trained"
    shutil.copytree(tiny_model_dir, trained)
    model = AutoModelForCausalLM.from_pretrained(str(trained), dtype=torch.float32)
    train = [r for r in samples.itertuples() if not is_held_out(r.sample_id, FRACTION)]
    chat = ChatTokenizer.from_hf(tiny_tokenizer, str(root / "tokenizer.json"))
    encoded = [
        (ids.tolist(), mask.tolist())
        for ids, mask in chat.encode_conversations(
            [conversation(r.system_prompt, r.prompt, r.response) for r in train]
        )
    ]
    train_steps(model, encoded, 40)
    model.save_pretrained(str(trained))
    return manifest, tiny_model_dir, trained


# the two tests of the module-scoped eval_setup (a tiny model trained 40 steps) on one worker: it is built once, not
# once per xdist worker
@pytest.mark.xdist_group("eval_setup")
def test_a_checkpoint_is_evaluated_against_itself(eval_setup) -> None:
    """Identical models: equal losses on every example, a difference of exactly 0 with the interval [0, 0], and
    the gate holds the copy back (a tie is no improvement)."""
    manifest, random_init, _ = eval_setup
    lines: list[str] = []
    prompts = eval_prompts(manifest, 2)
    with LocalTransformersClient(str(random_init)) as judge:
        evaluation = evaluate_checkpoint(
            "ckpt-test",
            str(random_init),
            manifest,
            prompts,
            judge,
            JudgeRubric.from_files(),
            max_new_tokens=8,
            production_path=str(random_init),
            log=lines.append,
            resamples=200,
        )
    loss = evaluation.result.loss
    assert math.isfinite(loss.loss) and loss.perplexity > 1 and loss.tokens == manifest["tokens"]
    assert loss.sequences == manifest["examples"] and evaluation.eval_set_version == 1
    assert [a.prompt for a in evaluation.result.answers] == prompts
    d = evaluation.paired_loss.difference
    assert (d.estimate, d.low, d.high) == (0.0, 0.0, 0.0)
    # the same answers in both orders: a judge that always picks a position has no order-consistent verdict,
    # one that always picks the same content is consistent; either way the rate is not above 0.5
    assert evaluation.win_rate.rate.estimate <= 0.5 or evaluation.win_rate.wins == 0
    production = ProductionEntry(checkpoint_id="prod", checkpoint_path=str(random_init), metric="eval_loss")
    tie = decide("ckpt-test", production, PromotionPolicy(), evaluation.paired_loss, evaluation.win_rate)
    assert not tie.passed and "is not below -0.0" in tie.reason
    assert any(line.startswith("ckpt-test: eval-set examples scored: ") for line in lines), lines
    assert any(line.startswith("ckpt-test: held-out answers judged: 2/2 ") for line in lines), lines


@pytest.mark.xdist_group("eval_setup")
def test_the_gate_promotes_a_better_checkpoint_and_blocks_a_worse_one_on_the_same_eval_set(
    eval_setup, tmp_path: Path
) -> None:
    """Both models scored by the evaluation worker process, in one job, on the same eval-set version."""
    manifest, random_init, trained = eval_setup
    prompts = eval_prompts(manifest, 2)

    def worker(candidate: Path, production: Path, name: str) -> dict:
        job = EvaluationJob(
            run_id=name,
            models={"candidate": str(candidate), "production": str(production)},
            examples_path=manifest["path"],
            eval_set_version=1,
            prompts=prompts,
            max_new_tokens=4,
            output_path=str(tmp_path / f"{name}.json"),
        )
        (tmp_path / f"{name}.job.json").write_text(job.model_dump_json())
        proc = run_worker_command(
            [
                sys.executable,
                "-m",
                "nexa_dagster.core.evaluation.worker",
                "--job",
                str(tmp_path / f"{name}.job.json"),
            ],
            timeout=600,
        )
        assert proc.returncode == 0, proc.stdout[-3000:]
        import json

        return json.loads((tmp_path / f"{name}.json").read_text())["scores"]

    # eval_loss, margin 0, the interval must clear it; this eval set holds 10 examples, so the evidence minimum is
    # set to what it holds (the gate's refusal below the minimum is test_the_gate_needs_the_interval_...'s subject)
    policy = PromotionPolicy(min_examples=10)
    with LocalTransformersClient(str(random_init)) as judge:
        template = JudgeRubric.from_files()
        better = worker(trained, random_init, "better")
        ev = compare(
            "better",
            1,
            ModelScores.from_json(better["candidate"]),
            ModelScores.from_json(better["production"]),
            prompts,
            judge,
            template,
            resamples=500,
        )
        promoted = decide(
            "better",
            ProductionEntry(checkpoint_id="random", checkpoint_path=str(random_init), metric="eval_loss"),
            policy,
            ev.paired_loss,
            ev.win_rate,
        )
        # the worse direction, the same two models, the same examples: scored values swap exactly
        worse = {"candidate": better["production"], "production": better["candidate"]}
        ev_worse = compare(
            "worse",
            1,
            ModelScores.from_json(worse["candidate"]),
            ModelScores.from_json(worse["production"]),
            prompts,
            judge,
            template,
            resamples=500,
        )
    assert promoted.passed, promoted.reason
    assert promoted.interval[1] < 0 and promoted.candidate < promoted.production
    assert promoted.difference == pytest.approx(promoted.candidate - promoted.production)
    blocked = decide(
        "worse",
        ProductionEntry(checkpoint_id="trained", checkpoint_path=str(trained), metric="eval_loss"),
        policy,
        ev_worse.paired_loss,
        ev_worse.win_rate,
    )
    assert not blocked.passed and blocked.interval[0] > 0 and "is not below" in blocked.reason


def _win(wins: int, losses: int, low: float, high: float) -> WinRate:
    return WinRate(wins, losses, 0, Interval(wins / (wins + losses), low, high, 0.95))


def test_the_gate_needs_the_interval_not_just_the_point_estimate() -> None:
    from nexa_dagster.core.evaluation.paired import PairedLoss

    production = ProductionEntry(checkpoint_id="prod", checkpoint_path="/nowhere", metric="eval_loss")
    # 40 examples: enough evidence (min_examples 30), so what decides is the interval or the point estimate
    noisy = PairedLoss(2.90, 3.00, Interval(-0.10, -0.30, 0.05, 0.95), 40, 1000)  # better, within the noise
    assert not decide("c", production, PromotionPolicy(), noisy).passed
    assert decide("c", production, PromotionPolicy(require_interval=False), noisy).passed
    clear = PairedLoss(2.90, 3.00, Interval(-0.10, -0.15, -0.05, 0.95), 40, 1000)
    assert decide("c", production, PromotionPolicy(), clear).passed
    assert not decide("c", production, PromotionPolicy(margin=0.08), clear).passed  # the margin counts too
    # win rate: 14 of 20 consistent verdicts is a point estimate above 0.5 with a Wilson interval that is not
    win = PromotionPolicy(metric="win_rate")
    assert not decide("c", production, win, win_rate=_win(14, 6, 0.481, 0.855)).passed
    assert decide(
        "c",
        production,
        PromotionPolicy(metric="win_rate", require_interval=False),
        win_rate=_win(14, 6, 0.481, 0.855),
    ).passed
    assert decide("c", production, win, win_rate=_win(18, 2, 0.699, 0.972)).passed
    # nothing to compare with (production not readable here) is held back; no production at all is promoted
    unreadable = decide("c", production, PromotionPolicy())
    assert not unreadable.passed and "nothing to compare with" in unreadable.reason
    assert not decide("c", production, win).passed
    assert decide("c", None, PromotionPolicy()).passed
    assert decide("prod", production, PromotionPolicy()).passed  # re-evaluating production itself


QUESTIONS = [f"What is {i} + 1?" for i in range(4)]
# the candidate is right on the first three questions, production only on the last
CANDIDATE = ["It is 1.", "It is 2.", "It is 3.", "It is 7."]
PRODUCTION = ["It is 5.", "It is 6.", "It is 9.", "It is 4."]


def _arithmetic_judge(logprobs: bool, p_right: float = 0.9):
    """A judge whose preference is fixed by construction: it works the sum out and prefers the right answer,
    by its letter (text) or with probability ``p_right`` (logprobs), in whichever position it is."""

    def reply(n: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if body.get("response_format"):
            return 400, {"error": {"message": "response_format is not supported"}}
        if body.get("logprobs") and not logprobs:
            return 400, {"error": {"message": "logprobs is not supported"}}
        prompt = body["messages"][-1]["content"]
        found = re.search(
            r"What is (\d+) \+ 1\?.*ANSWER A:\s*(.*?)\s*ANSWER B:\s*(.*?)\s*Better", prompt, re.S
        )
        right = "A" if found and f"It is {int(found.group(1)) + 1}." == found.group(2) else "B"
        if not logprobs:
            return 200, chat_payload(right)
        wrong = "B" if right == "A" else "A"
        top = [
            {"token": right, "logprob": math.log(p_right), "bytes": None},
            {"token": wrong, "logprob": math.log(1 - p_right), "bytes": None},
        ]
        return 200, chat_payload(
            right,
            {
                "content": [
                    {
                        "token": right,
                        "logprob": math.log(p_right),
                        "bytes": None,
                        "top_logprobs": top[: body.get("top_logprobs", 0)],
                    }
                ]
            },
        )

    return reply


@pytest.mark.parametrize("logprobs", [False, True], ids=["text", "logprobs"])
def test_the_win_rate_is_the_judges_known_preference(logprobs: bool) -> None:
    """Right on 3 of 4 questions where production is right on 1: a judge that prefers the right answer, in
    whichever position it is, is order-consistent on every question and gives the candidate 3 of 4 verdicts (by its
    letter, or by the more probable letter), and production the rest."""
    expected = 0.75
    with (
        stub_server(_arithmetic_judge(logprobs)) as (url, calls, _),
        OpenAICompatibleClient(url, model="stub", backoff_s=0.01) as judge,
    ):
        assert judge.capabilities().logprobs is logprobs
        assert pairwise_win_rate(judge, QUESTIONS, CANDIDATE, PRODUCTION) == pytest.approx(expected)
        assert pairwise_win_rate(judge, QUESTIONS, PRODUCTION, CANDIDATE) == pytest.approx(1 - expected)
        asked = [c for c in calls if "Better answer" in c["messages"][-1]["content"]]
        assert len(asked) == 2 * 2 * len(QUESTIONS)  # every pair in both orders, for both calls


def _scoring_judge(position_biased_pairwise: bool = False):
    """A judge that scores one answer alone (the 1-5 score prompt): 5 for the right sum, 1 for a wrong one, by the
    probabilities of the score tokens; shown two answers, it always prefers the first (pure position bias) when
    ``position_biased_pairwise``."""

    def reply(n: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if body.get("response_format"):
            return 400, {"error": {"message": "response_format is not supported"}}
        prompt = body["messages"][-1]["content"]
        if "Better answer" in prompt:
            pick = "A" if position_biased_pairwise else "B"
            entry = {"token": pick, "logprob": math.log(0.9), "bytes": None}
            return 200, chat_payload(pick, {"content": [{**entry, "top_logprobs": [entry]}]})
        found = re.search(r"What is (\d+) \+ 1\?.*ANSWER:\s*(.*?)\s*Score:", prompt, re.S)
        score = "5" if found and found.group(2) == f"It is {int(found.group(1)) + 1}." else "1"
        other = "1" if score == "5" else "5"
        top = [
            {"token": score, "logprob": math.log(0.8), "bytes": None},
            {"token": other, "logprob": math.log(0.2), "bytes": None},
        ]
        return 200, chat_payload(score, {"content": [{**top[0], "top_logprobs": top}]})

    return reply


def _judged(judge_mode: str, position_biased_pairwise: bool = False) -> tuple[Any, list[dict[str, Any]]]:
    """``compare`` of CANDIDATE with PRODUCTION (equal losses) by ``_scoring_judge``; the evaluation and the judge's
    requests."""

    def scores(answers: list[str]) -> ModelScores:
        return ModelScores([3.0] * len(answers), [3] * len(answers), answers)

    with (
        stub_server(_scoring_judge(position_biased_pairwise)) as (url, calls, _),
        OpenAICompatibleClient(url, model="stub", backoff_s=0.01) as judge,
    ):
        evaluation = compare(
            "cand",
            1,
            scores(CANDIDATE),
            scores(PRODUCTION),
            QUESTIONS,
            judge,
            JudgeRubric.from_files(),
            judge_mode=judge_mode,
        )
    return evaluation, calls


def test_a_pointwise_judge_scores_each_answer_alone_and_the_higher_score_wins() -> None:
    """Each answer scored on its own with the judge's score prompt (the expected score from the log-probabilities
    of "1".."5": about 4 for a right sum, 2 for a wrong one): 3 wins of 4, and no pairwise prompt asked."""
    evaluation, calls = _judged("pointwise")
    w = evaluation.win_rate
    assert (w.mode, w.wins, w.losses, w.ties, w.unreadable) == ("pointwise", 3, 1, 0, 0)
    scores = [a.score for a in evaluation.result.answers]
    assert (
        min(scores[:3]) > 3.9
        and scores[3] < 2.1
        and {a.method for a in evaluation.result.answers} == {"logprobs"}
    )
    assert not [c for c in calls if "Better answer" in c["messages"][-1]["content"]]
    assert len(calls) >= 2 * len(QUESTIONS)  # both models' answers scored (after the capability probe)


def test_a_position_biased_pairwise_judge_is_called_unreliable_by_the_gate() -> None:
    """The same judge asked pairwise always names the first answer: every verdict flips with the order, the
    order-consistency rate is 0 and the gate holds the candidate back calling the judge unreliable."""
    w = _judged("pairwise", position_biased_pairwise=True)[0].win_rate
    assert (w.inconsistent, w.unreadable, w.order_consistency, w.headline) == (4, 0, 0.0, 0.5)
    production = ProductionEntry(checkpoint_id="prod", checkpoint_path="/nowhere", metric="eval_loss")
    decision = decide("cand", production, PromotionPolicy(metric="win_rate"), win_rate=w)
    assert decision.outcome == "hold back" and decision.reason.startswith("judge unreliable: 4 of 4")


def test_serving_follows_the_recorded_decision_only_against_the_production_it_was_made_against() -> None:
    from nexa_dagster.core.common.artifacts import EvalReport
    from nexa_dagster.core.evaluation.promotion import held_back_because

    def report(decision: str | None, against: str | None) -> EvalReport:
        return EvalReport(
            checkpoint_id="c",
            checkpoint_path="/c",
            perplexity=2.0,
            num_heldout_prompts=0,
            gate_decision=decision,
            gate_reason="why",
            production_checkpoint_id=against,
            report_json="-",
            report_markdown="-",
        )

    prod = ProductionEntry(checkpoint_id="p", checkpoint_path="/p", metric="eval_loss")
    assert held_back_because("c", report("promote", "p"), prod) is None
    assert held_back_because("c", report("promote", None), None) is None  # the first model
    assert held_back_because("c", report("hold back", "p"), prod) == "the promotion gate held it back (why)"
    assert "production is now p, not q" in held_back_because("c", report("promote", "q"), prod)
    assert "production is now p, not none" in held_back_because("c", report("promote", None), prod)
    assert "predates the paired promotion gate" in held_back_because("c", report(None, "p"), prod)


def test_perplexity_is_not_capped_silently() -> None:
    """It used to be e^min(loss, 50): every model past a loss of 50 reported the same 5.2e21."""
    worse = ModelScores(nll=[120.0, 60.0], tokens=[1, 1], answers=["", ""]).loss
    bad = ModelScores(nll=[60.0, 60.0], tokens=[1, 1], answers=["", ""]).loss
    assert bad.perplexity == pytest.approx(math.exp(60)) and worse.perplexity == pytest.approx(math.exp(90))
    assert perplexity_of(2.0) == pytest.approx(math.exp(2.0)) and perplexity_of(1000.0) == math.inf
