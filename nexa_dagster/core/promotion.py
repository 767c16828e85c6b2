"""Which checkpoint is in production, the rule that decides a promotion, and rollback.

The production pointer is a small JSON file (``<data_root>/serving/production.json``) holding the current
production checkpoint and the history of earlier ones, written atomically; the MLflow registry alias
``production`` is moved alongside it by the Dagster layer. Rolling back pops the history.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from nexa_dagster.core import storage
from nexa_dagster.core.config import load_yaml, validated


class PromotionPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt `margin` must not silently promote at margin 0

    metric: str = "validation_loss"
    lower_is_better: bool = True
    margin: float = Field(default=0.0, ge=0)
    registered_model: str = "nexa-moe"


def load_policy() -> PromotionPolicy:
    return validated(PromotionPolicy, "promotion.yaml", load_yaml("promotion.yaml"))


class ProductionEntry(BaseModel):
    checkpoint_id: str
    checkpoint_path: str
    metric: str
    value: float
    promoted_at: str = Field(default_factory=lambda: dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))
    mlflow_version: str | None = None


class ProductionState(BaseModel):
    current: ProductionEntry | None = None
    history: list[ProductionEntry] = Field(default_factory=list)  # earlier production models, oldest first


@dataclass(frozen=True)
class GateDecision:
    passed: bool
    reason: str
    candidate: float
    production: float | None


def decide(checkpoint_id: str, candidate: float, production: ProductionEntry | None,
           policy: PromotionPolicy) -> GateDecision:
    """Promote iff there is no production model, or the candidate beats it by the margin."""
    if production is None:
        return GateDecision(True, "no production model yet", candidate, None)
    if production.checkpoint_id == checkpoint_id:
        return GateDecision(True, f"{checkpoint_id} is the production model (re-evaluation)", candidate,
                            production.value)
    prod = production.value
    better = (prod - candidate) if policy.lower_is_better else (candidate - prod)
    if better > policy.margin or (policy.margin == 0 and better > 0):
        return GateDecision(True, f"{policy.metric} {candidate:.4f} beats production {production.checkpoint_id} "
                                  f"({prod:.4f}) by {better:.4f} > margin {policy.margin}", candidate, prod)
    return GateDecision(False, f"{policy.metric} {candidate:.4f} does not beat production "
                               f"{production.checkpoint_id} ({prod:.4f}) by more than margin {policy.margin}",
                        candidate, prod)


class ProductionRegistry:
    def __init__(self, path: str | Path) -> None:
        self.path = str(path)

    def state(self) -> ProductionState:
        if not storage.exists(self.path):
            return ProductionState()
        return ProductionState.model_validate(storage.read_json(self.path))

    def current(self) -> ProductionEntry | None:
        return self.state().current

    def promote(self, entry: ProductionEntry) -> ProductionState:
        state = self.state()
        if state.current is not None and state.current.checkpoint_id != entry.checkpoint_id:
            state.history.append(state.current)
        state.current = entry
        storage.write_json(state.model_dump(), self.path)
        return state

    def rollback(self) -> ProductionState:
        """Make the previous production model current again."""
        state = self.state()
        if not state.history:
            raise RuntimeError(f"nothing to roll back to: {self.path} has no earlier production model")
        state.current = state.history.pop()
        storage.write_json(state.model_dump(), self.path)
        return state


def report_metric(report: Any, metric: str) -> float:
    value = getattr(report, metric, None)
    if value is None:
        raise ValueError(f"evaluation report has no value for the promotion metric {metric!r}")
    return float(value)
