"""A confidence sequence for the mean of observations in [0, 1]: an interval after every observation that covers
the mean at EVERY time at once with probability ``1 - alpha``, so a canary can be checked after each request.

Why not an interval recomputed at each look: a 95 % interval checked after every request misses the true mean at
SOME look far more often than 5 % (the more looks, the more often: ``canary_simulation`` measures it beside this
one on the same streams). A confidence sequence is valid at any stopping time, however the looks are chosen.

Which one: the predictable plug-in empirical-Bernstein confidence sequence of Waudby-Smith & Ramdas (2024,
"Estimating means of bounded random variables by betting", JRSS B 86(1), Theorem 2; a refinement of Howard et al.
2021's empirical-Bernstein boundaries). Why this one: it needs only that observations lie in [0, 1] (a failure is
0/1, a latency is clipped to a cap, a reward or judge score is in [0, 1]) with no distributional assumption (heavy
tails and rare events included), and its width follows the observed variance, so a failure rate of 1 % narrows
about ten times faster than a bound for the worst-case variance 1/4 would. Nonasymptotic: no normal
approximation anywhere. Its update is a handful of running sums, so the state a canary persists is small
(``to_dict``), and the vectorised form (``bounds``) is the very arithmetic ``SequenceState.update`` does, over
thousands of simulated streams at once.

With ``mu_t = (1/2 + sum x) / (t + 1)``, ``var_t = (1/4 + sum (x_i - mu_i)^2) / (t + 1)``, the bet
``lambda_t = min(sqrt(2 log(2/alpha) / (var_{t-1} t log(1 + t))), 1/2)``, ``v_t = 4 (x_t - mu_{t-1})^2`` and
``psi(l) = (-log(1 - l) - l) / 4``, the interval after t observations is

    sum(lambda x) / sum(lambda)  +-  (log(2/alpha) + sum(v psi(lambda))) / sum(lambda)

clipped to [0, 1]. Not intersected with the earlier intervals, which the paper allows for a constant mean: live
traffic's figures drift with the machine's load (a slow share measured under a busy minute is not the next
minute's), and the running intersection of intervals whose targets moved crosses itself (its low end above its high
end: seen in the serving bench). Without it, each interval covers the average of the conditional means so far;
with a constant mean, the event "some interval missed" is the same either way, so the guarantee is unchanged.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

BET_CAP = 0.5  # the paper's suggested truncation of the bet (1/2 or 3/4): 1/2 keeps psi's Taylor error small


def _check(x: np.ndarray) -> None:
    if not np.all((x >= 0) & (x <= 1)):
        bad = np.flatnonzero(~((x >= 0) & (x <= 1)).ravel())[0]
        raise ValueError(
            f"observation {bad} is {float(x.ravel()[bad])!r}: a confidence sequence here needs values in [0, 1]"
        )


def bounds(x: np.ndarray, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) after each observation along the last axis of ``x`` (values in [0, 1]), two-sided level
    ``1 - alpha`` uniformly over time. Any leading axes are independent streams (a simulation's thousands)."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    x = np.asarray(x, dtype=np.float64)
    _check(x)
    t = np.arange(1, x.shape[-1] + 1, dtype=np.float64)
    mu = (0.5 + np.cumsum(x, axis=-1)) / (t + 1)
    var = (0.25 + np.cumsum((x - mu) ** 2, axis=-1)) / (t + 1)
    lead = x.shape[:-1] + (1,)
    mu_prev = np.concatenate([np.full(lead, 0.5), mu[..., :-1]], axis=-1)
    var_prev = np.concatenate([np.full(lead, 0.25), var[..., :-1]], axis=-1)
    log_term = math.log(2 / alpha)
    lam = np.minimum(np.sqrt(2 * log_term / (var_prev * t * np.log1p(t))), BET_CAP)
    psi = (-np.log1p(-lam) - lam) / 4
    s_lam = np.cumsum(lam, axis=-1)
    center = np.cumsum(lam * x, axis=-1) / s_lam
    width = (log_term + np.cumsum(4 * (x - mu_prev) ** 2 * psi, axis=-1)) / s_lam
    return np.clip(center - width, 0.0, 1.0), np.clip(center + width, 0.0, 1.0)


@dataclass
class SequenceState:
    """The running sums of one stream's confidence sequence: updated one observation at a time, persisted as a
    dict (a canary's state file), the same figures as ``bounds`` over the whole stream."""

    alpha: float
    n: int = 0
    total: float = 0.0  # sum x
    squares: float = 0.0  # sum (x_i - mu_i)^2
    bets: float = 0.0  # sum lambda
    weighted: float = 0.0  # sum lambda x
    penalty: float = 0.0  # sum v psi(lambda)

    def update(self, x: float) -> None:
        if not 0 <= x <= 1:
            raise ValueError(
                f"observation {self.n} is {x!r}: a confidence sequence here needs values in [0, 1]"
            )
        t = self.n + 1
        mu_prev, var_prev = (0.5 + self.total) / t, (0.25 + self.squares) / t
        log_term = math.log(2 / self.alpha)
        lam = min(math.sqrt(2 * log_term / (var_prev * t * math.log1p(t))), BET_CAP)
        self.n, self.total = t, self.total + x
        self.squares += (x - (0.5 + self.total) / (t + 1)) ** 2
        self.bets += lam
        self.weighted += lam * x
        self.penalty += 4 * (x - mu_prev) ** 2 * (-math.log1p(-lam) - lam) / 4

    def _interval(self) -> tuple[float, float]:
        """(low, high) from the sums: [0, 1] before any observation."""
        if self.n == 0:
            return 0.0, 1.0
        center, width = self.weighted / self.bets, (math.log(2 / self.alpha) + self.penalty) / self.bets
        return min(max(center - width, 0.0), 1.0), min(max(center + width, 0.0), 1.0)

    @property
    def low(self) -> float:
        return self._interval()[0]

    @property
    def high(self) -> float:
        return self._interval()[1]

    @property
    def mean(self) -> float | None:
        return self.total / self.n if self.n else None

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> SequenceState:
        return cls(**data)
