"""What happened to an evaluated checkpoint at deployment, recorded where a person (and the leaderboard) reads it.

The gate's verdict is a decision made against the production model of that moment; what serving did with it can
differ (production changed since the evaluation, the smoke test failed). ``outcome.json`` in the checkpoint's
deployment folder says what happened: ``deployed``, ``held back`` (with the reason) or ``failed`` (with the error),
and which checkpoint was in production afterwards. Written atomically; the newest attempt wins.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any, Literal

from nexa_dagster.core.common import storage

OUTCOME_FILE = "outcome.json"
# rolled back: by its canary, on live traffic
Outcome = Literal["deployed", "held back", "failed", "rolled back"]


def record_outcome(
    deployment_dir: str | Path,
    checkpoint_id: str,
    outcome: Outcome,
    reason: str,
    production_after: str | None,
) -> dict[str, Any]:
    record = {
        "checkpoint_id": checkpoint_id,
        "outcome": outcome,
        "reason": reason,
        "production_after": production_after,
        "at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    storage.write_json(record, storage.join(str(deployment_dir), OUTCOME_FILE))
    return record


def read_outcome(deployment_dir: str | Path) -> dict[str, Any] | None:
    path = storage.join(str(deployment_dir), OUTCOME_FILE)
    return storage.read_json(path) if storage.exists(path) else None


def describe(record: dict[str, Any] | None) -> str:
    """One phrase for a summary or a leaderboard cell: ``deployed``, ``held back: <why>``, ``failed: <why>``."""
    if record is None:
        return ""
    return (
        record["outcome"] if record["outcome"] == "deployed" else f"{record['outcome']}: {record['reason']}"
    )
