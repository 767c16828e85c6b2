"""What the guards found reaches the gate's decision whole: a candidate the mean would promote is held back naming
each guard; one already held back keeps the worse of the two outcomes, and the guards' figures, findings and rule
go with it either way (the UI and the summary show them)."""

from __future__ import annotations

import pytest
import yaml

from nexa_dagster.core.common.config import REPO_ROOT
from nexa_dagster.core.evaluation.guards import GuardReport
from nexa_dagster.core.evaluation.promotion import GateDecision, PromotionPolicy, apply_guards, load_policy

FINDINGS = (
    ("hold back", "regressed share 0.12 > 0.05 (13 of 107 examples worse by > 0.1)"),
    ("insufficient evidence", "skewness 2.3 needs n >= 132 (Cochran)"),
)


def _guard(findings=FINDINGS) -> GuardReport:
    return GuardReport(
        n=107,
        skewness=2.3,
        skew_needs=132,
        regressed=13,
        regressed_share=13 / 107,
        regressed_interval=(0.07, 0.19),
        margin=0.1,
        max_regressed_share=0.05,
        findings=findings,
    )


def _decision(passed: bool, decision=None) -> GateDecision:
    return GateDecision(
        passed=passed,
        reason="mean -0.04 [-0.07, -0.01]",
        difference=-0.04,
        interval=(-0.07, -0.01),
        decision=decision,
        n=107,
        rule="interval high < 0",
        guards=("earlier finding",),
    )


def test_a_candidate_the_mean_promotes_is_held_back_with_every_finding_named_in_order() -> None:
    guard = _guard()
    out = apply_guards(_decision(True), guard)
    assert not out.passed and out.outcome == "hold back"
    assert out.guard is guard
    assert out.guards == ("earlier finding", FINDINGS[0][1], FINDINGS[1][1])
    assert out.reason == f"{FINDINGS[0][1]}; {FINDINGS[1][1]}; mean -0.04 [-0.07, -0.01]"
    assert out.rule == "interval high < 0; guards"
    assert out.metadata()["decision"] == "hold back" and out.metadata()["reason"] == out.reason


def test_a_guard_that_only_cannot_tell_makes_a_promotion_insufficient_evidence() -> None:
    out = apply_guards(_decision(True), _guard(FINDINGS[1:]))
    assert not out.passed and out.outcome == "insufficient evidence"


def test_a_decision_already_held_back_keeps_the_worse_outcome_and_names_the_guards() -> None:
    guard = _guard()
    out = apply_guards(_decision(False, "insufficient evidence"), guard)
    assert not out.passed
    assert out.outcome == "hold back"  # a guard's "hold back" outranks the mean's "insufficient evidence"
    assert out.guard is guard
    assert out.guards == ("earlier finding", FINDINGS[0][1], FINDINGS[1][1])
    assert out.reason == f"mean -0.04 [-0.07, -0.01]; guards: {FINDINGS[0][1]}; {FINDINGS[1][1]}"
    assert out.rule == "interval high < 0"  # the mean decided; the guards only add to the reason


def test_guards_that_find_nothing_leave_the_decision_and_state_their_figures() -> None:
    guard = _guard(())
    out = apply_guards(_decision(True), guard)
    assert out.passed and out.outcome == "promote" and out.guard is guard
    assert out.reason.startswith("mean -0.04 [-0.07, -0.01]; guards pass: ")
    assert out.guards == ("earlier finding",)
    assert apply_guards(_decision(True), None) == _decision(True)


def test_the_policy_is_the_shipped_file_checked_and_a_bad_key_names_its_file(tmp_path, monkeypatch) -> None:
    shipped = yaml.safe_load((REPO_ROOT / "configs" / "promotion.yaml").read_text())
    assert load_policy() == PromotionPolicy.model_validate(shipped)
    (tmp_path / "strict.yaml").write_text(yaml.safe_dump({**shipped, "min_exampels": 5}))
    monkeypatch.setenv("NEXA_CONFIG_DIR", str(tmp_path))
    with pytest.raises(Exception, match=r"strict\.yaml[\s\S]*min_exampels"):
        load_policy("strict.yaml")


def test_a_decision_short_of_evidence_stays_so_when_the_guards_only_cannot_tell_either() -> None:
    out = apply_guards(_decision(False, "insufficient evidence"), _guard(FINDINGS[1:]))
    assert out.passed is False and out.outcome == "insufficient evidence"


def test_a_candidate_held_back_by_a_guard_is_not_passed() -> None:
    assert apply_guards(_decision(True), _guard()).passed is False
