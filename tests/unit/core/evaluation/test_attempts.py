"""Retries pay (issue 47, point 5): the gate decisions taken on one eval-set version against one production model
are counted under the data root, and each later one decides at a stricter level, so a candidate retrained until one
passes cannot win by trying."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from nexa_dagster.core.evaluation.attempts import Attempt, GateAttempts, attempt_confidence, family
from nexa_dagster.core.evaluation.paired import paired_loss_difference
from nexa_dagster.core.evaluation.promotion import ProductionEntry, PromotionPolicy, decide, eval_loss_guard

PRODUCTION = ProductionEntry(checkpoint_id="prod", checkpoint_path="checkpoints/prod", metric="eval_loss")


def test_each_later_attempt_halves_the_one_sided_error_and_the_total_stays_below_twice_the_level() -> None:
    levels = [attempt_confidence(0.95, k) for k in range(1, 40)]
    assert levels[:3] == pytest.approx([0.95, 0.975, 0.9875])
    errors = [(1 - c) / 2 for c in levels]
    assert sum(errors) < 2 * 0.025  # whatever the number of attempts (a union bound over them)
    with pytest.raises(ValueError, match="numbered from 1"):
        attempt_confidence(0.95, 0)


def test_attempts_are_counted_per_eval_set_version_and_production_and_kept_under_the_data_root(
    tmp_path: Path,
) -> None:
    v1 = family("eval_set", 1, "prod")
    ledger = GateAttempts.under(str(tmp_path))
    numbers = [ledger.reserve(v1, c, 0.95).number for c in ("ckpt-1", "ckpt-2", "ckpt-3")]
    assert numbers == [1, 2, 3]
    # a re-evaluation of a counted checkpoint is the same attempt (same figures, nothing new tried)
    again = GateAttempts.under(str(tmp_path)).reserve(v1, "ckpt-2", 0.95)
    assert again.number == 2 and again.confidence == pytest.approx(0.975)
    # a new production model or eval-set version is a new family
    assert ledger.reserve(family("eval_set", 1, "ckpt-3"), "ckpt-4", 0.95).number == 1
    assert ledger.reserve(family("eval_set", 2, "prod"), "ckpt-4", 0.95).number == 1
    stored = json.loads((tmp_path / "serving" / "gate_attempts.json").read_text())
    assert [e["checkpoint_id"] for e in stored["families"]["eval_set v1 vs prod"]] == [
        "ckpt-1",
        "ckpt-2",
        "ckpt-3",
    ]
    assert not list((tmp_path / "serving").glob("*.tmp*")), "written to a temporary name and renamed"
    assert again.metadata() == {
        "gate_attempt": 2,
        "gate_attempt_family": "eval_set v1 vs prod",
        "gate_confidence": pytest.approx(0.975),
    }
    assert "attempt 2 on eval_set v1 vs prod" in again.describe() and "1 earlier decision" in again.describe()


def _marginal_candidate(n: int = 120) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Summed losses of a candidate better by about two standard errors on ``n`` examples (and tokens): enough for
    the first attempt's 95 % interval, not for a stricter one."""
    rng = np.random.default_rng(5)
    tokens = rng.integers(20, 60, size=n).astype(float)
    production = rng.uniform(3.0, 5.0, size=n) * tokens
    noise = rng.normal(0, 0.1, size=n)
    noise -= (noise * tokens).sum() / tokens.sum()  # the token-weighted mean change is exactly the shift
    change = -0.021 + noise  # about 2.1 standard errors: 95 % high end -0.0013, 97.5 % +0.0017
    return production + change * tokens, production, tokens


@pytest.mark.parametrize("attempt", [2, 3])
def test_a_candidate_that_passes_at_the_first_attempt_fails_at_a_later_one(
    attempt: int, tmp_path: Path
) -> None:
    """The same figures gated as attempt 1 promote; as the second or third decision on the same eval set against
    the same production model they are computed at 97.5 % / 98.75 % and held back (the interval reaches zero)."""
    cand, prod, tokens = _marginal_candidate()
    ledger, key = GateAttempts.under(str(tmp_path)), family("eval_set", 1, PRODUCTION.checkpoint_id)
    outcomes = {}
    for k in range(1, attempt + 1):
        counted = ledger.reserve(key, f"ckpt-{k}", PromotionPolicy().confidence)
        policy = PromotionPolicy().for_attempt(counted.number)
        assert policy.confidence == pytest.approx(counted.confidence)
        paired = paired_loss_difference(cand, prod, tokens, confidence=policy.confidence)
        guard = eval_loss_guard(cand, prod, tokens, policy)
        outcomes[k] = decide(f"ckpt-{k}", PRODUCTION, policy, paired, guard=guard)
    assert outcomes[1].passed, outcomes[1].reason
    assert not outcomes[attempt].passed and outcomes[attempt].outcome == "hold back", outcomes[attempt].reason
    assert outcomes[attempt].interval is not None and outcomes[attempt].interval[1] >= 0


def test_the_decisions_metadata_shows_its_attempt_and_level(tmp_path: Path) -> None:
    """What the asset check and the materialization show in the UI (``GateDecision.metadata``, which the check's
    metadata and the report carry): the attempt, its family and the confidence it decided at."""
    from dataclasses import replace

    ledger, key = GateAttempts.under(str(tmp_path)), family("rl_eval_set", 1, "prod")
    ledger.reserve(key, "pref-1", 0.95)
    second = ledger.reserve(key, "rl-1", 0.95)
    cand, prod, tokens = _marginal_candidate()
    decision = replace(
        decide("rl-1", PRODUCTION, PromotionPolicy(), paired_loss_difference(cand, prod, tokens)),
        attempt=second,
    )
    meta = decision.metadata()
    assert (meta["gate_attempt"], meta["gate_attempt_family"]) == (2, "rl_eval_set v1 vs prod")
    assert meta["gate_confidence"] == pytest.approx(0.975) and ledger.count(key) == 2


def test_the_reason_names_the_attempt_its_level_and_how_many_earlier_decisions_halved_it() -> None:
    def describe(number: int) -> str:
        return Attempt("eval_set v1 vs prod", number, attempt_confidence(0.95, number)).describe()

    assert describe(1) == "attempt 1 on eval_set v1 vs prod: 0.95 interval, one-sided error 0.025"
    assert describe(2) == (
        "attempt 2 on eval_set v1 vs prod: 0.975 interval, one-sided error 0.0125 "
        "(halved for each of 1 earlier decision)"
    )
    assert describe(3) == (
        "attempt 3 on eval_set v1 vs prod: 0.9875 interval, one-sided error 0.00625 "
        "(halved for each of 2 earlier decisions)"
    )


def test_each_counted_attempt_records_when_it_was_counted_in_utc(tmp_path: Path) -> None:
    """``gate_attempts.json`` says when each decision was counted (``{"checkpoint_id", "at"}``, UTC), whatever the
    machine's time zone."""
    import datetime as dt

    before = dt.datetime.now(dt.UTC).replace(microsecond=0)
    GateAttempts.under(str(tmp_path)).reserve(family("eval_set", 1, "prod"), "ckpt-1", 0.95)
    stored = json.loads((tmp_path / "serving" / "gate_attempts.json").read_text())
    (entry,) = stored["families"]["eval_set v1 vs prod"]
    at = dt.datetime.fromisoformat(entry["at"])
    assert at.utcoffset() == dt.timedelta(0) and before <= at <= dt.datetime.now(dt.UTC)


def test_an_attempts_file_without_families_counts_none(tmp_path: Path) -> None:
    path = tmp_path / "serving" / "gate_attempts.json"
    path.parent.mkdir()
    path.write_text("{}")
    ledger, key = GateAttempts(path), family("eval_set", 1, "prod")
    assert ledger.families() == {} and ledger.count(key) == 0
    assert ledger.reserve(key, "ckpt-1", 0.95).number == 1
