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

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nexa_dagster.core.common import storage
from nexa_dagster.core.common.config import load_yaml, validated
from nexa_dagster.core.evaluation.benchmarks import BENCHMARK_METRIC_PREFIX, BenchmarkComparison, parse_metric
from nexa_dagster.core.evaluation.paired import PairedLoss, WinRate


class PromotionPolicy(BaseModel):
    """``configs/promotion.yaml``: what the gate compares and how sure it must be."""

    model_config = ConfigDict(extra="forbid")  # a misspelt `margin` must not silently promote at margin 0

    metric: str = Field(
        default="eval_loss",
        description="eval_loss: paired per-example loss difference on the frozen eval set "
        "(lower is better); win_rate: the judge's order-consistent preference; "
        "benchmark:<task>/<metric>: an lm-evaluation-harness score "
        "(evaluation.benchmarks of the scale preset)",
    )
    margin: float = Field(
        default=0.0,
        ge=0,
        description="required improvement: nats per token for eval_loss, "
        "win rate above 0.5 for win_rate, the metric's own unit "
        "for a benchmark",
    )
    require_interval: bool = Field(
        default=True,
        description="the whole confidence interval must clear the margin, not just the point estimate",
    )
    confidence: float = Field(default=0.95, gt=0, lt=1)
    bootstrap_resamples: int = Field(default=2000, ge=100)
    registered_model: str = "nexa-moe"

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, metric: str) -> str:
        if metric.startswith(BENCHMARK_METRIC_PREFIX):
            parse_metric(metric)
        elif metric not in ("eval_loss", "win_rate"):
            raise ValueError(
                f"metric must be eval_loss, win_rate or {BENCHMARK_METRIC_PREFIX}<task>/<metric>, "
                f"not {metric!r}"
            )
        return metric

    @property
    def benchmark(self) -> bool:
        return self.metric.startswith(BENCHMARK_METRIC_PREFIX)


def load_policy(name: str = "promotion.yaml") -> PromotionPolicy:
    """``configs/<name>``, checked: an unknown or missing key fails naming the file and the key."""
    return validated(PromotionPolicy, name, load_yaml(name))


class ProductionEntry(BaseModel):
    checkpoint_id: str
    checkpoint_path: str
    metric: str
    value: float | None = None  # its eval_loss on eval_set_version when it was promoted (for reference)
    eval_set_version: int | None = None
    promoted_at: str = Field(default_factory=lambda: dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))
    mlflow_version: str | None = None


class ProductionState(BaseModel):
    current: ProductionEntry | None = None
    history: list[ProductionEntry] = Field(default_factory=list)  # earlier production models, oldest first


@dataclass(frozen=True)
class GateDecision:
    """The gate's verdict and the numbers it was made from (both models' values on the same eval set, the
    difference candidate - production for eval_loss or the win rate for win_rate, and its interval)."""

    passed: bool
    reason: str
    candidate: float | None = None
    production: float | None = None
    difference: float | None = None
    interval: tuple[float, float] | None = None

    def metadata(self) -> dict[str, Any]:
        low, high = self.interval if self.interval else (None, None)
        return {
            "decision": "promote" if self.passed else "hold back",
            "reason": self.reason,
            "candidate": self.candidate,
            "production": self.production,
            "difference": self.difference,
            "interval_low": low,
            "interval_high": high,
        }


def decide(
    checkpoint_id: str,
    production: ProductionEntry | None,
    policy: PromotionPolicy,
    paired_loss: PairedLoss | None = None,
    win_rate: WinRate | None = None,
    benchmark: BenchmarkComparison | None = None,
) -> GateDecision:
    """Promote iff there is no production model, or the candidate beats it on the same eval set by the margin;
    with ``require_interval`` the whole confidence interval must clear the margin (a tie, or an improvement
    smaller than the noise of the eval set, is held back)."""
    if production is None:
        return GateDecision(True, "no production model yet")
    if production.checkpoint_id == checkpoint_id:
        return GateDecision(True, f"{checkpoint_id} is the production model (re-evaluation)")
    need = "interval" if policy.require_interval else "point estimate"
    level = f"{policy.confidence:.0%}"
    if policy.benchmark:
        if benchmark is None:
            return GateDecision(
                False,
                f"{policy.metric} was not measured on both {checkpoint_id} and production "
                f"{production.checkpoint_id}: nothing to compare with",
            )
        b = benchmark
        worst = b.low if policy.require_interval else b.difference  # better is positive
        passed = worst > policy.margin
        reason = (
            f"{b.metric} {b.candidate:.4f} vs production {production.checkpoint_id} {b.production:.4f}: "
            f"{'gain' if b.higher_is_better else 'reduction'} {b.difference:+.4f}, {level} interval "
            f"[{b.low:+.4f}, {b.high:+.4f}] (the harness's standard errors); the {need} "
            f"{'is' if passed else 'is not'} above {policy.margin}"
        )
        return GateDecision(passed, reason, b.candidate, b.production, b.difference, (b.low, b.high))
    if policy.metric == "eval_loss":
        if paired_loss is None:
            return GateDecision(
                False,
                f"production {production.checkpoint_id} was not scored on the same eval set "
                "(its checkpoint is not readable here): nothing to compare with",
            )
        d = paired_loss.difference
        worst = (
            d.high if policy.require_interval else d.estimate
        )  # candidate - production: negative is better
        passed = worst < -policy.margin
        reason = (
            f"eval_loss {paired_loss.candidate:.4f} vs production {production.checkpoint_id} "
            f"{paired_loss.production:.4f}: difference {d.estimate:+.4f}, {level} interval [{d.low:+.4f}, "
            f"{d.high:+.4f}]; the {need} {'is' if passed else 'is not'} below -{policy.margin} "
            f"over {paired_loss.examples} examples"
        )
        return GateDecision(
            passed, reason, paired_loss.candidate, paired_loss.production, d.estimate, (d.low, d.high)
        )
    if win_rate is None:
        return GateDecision(
            False,
            f"the judge did not compare {checkpoint_id} with production "
            f"{production.checkpoint_id}: nothing to compare with",
        )
    r = win_rate.rate
    worst = r.low if policy.require_interval else r.estimate
    passed = worst > 0.5 + policy.margin
    reason = (
        f"win_rate {r.estimate:.3f} over production {production.checkpoint_id} ({win_rate.wins} wins, "
        f"{win_rate.losses} losses, {win_rate.inconsistent} order-inconsistent), {level} interval "
        f"[{r.low:.3f}, {r.high:.3f}]; the {need} {'is' if passed else 'is not'} above "
        f"{0.5 + policy.margin}"
    )
    return GateDecision(passed, reason, r.estimate, 1 - r.estimate, r.estimate - 0.5, (r.low, r.high))


def held_back_because(checkpoint_id: str, report: Any, production: ProductionEntry | None) -> str | None:
    """Why serving must not deploy a checkpoint whose evaluation ``report`` (an ``EvalReport``) recorded the gate's
    decision, or None to deploy. The decision holds only against the production model it was made against: when
    production has changed since, the checkpoint is evaluated again, not deployed on an old comparison."""
    if report.gate_decision is None:
        return "its evaluation predates the paired promotion gate; evaluate it again"
    if report.gate_decision != "promote":
        return f"the promotion gate held it back ({report.gate_reason or report.gate_decision})"
    if production is not None and production.checkpoint_id not in (
        checkpoint_id,
        report.production_checkpoint_id,
    ):
        return (
            f"production is now {production.checkpoint_id}, not {report.production_checkpoint_id or 'none'} as "
            "when it was evaluated; evaluate it again to compare it with the current production model"
        )
    return None


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
