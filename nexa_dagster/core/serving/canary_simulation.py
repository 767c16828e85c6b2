"""The canary's error rates under continuous monitoring, simulated: the canary's own rule (``canary.worse_bounds``,
``canary.shown``, which ``canary.status`` reads, at ``CanaryPolicy.sequence_alpha``) on thousands of simulated
streams of live requests, with each backend's bounds from the confidence sequence it runs
(``confidence_sequence.bounds``) or, beside it on the same streams, from a fixed-n (Wald) interval at the same level
recomputed at every look: what a dashboard re-checked every few seconds does. The second inflates its errors with every look; the first keeps them within
``1 - confidence`` however often it looks.

    python -m nexa_dagster.core.serving.canary_simulation --streams 1000 --requests 6000 --look-every 20

Each population is a stable backend and a canary drawn from realistic shapes: rare failures (1 % of requests),
heavy-tailed latency (log-normal, sigma 0.8: the slowest requests several times the median), a verifiable reward
that is 0 or 1 on a sampled quarter of requests. ``equal`` and the three ``at the limit`` populations are where a
decision would be an error (a roll-back of an equal canary; a promotion of one exactly at a limit, which is no
better than the limit allows); the others say how many requests a decision takes. The last line is one JSON
object of the figures.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, replace
from statistics import NormalDist

import numpy as np

from nexa_dagster.core.serving.canary import CanaryPolicy, shown, worse_bounds
from nexa_dagster.core.serving.confidence_sequence import bounds

WALD_MIN_N = 30  # the fixed-n interval is not used below 30 observations (the usual rule of thumb)
METHODS = ("sequence", "fixed", "fixed-once")
LATENCY_SIGMA = 0.8  # log-normal shape of a request's latency: p99 about 6x the median


@dataclass(frozen=True)
class Backend:
    """One backend's request outcomes: failure rate, median latency (s), mean reward of a sampled request."""

    failure_rate: float = 0.01
    median_latency_s: float = 0.8
    reward: float = 0.7
    scored_share: float = 0.25  # the share of requests whose answer gets a quality score

    def draw(
        self, rng: np.random.Generator, streams: int, n: int, slow_s: float
    ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per figure, (values, present) for n requests of each stream: a failed request has no time or score."""
        failed = rng.random((streams, n)) < self.failure_rate
        latency = self.median_latency_s * np.exp(LATENCY_SIGMA * rng.standard_normal((streams, n)))
        reward = (rng.random((streams, n)) < self.reward).astype(np.float64)
        scored = ~failed & (rng.random((streams, n)) < self.scored_share)
        return {
            "failed": (failed.astype(np.float64), np.ones_like(failed)),
            "slow": ((latency > slow_s).astype(np.float64), ~failed),
            "quality": (reward, scored),
        }

    def slow_share(self, slow_s: float) -> float:
        """The share of this backend's successful requests slower than ``slow_s``."""
        return 1 - NormalDist().cdf(math.log(slow_s / self.median_latency_s) / LATENCY_SIGMA)


STABLE = Backend()
DEFAULTS = CanaryPolicy()  # the "at the limit" populations sit exactly at its limits
# the slow threshold the canary derives from the stable's warm-up (slow_factor x its median), here its exact value
SLOW_S = DEFAULTS.slow_factor * STABLE.median_latency_s


def _median_for_slow_share(share: float) -> float:
    """The median latency at which ``share`` of requests are slower than ``SLOW_S`` (same log-normal shape)."""
    return SLOW_S / math.exp(LATENCY_SIGMA * NormalDist().inv_cdf(1 - share))


_AT_SLOW_LIMIT = _median_for_slow_share(STABLE.slow_share(SLOW_S) + DEFAULTS.max_slow_increase)
POPULATIONS: dict[str, tuple[Backend, str | None]] = {
    # name: (the canary, the figure on which a promotion is an error; None: a roll-back is the error)
    "equal": (STABLE, None),
    "failed at the limit (+2 points)": (
        replace(STABLE, failure_rate=0.01 + DEFAULTS.max_failure_increase),
        "failed",
    ),
    f"slow at the limit (+10 points, median {_AT_SLOW_LIMIT:.2f} s)": (
        replace(STABLE, median_latency_s=_AT_SLOW_LIMIT),
        "slow",
    ),
    "quality at the limit (-0.1)": (
        replace(STABLE, reward=STABLE.reward - DEFAULTS.max_quality_drop),
        "quality",
    ),
    "5xx on a fifth of requests": (replace(STABLE, failure_rate=0.2), "failed"),
    "3x slower": (replace(STABLE, median_latency_s=3 * STABLE.median_latency_s), "slow"),
    "worse answers (-0.3)": (replace(STABLE, reward=STABLE.reward - 0.3), "quality"),
}


def _arm_bounds(values: np.ndarray, present: np.ndarray, alpha: float, method: str) -> tuple:
    """Bounds after each of the arm's requests (per stream): the figure's observations compacted to the front, the
    method's interval after each, then read back at the arm's request positions (n = 0: [0, 1])."""
    order = np.argsort(~present, axis=1, kind="stable")
    x = np.take_along_axis(values, order, axis=1)
    if method == "sequence":
        low, high = bounds(x, alpha)
    else:
        t = np.arange(1, x.shape[1] + 1)
        mean = np.cumsum(x, axis=1) / t
        var = np.maximum(np.cumsum(x * x, axis=1) / t - mean**2, 0.0) * t / np.maximum(t - 1, 1)
        half = NormalDist().inv_cdf(1 - alpha / 2) * np.sqrt(var / t)
        low, high = np.clip(mean - half, 0, 1), np.clip(mean + half, 0, 1)
        low, high = np.where(t < WALD_MIN_N, 0.0, low), np.where(t < WALD_MIN_N, 1.0, high)
    count = np.cumsum(present, axis=1)  # observations after each request of the arm
    idx = np.maximum(count - 1, 0)
    low = np.where(count > 0, np.take_along_axis(low, idx, axis=1), 0.0)
    high = np.where(count > 0, np.take_along_axis(high, idx, axis=1), 1.0)
    return low, high


def simulate(
    canary: Backend,
    policy: CanaryPolicy,
    *,
    method: str,
    streams: int,
    requests: int,
    look_every: int,
    seed: int,
) -> dict[str, np.ndarray]:
    """Each stream's verdict ("promote", "roll back", or "" at the time limit) and the requests it took.
    ``method``: ``sequence`` (the canary's own), ``fixed`` (a Wald interval at the same level, re-checked at every
    look) or ``fixed-once`` (the same interval looked at once, at the time limit: the level it is built for)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, not {method!r}")
    rng = np.random.default_rng(seed)
    to_canary = rng.random((streams, requests)) < policy.share
    n_canary = np.cumsum(to_canary, axis=1)
    looks = np.arange(look_every, requests + 1, look_every) - 1
    if method == "fixed-once":
        looks = looks[-1:]
    arms = {
        "stable": STABLE.draw(rng, streams, requests, SLOW_S),
        "canary": canary.draw(rng, streams, requests, SLOW_S),
    }
    alpha = policy.sequence_alpha()
    per_look = {}
    for figure in policy.figures():
        limit = policy.limit(figure)
        got = {}
        for arm, n_arm in (("canary", n_canary[:, looks]), ("stable", looks + 1 - n_canary[:, looks])):
            low, high = _arm_bounds(*arms[arm][figure], alpha, method.removesuffix("-once"))
            pos = np.maximum(n_arm - 1, 0)
            got[arm] = (
                np.where(n_arm > 0, np.take_along_axis(low, pos, axis=1), 0.0),
                np.where(n_arm > 0, np.take_along_axis(high, pos, axis=1), 1.0),
            )
        low, high = worse_bounds(figure, got["stable"], got["canary"])
        per_look[figure] = shown(low, high, limit)
    worse = np.any([w for w, _ in per_look.values()], axis=0)
    fine = np.all([f for _, f in per_look.values()], axis=0)
    decided = worse | fine
    first = np.where(decided.any(axis=1), decided.argmax(axis=1), -1)
    rows = np.arange(streams)
    verdict = np.where(first < 0, "", np.where(worse[rows, first], "roll back", "promote"))
    return {"verdict": verdict, "requests": np.where(first < 0, requests, looks[first] + 1)}


def summarise(result: dict[str, np.ndarray]) -> dict[str, float]:
    verdict, spent = result["verdict"], result["requests"]
    decided = verdict != ""
    return {
        "promote": float(np.mean(verdict == "promote")),
        "roll_back": float(np.mean(verdict == "roll back")),
        "not_enough_traffic": float(np.mean(~decided)),
        "median_requests_to_decide": float(np.median(spent[decided])) if decided.any() else math.nan,
    }


def run(
    policy: CanaryPolicy,
    streams: int,
    requests: int,
    look_every: int,
    seed: int,
    methods: tuple[str, ...] = METHODS,
) -> dict[str, dict]:
    """Every population whose figure ``policy`` watches (and ``equal``) under each of ``methods``, on the same
    streams (the same seed per population, whichever methods are asked: a method's figures do not depend on the
    others'). A caller that checks the canary's own rule alone asks for ``("sequence",)``: the fixed-n intervals
    beside it are the comparison the command prints, two thirds of the arithmetic."""
    out: dict[str, dict] = {}
    for i, (name, (canary, figure)) in enumerate(POPULATIONS.items()):
        if figure is not None and figure not in policy.figures():
            continue
        out[name] = {
            method: summarise(
                simulate(
                    canary,
                    policy,
                    method=method,
                    streams=streams,
                    requests=requests,
                    look_every=look_every,
                    seed=seed + i,
                )
            )
            for method in methods
        }
    return out


def error_rate(name: str, figures: dict[str, float]) -> float:
    """The population's wrong decision: a roll-back of the equal canary, a promotion of one at or past a limit."""
    return figures["roll_back"] if POPULATIONS[name][1] is None else figures["promote"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=6000, help="the time limit, in requests")
    parser.add_argument("--look-every", type=int, default=20, help="requests between two checks")
    parser.add_argument("--share", type=float, default=0.1)
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--figures",
        default="failed,slow,quality",
        help="the watched figures, comma-separated (the others off)",
    )
    args = parser.parse_args(argv)
    watched = set(args.figures.split(","))
    keys = {"failed": "max_failure_increase", "slow": "max_slow_increase", "quality": "max_quality_drop"}
    limits: dict[str, float | None] = dict.fromkeys(keys.values())
    limits.update({keys[f]: getattr(CanaryPolicy(), keys[f]) for f in watched})
    policy = CanaryPolicy(share=args.share, confidence=args.confidence, **limits)
    results = run(policy, args.streams, args.requests, args.look_every, args.seed)
    print(
        f"{args.streams} streams of {args.requests} requests, checked every {args.look_every}; share {args.share}, "
        f"confidence {args.confidence}; error: roll-back of an equal canary, promotion of one at a limit"
    )
    print(
        f"{'population':34} {'method':9} {'promote':>8} {'roll back':>9} {'no traffic':>10} {'error':>7} {'median n':>9}"
    )
    for name, methods in results.items():
        for method, f in methods.items():
            print(
                f"{name:34} {method:9} {f['promote']:8.3f} {f['roll_back']:9.3f} {f['not_enough_traffic']:10.3f} "
                f"{error_rate(name, f):7.3f} {f['median_requests_to_decide']:9.0f}"
            )
    print(json.dumps({"args": vars(args), "alpha": 1 - args.confidence, "results": results}))


if __name__ == "__main__":
    main()
