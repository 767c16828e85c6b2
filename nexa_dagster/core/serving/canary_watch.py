"""What Dagster's canary sensor reports (issue 50): from the serving service's ``GET /status`` and the sensor's
cursor, the running canary's new figures and each decision once; and, after a promotion, the MLflow alias
``production`` moved to the promoted checkpoint's version if a deployment run that died left it behind the pointer.

The cursor (JSON, persisted by Dagster between ticks, so a restarted daemon goes on from it) holds a digest of the
last check reported (a check whose figures did not change is not reported again: no traffic, no new observation)
and the keys of the decisions reported (``checkpoint|verdict|reason|started_at``, the last ``KEEP`` of them). A decision is
read from the status's ``last_canary``, or, when the service restarted since (its ``last_canary`` is gone), from
the canary's state file, which holds the same verdict and reason: the same key, never reported twice.

A cursor that cannot be read is reset (and said so), not an error: everything the sensor does is idempotent
against the world (an observation, an alias moved only when it is not there and the production pointer names the
promoted checkpoint), so a reset costs at most one repeated observation, while an error would stop the sensor, and
with it the alias's repair, until a person cleared the cursor by hand.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from nexa_dagster.core.evaluation.promotion import ProductionEntry
from nexa_dagster.core.serving.canary import STOPPED
from nexa_dagster.core.serving.canary_store import CanaryStateError, load

KEEP = 50  # decisions remembered: far more than can happen between two ticks


@dataclass
class WatchCursor:
    check: str | None = None  # digest of the running canary's last check reported
    decided: list[str] = field(default_factory=list)  # keys of the decisions reported, oldest first

    @classmethod
    def parse(cls, text: str | None) -> tuple[WatchCursor, str | None]:
        """The cursor, and what was wrong with it when it had to be reset (None: nothing)."""
        if not text:
            return cls(), None
        try:
            data = json.loads(text)
            check, decided = data.get("check"), data.get("decided", [])
            if not (check is None or isinstance(check, str)) or not (
                isinstance(decided, list) and all(isinstance(k, str) for k in decided)
            ):
                raise ValueError("wants {'check': str or null, 'decided': [str, ...]}")
        except (ValueError, AttributeError) as e:
            return cls(), f"the canary sensor's cursor {text[:200]!r} could not be read ({e}): reset"
        return cls(check, decided), None

    def dump(self) -> str:
        return json.dumps({"check": self.check, "decided": self.decided[-KEEP:]}, sort_keys=True)


@dataclass(frozen=True)
class Report:
    """One observation of ``model_deployment``'s partition ``checkpoint_id``."""

    checkpoint_id: str
    description: str
    metadata: dict[str, Any]
    promoted: bool = False  # the report of a promotion (the alias's outcome goes with it)


@dataclass(frozen=True)
class Watch:
    reports: list[Report]
    promoted: str | None  # a promotion reported now: the alias follows it (``follow_promotion``)
    cursor: WatchCursor
    summary: str  # what the service shows, in a line (the skip reason when nothing is reported)


def figures(running: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The running canary's figures (``canary_<figure>`` in its status) by figure."""
    return {
        k.removeprefix("canary_"): v
        for k, v in running.items()
        if k.startswith("canary_") and isinstance(v, dict)
    }


def check_digest(running: dict[str, Any]) -> str:
    """What identifies a check: the canary and its figures (not the elapsed seconds its reason names)."""
    facts = {"checkpoint_id": running.get("checkpoint_id"), "figures": figures(running)}
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def running_report(status: dict[str, Any], running: dict[str, Any]) -> Report:
    per_figure = figures(running)
    n = {
        arm: max((f.get(f"n_{arm}") or 0 for f in per_figure.values()), default=0)
        for arm in ("stable", "canary")
    }
    return Report(
        str(running["checkpoint_id"]),
        f"canary {running['checkpoint_id']} on {running['share']:.0%} of the requests beside "
        f"{status.get('checkpoint_id')}: {running.get('last_check')}",
        {
            "canary_state": "running",
            "share": running["share"],
            "stable": status.get("checkpoint_id"),
            "colour": running.get("colour"),
            "since": running.get("since"),
            "last_check": running.get("last_check"),
            "n_stable": n["stable"],
            "n_canary": n["canary"],
            "figures": per_figure,
        },
    )


def decision_key(decided: dict[str, Any]) -> str:
    """One decision's key: two canaries of one checkpoint ended alike (two stops with one reason) differ by their
    start time."""
    return (
        f"{decided.get('checkpoint_id')}|{decided.get('verdict')}|{decided.get('reason')}|"
        f"{decided.get('started_at')}"
    )


def decision_report(decided: dict[str, Any], source: str) -> Report:
    verdict, reason = str(decided.get("verdict")), str(decided.get("reason"))
    return Report(
        str(decided["checkpoint_id"]),
        f"canary {decided['checkpoint_id']}: {verdict}: {reason}",
        {
            "canary_state": "decided",
            "verdict": verdict,
            "reason": reason,
            "stopped_by_a_person": reason.startswith(STOPPED),
            "decided_at": decided.get("decided_at"),
            "source": source,
        },
        promoted=verdict == "promote",
    )


def watch(status: dict[str, Any], recorded: dict[str, Any] | None, cursor: WatchCursor) -> Watch:
    """What to report now. ``status``: the service's ``GET /status``; ``recorded``: the last canary of its state
    file (``recorded_decision``), used only when the status names no decision (the service restarted since)."""
    reports: list[Report] = []
    promoted, check, decided_keys = None, cursor.check, list(cursor.decided)
    running = status.get("canary")
    if running:
        check = check_digest(running)
        if check != cursor.check:
            reports.append(running_report(status, running))
    decided, source = status.get("last_canary"), "the serving service's status"
    if not decided and not running and recorded:
        decided, source = recorded, "the canary's state file (the serving service restarted since)"
    if decided and decision_key(decided) not in decided_keys:
        reports.append(decision_report(decided, source))
        decided_keys.append(decision_key(decided))
        if decided.get("verdict") == "promote":
            promoted = str(decided["checkpoint_id"])
    if running:
        summary = f"canary {running['checkpoint_id']} runs: {running.get('last_check') or 'no check yet'}"
    elif decided:
        summary = f"no canary runs; the last, {decided['checkpoint_id']}: {decided.get('verdict')}"
    else:
        summary = "no canary runs, none decided since the serving service started"
    return Watch(reports, promoted, WatchCursor(check, decided_keys[-KEEP:]), summary)


def recorded_decision(serving_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The last canary's decision from its state file (None while it runs or when there is none), and the named
    error of a file that cannot be read (the sensor says it; the service keeps serving the stable model)."""
    try:
        canary = load(serving_dir)
    except CanaryStateError as e:
        return None, str(e)
    if canary is None or canary.running:
        return None, None
    return {
        "checkpoint_id": canary.state.canary_id,
        "verdict": canary.verdict,
        "reason": canary.reason,
        "started_at": canary.state.started_at,
    }, None


class ModelRegistry(Protocol):
    """What ``follow_promotion`` needs of the tracking resource (``resources/tracking.py``)."""

    def version_of(self, model_name: str, checkpoint_id: str) -> str | None: ...

    def alias_version(self, model_name: str, alias: str) -> tuple[str, str] | None: ...

    def set_alias(self, model_name: str, alias: str, version: str) -> None: ...


def follow_promotion(
    registry: ModelRegistry,
    registered_model: str,
    checkpoint_id: str,
    pointer: ProductionEntry | None,
    alias: str = "production",
) -> str:
    """After a canary's promotion: ``alias`` moved to the promoted checkpoint's version unless it is there already;
    only while the production pointer names that checkpoint (the service moved it; a later switch or rollback moved
    it on, and then the alias is that one's). Returns what was done, in a sentence."""
    if pointer is None or pointer.checkpoint_id != checkpoint_id:
        named = pointer.checkpoint_id if pointer else "nothing"
        return f"alias {alias!r} left alone: the production pointer names {named}, not {checkpoint_id}"
    version = pointer.mlflow_version or registry.version_of(registered_model, checkpoint_id)
    if version is None:
        return f"alias {alias!r} left alone: {checkpoint_id} has no version of {registered_model}"
    current = registry.alias_version(registered_model, alias)
    if current is not None and current[0] == str(version):
        return f"alias {alias!r} already on {registered_model} v{version} ({checkpoint_id})"
    registry.set_alias(registered_model, alias, str(version))
    was = f"v{current[0]}" if current else "nothing"
    return f"alias {alias!r} moved to {registered_model} v{version} ({checkpoint_id}), was {was}"
