"""A canary's state on disk (``data/serving/canary.json``): what survives a restart of the serving service or of
Dagster's daemon, so a canary is resumed where it was, and never two at once, nor one left half-promoted.

The file holds the policy the canary runs under, its ``CanaryState`` (running sums only: a few hundred bytes
whatever the traffic), the colours, the production pointer's entry a promotion writes (its checkpoint path relative
to the data root, the file's folder's parent, as ``production.json`` stores it), and, once decided, the verdict
with its reason. (The request log is a socket:
requests served while nothing read it, during a restart, are not counted, and none is counted twice.) Written whole to a
temporary file and renamed (``storage.write_json``): a reader sees the old state or the new one.

Bad files are named errors, never a guess: a state that cannot be read or does not hold what a canary needs raises
``CanaryStateError`` naming the file and the field; serving keeps the stable model (the caller's rule).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from nexa_dagster.core.common import roots, storage
from nexa_dagster.core.serving.canary import CanaryDecision, CanaryPolicy, CanaryState

CANARY_FILE = "canary.json"
_FIELDS = ("stable_colour", "canary_colour", "policy", "state", "verdict", "reason")


class CanaryStateError(RuntimeError):
    """The canary's state file is missing, unreadable or wrong: the message names the file and what is wrong."""


@dataclass
class Canary:
    """One canary: which colour serves which checkpoint, the policy, what it has seen, and its end once decided."""

    stable_colour: str
    canary_colour: str
    policy: CanaryPolicy
    state: CanaryState
    verdict: str | None = None  # "promote" or "roll back" once decided
    reason: str | None = None
    entry: dict[str, Any] | None = (
        None  # the production pointer's entry a promotion writes (None: the caller's)
    )

    @property
    def running(self) -> bool:
        return self.verdict is None

    def conclude(self, decision: CanaryDecision) -> None:
        if decision.verdict == "continue":
            raise ValueError("a canary is concluded by 'promote' or 'roll back', not 'continue'")
        self.verdict, self.reason = decision.verdict, decision.reason

    def to_dict(self) -> dict[str, Any]:
        return {
            "stable_colour": self.stable_colour,
            "canary_colour": self.canary_colour,
            "policy": self.policy.model_dump(),
            "state": self.state.to_dict(),
            "verdict": self.verdict,
            "reason": self.reason,
            "entry": self.entry,
        }


def save(canary: Canary, folder: Path) -> Path:
    path = folder / CANARY_FILE
    data = canary.to_dict()
    if (
        canary.entry is not None and "checkpoint_path" in canary.entry
    ):  # relative to the data root when under it
        data["entry"] = {
            **canary.entry,
            "checkpoint_path": roots.relative_to(str(canary.entry["checkpoint_path"]), str(folder.parent)),
        }
    storage.write_json(data, path)
    return path


def load(folder: Path) -> Canary | None:
    """The canary recorded in ``folder``, or None when there has never been one."""
    path = folder / CANARY_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CanaryStateError(f"cannot read the canary's state {path}: {e}") from e
    if not isinstance(data, dict):
        raise CanaryStateError(f"the canary's state {path} is not an object (got {type(data).__name__})")
    missing = [f for f in _FIELDS if f not in data]
    if missing:
        raise CanaryStateError(f"the canary's state {path} lacks {', '.join(missing)}")
    try:
        policy = CanaryPolicy.model_validate(data["policy"])
        state = CanaryState.from_dict(data["state"])
    except (ValidationError, KeyError, TypeError) as e:
        raise CanaryStateError(f"the canary's state {path} holds a bad policy or state: {e}") from e
    entry = data.get(
        "entry"
    )  # absent in a file written before it was kept: a promotion then moves no pointer
    if entry is not None and not isinstance(entry, dict):
        raise CanaryStateError(
            f"the canary's state {path}: entry must be an object, got {type(entry).__name__}"
        )
    if entry is not None and "checkpoint_path" in entry:
        entry = {
            **entry,
            "checkpoint_path": roots.resolve_under(str(entry["checkpoint_path"]), str(folder.parent)),
        }
    return Canary(
        data["stable_colour"], data["canary_colour"], policy, state, data["verdict"], data["reason"], entry
    )


def begin(canary: Canary, folder: Path) -> Path:
    """Record a new canary; refused, with nothing changed, while another one runs."""
    current = load(folder)
    if current is not None and current.running:
        raise CanaryStateError(
            f"a canary of {current.state.canary_id} against {current.state.stable_id} is running "
            f"({folder / CANARY_FILE}): wait for its decision or stop it first"
        )
    return save(canary, folder)
