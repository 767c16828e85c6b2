"""What the canary sensor reports from the serving service's status and its cursor (``canary_watch.py``): each new
check once, each decision once (from the status, or from the state file after the service restarted), the alias
moved once after a promotion and only while the pointer names it, a cursor that cannot be read reset; and a person's
stop in the runner (``CanaryRunner.stop_canary``): traffic back to the stable colour first, then the verdict saved."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from nexa_dagster.core.evaluation.promotion import ProductionEntry
from nexa_dagster.core.serving.canary import CanaryPolicy, CanaryState
from nexa_dagster.core.serving.canary_runner import CanaryRunner
from nexa_dagster.core.serving.canary_store import CANARY_FILE, Canary, CanaryStateError, load, save
from nexa_dagster.core.serving.canary_watch import (
    KEEP,
    WatchCursor,
    follow_promotion,
    recorded_decision,
    watch,
)


def figure(n_stable: int, n_canary: int, low: float = -0.1, high: float = 0.1) -> dict[str, Any]:
    return {
        "status": "undecided",
        "low": low,
        "high": high,
        "limit": 0.2,
        "n_stable": n_stable,
        "n_canary": n_canary,
        "stable_mean": 0.0,
        "canary_mean": 0.0,
        "threshold_s": None,
    }


def running_status(n: int, elapsed_s: int = 4) -> dict[str, Any]:
    """The service's status while B is a canary beside A (``ServingService._canary_status``'s shape)."""
    return {
        "checkpoint_id": "a",
        "canary": {
            "checkpoint_id": "b",
            "colour": "green",
            "share": 0.5,
            "since": "2026-12-03T09:00:00Z",
            "last_check": f"undecided after {elapsed_s} s",
            "canary_verdict": "continue",
            "canary_reason": f"undecided after {elapsed_s} s",
            "canary_failed": figure(n, n - 1),
        },
        "last_canary": None,
    }


def decided_status(
    verdict: str = "promote", reason: str = "canary no worse on every figure"
) -> dict[str, Any]:
    return {
        "checkpoint_id": "b" if verdict == "promote" else "a",
        "canary": None,
        "last_canary": {
            "checkpoint_id": "b",
            "verdict": verdict,
            "reason": reason,
            "decided_at": "2026-12-03T09:01:00Z",
            "started_at": 1000.0,
        },
    }


def test_a_running_canary_is_reported_once_per_check_that_changed_its_figures() -> None:
    first = watch(running_status(10), None, WatchCursor())
    (report,) = first.reports
    assert report.checkpoint_id == "b" and first.promoted is None
    meta = report.metadata
    assert (meta["canary_state"], meta["share"], meta["stable"], meta["colour"]) == (
        "running",
        0.5,
        "a",
        "green",
    )
    assert (meta["n_stable"], meta["n_canary"]) == (10, 9)
    assert (
        meta["figures"]["failed"]["limit"] == 0.2 and "on 50% of the requests beside a" in report.description
    )
    # the next tick, same figures (no traffic), only the elapsed seconds in the reason moved: nothing new
    again = watch(running_status(10, elapsed_s=6), None, first.cursor)
    assert again.reports == [] and again.cursor.check == first.cursor.check
    assert again.summary == "canary b runs: undecided after 6 s"
    more = watch(running_status(30), None, again.cursor)  # new requests: a new check
    assert [r.metadata["n_stable"] for r in more.reports] == [30]


def test_a_decision_seen_twice_is_reported_once_and_a_promotion_asks_for_the_alias_once() -> None:
    cursor = watch(running_status(10), None, WatchCursor()).cursor
    decided = watch(decided_status(), None, cursor)
    (report,) = decided.reports
    assert decided.promoted == "b" and report.promoted
    assert (report.metadata["verdict"], report.metadata["decided_at"]) == ("promote", "2026-12-03T09:01:00Z")
    assert not report.metadata["stopped_by_a_person"]
    again = watch(decided_status(), None, decided.cursor)
    assert again.reports == [] and again.promoted is None
    assert again.summary == "no canary runs; the last, b: promote"
    # a second canary of b, stopped with the same reason as the first: another decision (its own start), reported
    stop = "stopped by a person: wrong tokenizer"
    first = watch(decided_status("roll back", stop), None, again.cursor)
    second_status = decided_status("roll back", stop)
    second_status["last_canary"]["started_at"] = 2000.0
    second = watch(second_status, None, first.cursor)
    assert len(first.reports) == 1 and len(second.reports) == 1


def test_a_decision_read_from_the_state_file_after_a_service_restart_is_not_reported_again() -> None:
    """Before the restart the status named the decision; after it, only the state file does (same verdict and
    reason): the same key, no second report, no second alias move."""
    seen = watch(decided_status(), None, WatchCursor()).cursor
    restarted = {"checkpoint_id": "b", "canary": None, "last_canary": None}
    recorded = {
        "checkpoint_id": "b",
        "verdict": "promote",
        "reason": "canary no worse on every figure",
        "started_at": 1000.0,
    }
    after = watch(restarted, recorded, seen)
    assert after.reports == [] and after.promoted is None
    # a decision the sensor never saw (made and settled while the daemon was down) comes from the file, once
    fresh = watch(restarted, recorded, WatchCursor())
    assert fresh.promoted == "b" and "state file" in fresh.reports[0].metadata["source"]


def test_the_state_file_is_read_only_when_the_status_names_no_decision() -> None:
    recorded = {"checkpoint_id": "c", "verdict": "roll back", "reason": "old"}
    out = watch(decided_status("roll back", "stopped by a person: wrong tokenizer"), recorded, WatchCursor())
    assert [r.checkpoint_id for r in out.reports] == ["b"] and out.reports[0].metadata["stopped_by_a_person"]
    assert out.promoted is None  # a roll back moves no alias
    running = watch(
        running_status(5), recorded, WatchCursor()
    )  # a canary runs: the file is the running one's
    assert [r.metadata["canary_state"] for r in running.reports] == ["running"]


@pytest.mark.parametrize(
    "text",
    ["not json", "[1, 2]", '{"check": 3}', '{"decided": "b|promote|x"}', '{"decided": [1]}', "null"],
)
def test_a_cursor_that_cannot_be_read_is_reset_and_says_so(text: str) -> None:
    """Reset, not an error: every action is idempotent against the world (module docstring)."""
    cursor, problem = WatchCursor.parse(text)
    assert cursor == WatchCursor()
    assert problem is not None and "could not be read" in problem and "reset" in problem


def test_a_cursor_round_trips_and_keeps_the_last_decisions() -> None:
    assert WatchCursor.parse(None) == (WatchCursor(), None)
    cursor = WatchCursor("abc", [f"c{i}|roll back|r" for i in range(KEEP + 5)])
    back, problem = WatchCursor.parse(cursor.dump())
    assert problem is None and back.check == "abc" and back.decided == cursor.decided[-KEEP:]


class FakeRegistry:
    def __init__(self, versions: dict[str, str], alias: tuple[str, str] | None) -> None:
        self.versions, self.alias, self.moves = versions, alias, []

    def version_of(self, model_name: str, checkpoint_id: str) -> str | None:
        return self.versions.get(checkpoint_id)

    def alias_version(self, model_name: str, alias: str) -> tuple[str, str] | None:
        return self.alias

    def set_alias(self, model_name: str, alias: str, version: str) -> None:
        self.moves.append((model_name, alias, version))
        self.alias = (version, next(c for c, v in self.versions.items() if v == version))


def entry(checkpoint_id: str, version: str | None = None) -> ProductionEntry:
    return ProductionEntry(
        checkpoint_id=checkpoint_id,
        checkpoint_path=f"/c/{checkpoint_id}",
        metric="eval_loss",
        mlflow_version=version,
    )


def test_a_promotion_moves_the_alias_once_and_only_while_the_pointer_names_it() -> None:
    registry = FakeRegistry({"a": "1", "b": "2"}, alias=("1", "a"))  # the deployment's run died: alias behind
    said = follow_promotion(registry, "nexa-moe", "b", entry("b"))
    assert registry.moves == [("nexa-moe", "production", "2")] and "moved to nexa-moe v2 (b), was v1" in said
    assert "already on nexa-moe v2" in follow_promotion(registry, "nexa-moe", "b", entry("b"))
    assert len(registry.moves) == 1
    # the pointer moved on (a rollback, a later switch): an old promotion does not pull the alias back
    registry = FakeRegistry({"a": "1", "b": "2"}, alias=("1", "a"))
    assert "pointer names a, not b" in follow_promotion(registry, "nexa-moe", "b", entry("a"))
    assert "names nothing" in follow_promotion(registry, "nexa-moe", "b", None)
    assert "has no version" in follow_promotion(registry, "nexa-moe", "c", entry("c"))
    assert registry.moves == []
    # the pointer's own version (the entry the canary was given) wins over a lookup
    follow_promotion(registry, "nexa-moe", "b", entry("b", version="2"))
    assert registry.moves == [("nexa-moe", "production", "2")]


POLICY = CanaryPolicy(share=0.5, max_failure_increase=0.2, max_slow_increase=None, max_quality_drop=None)


def canary(verdict: str | None = None) -> Canary:
    state = CanaryState.start("a", "b", POLICY, 1000.0)
    return Canary("blue", "green", POLICY, state, verdict, "why" if verdict else None)


def test_the_recorded_decision_is_read_from_the_state_file_and_a_bad_file_is_named(tmp_path: Path) -> None:
    assert recorded_decision(tmp_path) == (None, None)
    save(canary(), tmp_path)
    assert recorded_decision(tmp_path) == (None, None)  # running: not a decision
    save(canary("promote"), tmp_path)
    assert recorded_decision(tmp_path) == (
        {"checkpoint_id": "b", "verdict": "promote", "reason": "why", "started_at": 1000.0},
        None,
    )
    (tmp_path / CANARY_FILE).write_text("{not json")
    decided, problem = recorded_decision(tmp_path)
    assert decided is None and problem is not None and str(tmp_path / CANARY_FILE) in problem


class FakeRouter:
    """Splits and routes; on a route, what the state file says then (the verdict must not be saved yet)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.routes = folder, []

    def split(self, canary: str, share: float) -> tuple[int, int]:
        return 128, 128

    def route_to(self, colour: str, drain_timeout_s: float = 120.0) -> float:
        saved = load(self.folder)
        self.routes.append((colour, saved.verdict if saved else None))
        return 0.0


def test_a_person_stops_a_canary_traffic_goes_back_first_then_the_verdict_is_saved(tmp_path: Path) -> None:
    router = FakeRouter(tmp_path)
    runner = CanaryRunner(router, tmp_path, tmp_path / "log.sock", check_every_s=3600).start(canary())  # type: ignore[arg-type]
    decision = runner.stop_canary("wrong tokenizer")
    assert (decision.verdict, decision.reason) == ("roll back", "stopped by a person: wrong tokenizer")
    assert router.routes == [("blue", None)]  # routed to the stable colour while the file still said running
    saved = load(tmp_path)
    assert saved is not None and (saved.verdict, saved.reason) == (
        "roll back",
        "stopped by a person: wrong tokenizer",
    )
    assert runner.decision is decision and [f.figure for f in decision.figures] == ["failed"]
    assert not runner._thread.is_alive()  # type: ignore[union-attr]


def test_a_verdict_reached_before_the_stop_stands(tmp_path: Path) -> None:
    clock = [1000.0]
    router = FakeRouter(tmp_path)
    runner = CanaryRunner(router, tmp_path, tmp_path / "log.sock", check_every_s=3600, clock=lambda: clock[0])  # type: ignore[arg-type]
    runner.start(canary())
    clock[0] += POLICY.max_duration_s + 1
    reached = runner.check()  # the time limit: "not enough traffic", rolled back
    assert reached.verdict == "roll back" and reached.reason.startswith("not enough traffic")
    assert runner.stop_canary("too late") is reached
    assert (
        len(router.routes) == 1
        and json.loads((tmp_path / CANARY_FILE).read_text())["reason"] == reached.reason
    )


def test_watch_does_not_change_the_status_it_is_given() -> None:
    status = running_status(10)
    before = copy.deepcopy(status)
    watch(status, None, WatchCursor())
    assert status == before


def test_a_canary_that_watches_quality_is_neither_started_nor_resumed_with_nothing_to_score_answers(
    tmp_path: Path,
) -> None:
    watched = CanaryPolicy(share=0.5, max_slow_increase=None)  # quality watched, as by default
    quality = Canary("blue", "green", watched, CanaryState.start("a", "b", watched, 1000.0))
    runner = CanaryRunner(FakeRouter(tmp_path), tmp_path, tmp_path / "log.sock")  # type: ignore[arg-type]
    with pytest.raises(CanaryStateError, match="nothing to score live answers with"):
        runner.start(quality)
    assert load(tmp_path) is None  # refused before anything changed
    save(quality, tmp_path)  # a running canary's state, as a killed runner leaves it
    with pytest.raises(CanaryStateError, match="nothing to score live answers with"):
        CanaryRunner(FakeRouter(tmp_path), tmp_path, tmp_path / "log.sock").resume()  # type: ignore[arg-type]
    assert load(tmp_path).running  # still running: the runner that has the answer book resumes it
