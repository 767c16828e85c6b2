"""The evaluation asset's reward gate (an RL checkpoint, a reward-ranked DPO one) runs the guards every gate runs
(contamination, the benchmarks, the length control, the eval-set loss), and the asset counts its decisions per
eval-set version and production model under the data root (issue 47, points 2 and 5)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from nexa_dagster.assets.evaluation import GateEvidence, gate_attempt, gate_decision
from nexa_dagster.core.common.artifacts import Checkpoint
from nexa_dagster.core.common.config import load_scale
from nexa_dagster.core.evaluation.paired import paired_loss_difference
from nexa_dagster.core.evaluation.promotion import ProductionEntry, PromotionPolicy
from nexa_dagster.core.evaluation.scoring import CheckpointEvaluation, EvalResult, ModelScores
from nexa_dagster.resources.storage import StorageResource

PRODUCTION = ProductionEntry(checkpoint_id="prod", checkpoint_path="checkpoints/prod", metric="eval_loss")
EXACT = [("exact_answer", 1.0)]
N = 100  # held-out prompts: above the 86 the guards need to see a 5 % share of regressed prompts


def _rows() -> list[dict]:
    return [
        {"prompt": f"Which topic? passage {i}. Choices: assert, for", "answer": "assert", "task": "topic"}
        for i in range(N)
    ]


def _benchmarks(acc: float, stderr: float) -> dict:
    return {
        "tasks": {"stdlib": {"acc": {"value": acc, "stderr": stderr, "higher_is_better": True}}},
        "samples": {"stdlib": 4000},
    }


def _evaluation(candidate_acc: float = 0.5) -> tuple[CheckpointEvaluation, dict]:
    """Both models' scores as the evaluation worker returns them: the candidate right on every other held-out
    prompt, production on none; the eval-set loss unchanged; a benchmark at ``candidate_acc`` against 0.5."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(20, 60, size=N).tolist()
    nll = (rng.uniform(3.0, 4.0, size=N) * np.asarray(tokens)).tolist()
    answers = ["assert" if i % 2 else "for" for i in range(N)]
    candidate = ModelScores(nll, tokens, answers, _benchmarks(candidate_acc, 0.005))
    production = ModelScores(nll, tokens, ["for"] * N, _benchmarks(0.5, 0.005))
    evaluation = CheckpointEvaluation(
        EvalResult("rl-1", candidate.loss),
        1,
        candidate,
        production,
        paired_loss=paired_loss_difference(nll, nll, tokens),
    )
    return evaluation, {"candidate": candidate.to_json(), "production": production.to_json()}


@pytest.fixture
def ckpt(tiny_model_dir: Path) -> Checkpoint:
    """An RL checkpoint record on the suite's tiny model (the record checks it is a model directory)."""
    return Checkpoint(checkpoint_id="rl-1", path=str(tiny_model_dir), num_steps=2, stage="rl")


def _decide(
    ckpt: Checkpoint, evaluation: CheckpointEvaluation, scores: dict, contamination: float | None = 0.0
):
    return gate_decision(
        GateEvidence(ckpt, PRODUCTION, PromotionPolicy(), evaluation, scores, contamination, EXACT, _rows())
    )


def test_the_reward_gate_promotes_a_candidate_that_learned_the_task_with_every_guard_named(
    ckpt: Checkpoint,
) -> None:
    decision, figures = _decide(ckpt, *_evaluation())
    assert decision.passed, decision.reason
    assert "benchmarks regression <= 0.05" in decision.rule and "length-controlled" in decision.rule
    assert figures is not None and figures["length_controlled_win_rate"] > 0.5


def test_the_reward_gate_holds_back_a_contaminated_candidate(ckpt: Checkpoint) -> None:
    decision, _ = _decide(ckpt, *_evaluation(), contamination=0.1)
    assert decision.outcome == "hold back" and decision.reason.startswith("contaminated: 10.0%")


def test_the_reward_gate_holds_back_a_candidate_that_broke_a_benchmark(ckpt: Checkpoint) -> None:
    decision, _ = _decide(ckpt, *_evaluation(candidate_acc=0.3))
    assert decision.outcome == "hold back" and "stdlib/acc lower by 0.2000" in decision.reason


def test_gate_decisions_are_counted_per_evidence_and_production_under_the_data_root(tmp_path: Path) -> None:
    storage, scale, policy = StorageResource(data_root=str(tmp_path)), load_scale("tiny"), PromotionPolicy()
    assert gate_attempt(storage, scale, 1, "ckpt-1", None, [], policy) is None  # nothing compared
    same = PRODUCTION.model_copy(update={"checkpoint_id": "ckpt-1"})
    assert (
        gate_attempt(storage, scale, 1, "ckpt-1", same, [], policy) is None
    )  # a re-evaluation of production
    numbers = [gate_attempt(storage, scale, 1, c, PRODUCTION, [], policy).number for c in ("a", "b", "c")]
    assert numbers == [1, 2, 3]
    third = gate_attempt(storage, scale, 1, "c", PRODUCTION, [], policy)
    assert third.number == 3 and third.confidence == pytest.approx(0.9875)
    # a reward gate decides on the frozen RL eval set: a family of its own
    rl = gate_attempt(storage, scale, 1, "rl-1", PRODUCTION, EXACT, policy)
    assert rl.number == 1 and rl.family.startswith("rl_eval_set v")
    stored = json.loads((tmp_path / "serving" / "gate_attempts.json").read_text())
    assert set(stored["families"]) == {"eval_set v1 vs prod", rl.family}
