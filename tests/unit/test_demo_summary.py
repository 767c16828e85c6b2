"""``make run``'s summary says at what level a later attempt decided and why (issue 47, point 5): a night gated
against the same production model on the same eval set as a held-back night before it prints its stricter interval
and its attempt; a first attempt prints the gate's own 95 % and nothing more."""

from __future__ import annotations

from nexa_dagster.demo import Night, attempt_line, ci_label, summary_lines


def _night(number: int, attempt: int | None, confidence: float | None) -> Night:
    return Night(
        number,
        f"2026-11-2{number}",
        f"ckpt-{number}",
        1,
        3.50,
        "ckpt-1",
        3.52,
        -0.02,
        (-0.035, -0.005),
        "promote",
        "...",
        f"ckpt-{number}",
        107,
        "skew-corrected t-interval (Hall)",
        "interval high < -0.0",
        "deployed",
        "guards pass: ...",
        attempt,
        confidence,
    )


def test_a_later_attempt_prints_its_stricter_level_and_count() -> None:
    first = summary_lines([_night(2, 1, 0.95)])
    assert "difference -0.0200 95% CI [-0.0350, -0.0050]" in first[0]
    assert first[1:] == ["  guards pass: ..."]  # a first attempt adds nothing
    lines = summary_lines([_night(3, 3, 0.9875)])
    third = lines[0]
    assert "difference -0.0200 98.75% CI [-0.0350, -0.0050]" in third and third.endswith("deployed")
    assert lines[2] == (
        "  attempt 3 against this production model on this eval set: every interval at 98.75% CI (one-sided error "
        "halved for each of the 2 earlier decisions)"
    )
    assert ci_label(None) == "95% CI" and ci_label(0.975) == "97.5% CI" and attempt_line(1, 0.95) == ""
