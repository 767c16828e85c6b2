"""The canary's decision on live traffic: roll back as soon as it is shown worse, promote once it is shown no worse
on every watched figure, roll back when the time limit comes first ("not enough traffic").

What is watched, per backend (stable and canary), each request's outcome as a value in [0, 1] so that one
confidence sequence (``confidence_sequence``) applies to all of them:

- ``failed``: 1 for a failed request (a 5xx, a timeout, a cut stream), else 0; held to ``max_failure_increase``.
- ``slow``: 1 for a successful request slower than the threshold, else 0; held to ``max_slow_increase``. The
  threshold is ``slow_request_s``, or, unset, ``slow_factor`` times the median of the stable backend's first
  ``warmup_requests`` requests, which then count for nothing else (a threshold chosen from the data it judges
  would void the guarantee). Why a share of slow requests and not the mean latency: latency is heavy-tailed and
  unbounded, and a bounded figure is what a nonparametric sequence needs; a mean clipped at a timeout is bounded
  too, but with latencies far below the timeout its bounds are far too wide to say anything in relative terms
  (tried: 0.4 s requests under a 60 s cap were undecided after 1,800 requests). A share over a threshold is what a
  latency objective (p90 under so many seconds) states, and a canary three times slower moves it by tens of points.
- ``slow_first_token``: the same for a streamed request's time to first token (``max_slow_first_token_increase``;
  off unless a lab's traffic streams).
- ``quality``: a score in [0, 1] of a sampled live request (the verifiable reward on a checkable task, else the
  judge's score, blind to the backend); held to ``max_quality_drop``.

The rule, per figure, on the bounds of how much worse the canary is (its mean minus the stable's; for quality the
stable's minus the canary's) built from the two backends' confidence sequences: *worse* when its low end is above
the limit (roll back at once, naming it), *no worse* when its high end is below the limit; promote when every
watched figure is *no worse*.

Its error, in both directions, under continuous monitoring: each backend's sequence for each of the k watched
figures is run at ``(1 - confidence) / (2k)``, so with probability at least ``confidence`` every sequence covers
its mean at every time at once (Bonferroni over the 2k sequences). On that event a canary truly worse than a limit
on some figure is never promoted (its high end stays above the limit) and a canary truly no worse than a limit on
every figure is never rolled back for being worse. So, whatever the number or timing of the checks: P(promote a
canary worse beyond a limit) <= 1 - confidence, and P(roll back a canary at or better than the stable on every
figure, before the time limit) <= 1 - confidence. ``canary_simulation`` measures both beside a fixed-n interval
re-checked as often, which inflates them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nexa_dagster.core.serving.confidence_sequence import SequenceState

Arm = Literal["stable", "canary"]
Verdict = Literal["promote", "roll back", "continue"]
Status = Literal["worse", "no worse", "undecided"]
FIGURES = ("failed", "slow", "slow_first_token", "quality")
STOPPED = "stopped by a person: "  # a stopped canary's reason starts so (POST /canary/stop, stop_canary_job)
LATENCY_FIGURES = {"slow": "latency_s", "slow_first_token": "first_token_s"}  # figure: the request's seconds


class CanaryPolicy(BaseModel):
    """``canary:`` of serving.yaml: how much traffic the canary gets, what it is held to, and for how long."""

    model_config = ConfigDict(extra="forbid")

    share: float = Field(
        default=0.1, gt=0, lt=1, description="the share of the endpoint's requests the canary serves"
    )
    confidence: float = Field(
        default=0.95,
        gt=0.5,
        lt=1,
        description="the chance that no decision is wrong, however often the canary is checked",
    )
    max_failure_increase: float | None = Field(
        default=0.02,
        gt=0,
        lt=1,
        description="the failed-request share the canary may add to the stable's (0.02: two points); null: not "
        "watched",
    )
    max_slow_increase: float | None = Field(
        default=0.10,
        gt=0,
        lt=1,
        description="the share of slow requests (slower than the threshold) the canary may add to the stable's",
    )
    max_slow_first_token_increase: float | None = Field(
        default=None,
        gt=0,
        lt=1,
        description="the same for streamed requests' time to first token (null: not watched)",
    )
    slow_request_s: float | None = Field(
        default=None,
        gt=0,
        description="a request slower than this is slow (a latency objective); null: slow_factor x the stable's "
        "median over the warm-up",
    )
    slow_factor: float = Field(
        default=2.0, gt=1, description="the derived threshold: this times the stable's median"
    )
    warmup_requests: int = Field(
        default=30, ge=5, description="the stable's first successful requests that set a derived threshold"
    )
    max_quality_drop: float | None = Field(
        default=0.10,
        gt=0,
        lt=1,
        description="the score in [0, 1] the canary may lose on sampled live requests. 0.10, not the offline "
        "gate's finer margins: the gate already measured quality on a frozen eval set; live scores are a net for "
        "what it cannot see (live prompts, a broken chat template), and a 0.05 margin on 0/1 rewards of a quarter "
        "of the requests needs tens of thousands of requests (docs/stages/serving.md, Canary)",
    )
    quality_sample_share: float = Field(
        default=0.25,
        gt=0,
        le=1,
        description="the share of requests whose answers are kept and scored for the quality figure (both "
        "backends at this rate). 0.25, the share the simulation assumes: the verifiable reward costs nothing, the "
        "judge costs a model call per answer; raise it where traffic is thin",
    )
    max_duration_s: float = Field(
        default=1800.0, gt=0, description="undecided after this long: 'not enough traffic', rolled back"
    )

    @model_validator(mode="after")
    def _something_watched(self) -> CanaryPolicy:
        if not self.figures():
            raise ValueError("a canary needs at least one watched figure (every max_* is null)")
        return self

    def limit(self, figure: str) -> float | None:
        return {
            "failed": self.max_failure_increase,
            "slow": self.max_slow_increase,
            "slow_first_token": self.max_slow_first_token_increase,
            "quality": self.max_quality_drop,
        }[figure]

    def figures(self) -> tuple[str, ...]:
        return tuple(f for f in FIGURES if self.limit(f) is not None)

    def sequence_alpha(self) -> float:
        """Each backend's sequence's level for each figure: Bonferroni over the 2k sequences (module docstring)."""
        return (1 - self.confidence) / (2 * len(self.figures()))


def worse_bounds(figure: str, stable: tuple[Any, Any], canary: tuple[Any, Any]) -> tuple[Any, Any]:
    """(low, high) of how much worse the canary is, from each backend's (low, high) of its mean: numpy arrays or
    floats alike (the simulation passes thousands of streams' bounds at once)."""
    (s_low, s_high), (c_low, c_high) = stable, canary
    if figure == "quality":  # a score: lower is worse
        return s_low - c_high, s_high - c_low
    return c_low - s_high, c_high - s_low


def shown(low: Any, high: Any, limit: float) -> tuple[Any, Any]:
    """(worse, no worse): the rule on a figure's bounds, for floats or arrays of them (the simulation's streams)."""
    return low > limit, high < limit


def status(low: float, high: float, limit: float) -> Status:
    worse, no_worse = shown(low, high, limit)
    return "worse" if worse else ("no worse" if no_worse else "undecided")


@dataclass(frozen=True)
class FigureResult:
    figure: str
    n_stable: int
    n_canary: int
    stable_mean: float | None
    canary_mean: float | None
    low: float
    high: float
    limit: float
    status: Status
    threshold_s: float | None = None  # a slow figure's threshold (None: not set yet, or not a slow figure)

    def describe(self) -> str:
        what = "lower score" if self.figure == "quality" else "more of requests"
        if self.threshold_s is not None:
            what += f" slower than {self.threshold_s:.3g} s"
        means = (
            ""
            if self.stable_mean is None or self.canary_mean is None
            else (f"; {self.stable_mean:.3g} stable, {self.canary_mean:.3g} canary")
        )
        return (
            f"{self.figure}: {self.low:+.3f} to {self.high:+.3f} {what} (limit {self.limit:g}; "
            f"n = {self.n_stable} stable, {self.n_canary} canary{means})"
        )


@dataclass(frozen=True)
class CanaryDecision:
    verdict: Verdict
    reason: str
    figures: tuple[FigureResult, ...]

    def metadata(self) -> dict[str, Any]:
        return {
            "canary_verdict": self.verdict,
            "canary_reason": self.reason,
            **{
                f"canary_{r.figure}": {
                    "status": r.status,
                    "low": r.low,
                    "high": r.high,
                    "limit": r.limit,
                    "n_stable": r.n_stable,
                    "n_canary": r.n_canary,
                    "stable_mean": r.stable_mean,
                    "canary_mean": r.canary_mean,
                    "threshold_s": r.threshold_s,
                }
                for r in self.figures
            },
        }


@dataclass
class CanaryState:
    """What a canary has seen so far: one confidence sequence per backend and figure (running sums only), the
    slow thresholds and, until they are set, the stable's warm-up latencies. Persisted as JSON between checks
    (``to_dict``/``from_dict``)."""

    stable_id: str
    canary_id: str
    started_at: float
    alpha: float
    sequences: dict[str, dict[str, SequenceState]] = field(default_factory=dict)
    thresholds: dict[str, float | None] = field(
        default_factory=dict
    )  # slow figure: seconds (None: warming up)
    warmup: dict[str, list[float]] = field(default_factory=dict)

    @classmethod
    def start(cls, stable_id: str, canary_id: str, policy: CanaryPolicy, now: float) -> CanaryState:
        alpha = policy.sequence_alpha()
        sequences = {arm: {f: SequenceState(alpha) for f in policy.figures()} for arm in ("stable", "canary")}
        slow = [f for f in policy.figures() if f in LATENCY_FIGURES]
        return cls(
            stable_id,
            canary_id,
            now,
            alpha,
            sequences,
            thresholds={f: policy.slow_request_s for f in slow},
            warmup={f: [] for f in slow},
        )

    def record(
        self,
        arm: Arm,
        policy: CanaryPolicy,
        *,
        failed: bool,
        latency_s: float | None = None,
        first_token_s: float | None = None,
        quality: float | None = None,
    ) -> None:
        """One request's outcome on ``arm``: a failed one counts only as a failure; a time only once its figure's
        threshold is set (the stable's warm-up requests set a derived one and count for nothing else); a score
        only where sampled."""
        seqs = self.sequences[arm]
        if "failed" in seqs:
            seqs["failed"].update(1.0 if failed else 0.0)
        if failed:
            return
        seconds = {"latency_s": latency_s, "first_token_s": first_token_s}
        for figure, threshold in self.thresholds.items():
            took = seconds[LATENCY_FIGURES[figure]]
            if took is None:
                continue
            if threshold is not None:
                seqs[figure].update(1.0 if took > threshold else 0.0)
            elif arm == "stable":
                self.warmup[figure].append(took)
                if len(self.warmup[figure]) >= policy.warmup_requests:
                    self.thresholds[figure] = policy.slow_factor * statistics.median(self.warmup[figure])
        if "quality" in seqs and quality is not None:
            seqs["quality"].update(quality)

    def record_quality(self, arm: Arm, score: float) -> None:
        """One sampled answer's score on ``arm`` (scored after its request was recorded, on the scorer's thread)."""
        if not 0 <= score <= 1:
            raise ValueError(f"a quality score must be in [0, 1], got {score}")
        if "quality" in self.sequences[arm]:
            self.sequences[arm]["quality"].update(score)

    def to_dict(self) -> dict[str, Any]:
        return {
            "stable_id": self.stable_id,
            "canary_id": self.canary_id,
            "started_at": self.started_at,
            "alpha": self.alpha,
            "sequences": {a: {f: s.to_dict() for f, s in fs.items()} for a, fs in self.sequences.items()},
            "thresholds": dict(self.thresholds),
            "warmup": {f: list(v) for f, v in self.warmup.items()},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CanaryState:
        sequences = {
            a: {f: SequenceState.from_dict(s) for f, s in fs.items()} for a, fs in data["sequences"].items()
        }
        return cls(
            data["stable_id"],
            data["canary_id"],
            data["started_at"],
            data["alpha"],
            sequences,
            dict(data["thresholds"]),
            {f: list(v) for f, v in data["warmup"].items()},
        )


def decide(state: CanaryState, policy: CanaryPolicy, now: float) -> CanaryDecision:
    """The canary's verdict now (module docstring): "roll back" on any figure shown worse, "promote" when every
    figure is shown no worse, "roll back" at the time limit with the figures still undecided, else "continue"."""
    results = []
    for figure in policy.figures():
        s, c = state.sequences["stable"][figure], state.sequences["canary"][figure]
        low, high = worse_bounds(figure, (s.low, s.high), (c.low, c.high))
        limit = policy.limit(figure)
        assert limit is not None  # figures() holds only the watched ones
        results.append(
            FigureResult(
                figure,
                s.n,
                c.n,
                s.mean,
                c.mean,
                float(low),
                float(high),
                limit,
                status(low, high, limit),
                state.thresholds.get(figure),
            )
        )
    level = f"{policy.confidence:.0%} confidence sequences, checked any number of times"
    worse = [r for r in results if r.status == "worse"]
    if worse:
        return CanaryDecision(
            "roll back", f"canary worse: {'; '.join(r.describe() for r in worse)} ({level})", tuple(results)
        )
    if all(r.status == "no worse" for r in results):
        return CanaryDecision(
            "promote",
            f"canary no worse on every figure: {'; '.join(r.describe() for r in results)} ({level})",
            tuple(results),
        )
    elapsed = now - state.started_at
    if elapsed >= policy.max_duration_s:
        open_ = "; ".join(r.describe() for r in results if r.status == "undecided")
        return CanaryDecision(
            "roll back",
            f"not enough traffic: undecided after {elapsed:.0f} s (max_duration_s {policy.max_duration_s:g}): {open_}",
            tuple(results),
        )
    return CanaryDecision("continue", f"undecided after {elapsed:.0f} s", tuple(results))
