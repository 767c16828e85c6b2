"""How often the promotion gate's eval-loss interval holds the true difference, on simulated eval sets.

A 95 % interval that covers the truth in 87 % of eval sets promotes on noise three times as often as it says. Per-
example loss differences are rarely normal: a few examples improve a lot while most move a little (skewed), or a
few move wildly either way (heavy-tailed), and example lengths are log-normal. Each population below draws many
eval sets of ``n`` examples at once (vectorised numpy), each example's summed loss difference ``delta * tokens``,
and the true difference is the population's token-weighted mean ``E[delta]`` (``delta`` is independent of the
length): the estimand of ``paired_loss_difference``, a ratio of sums. The intervals are computed by
``paired.ratio_bounds``, the code ``paired_loss_difference`` runs.

    .venv/bin/python -m nexa_dagster.core.evaluation.interval_coverage [--draws 20000] [--seed 20261126]

prints the table (population, n, coverage of each method) and, last, one JSON object.
``tests/unit/core/evaluation/test_paired.py`` asserts the default method's coverage on the populations it covers.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from nexa_dagster.core.evaluation.paired import DEFAULT_INTERVAL_METHOD, ratio_bounds

Draw = tuple[np.ndarray, np.ndarray]  # summed loss differences and token counts, shape (draws, n)


def _lognormal_tokens(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """Example lengths in scored tokens: log-normal, median 40, a few examples five times longer."""
    return np.maximum(1.0, np.round(rng.lognormal(np.log(40.0), 0.7, size=shape)))


def _mixture(share: float, gain: float, loss: float) -> Callable[[np.random.Generator, int, int], Draw]:
    """``share`` of the examples improve by ``gain`` nats per token, the rest get worse by ``loss``."""

    def draw(rng: np.random.Generator, draws: int, n: int) -> Draw:
        tokens = _lognormal_tokens(rng, (draws, n))
        improved = rng.random((draws, n)) < share
        delta = np.where(improved, -gain, loss) + rng.normal(0.0, 0.05, size=(draws, n))
        return delta * tokens, tokens

    return draw


def _symmetric(rng: np.random.Generator, draws: int, n: int) -> Draw:
    tokens = rng.integers(10, 80, size=(draws, n)).astype(np.float64)
    return (-0.1 + rng.normal(0.0, 0.4, size=(draws, n))) * tokens, tokens


def _student_t3(rng: np.random.Generator, draws: int, n: int) -> Draw:
    tokens = _lognormal_tokens(rng, (draws, n))
    return (-0.1 + 0.3 * rng.standard_t(3, size=(draws, n))) * tokens, tokens


def _lognormal(sigma: float) -> Callable[[np.random.Generator, int, int], Draw]:
    """Every example improves by a log-normal amount (a long tail of large gains) from a 0.1 nats/token loss."""

    def draw(rng: np.random.Generator, draws: int, n: int) -> Draw:
        tokens = _lognormal_tokens(rng, (draws, n))
        return (0.1 - 0.1 * rng.lognormal(0.0, sigma, size=(draws, n))) * tokens, tokens

    return draw


@dataclass(frozen=True)
class Population:
    name: str
    description: str
    truth: float  # the token-weighted mean difference, nats per token
    draw: Callable[[np.random.Generator, int, int], Draw]
    guaranteed: bool  # the default method is required (and tested) to cover >= 93 % at n >= 30


POPULATIONS = (
    Population(
        "symmetric",
        "delta ~ N(-0.1, 0.4), lengths uniform 10-79",
        -0.1,
        _symmetric,
        True,
    ),
    Population(
        "skewed_mixture",
        "10% improve by 1.5 nats/token, 90% 0.05 worse (+-0.05), log-normal lengths",
        0.1 * -1.5 + 0.9 * 0.05,
        _mixture(0.1, 1.5, 0.05),
        True,
    ),
    Population(
        "student_t3",
        "delta = -0.1 + 0.3 t(3 df), log-normal lengths",
        -0.1,
        _student_t3,
        True,
    ),
    Population(
        "rare_mixture",
        "10% improve by 0.5 nats/token, 90% 0.02 worse (+-0.05), log-normal lengths",
        0.1 * -0.5 + 0.9 * 0.02,
        _mixture(0.1, 0.5, 0.02),
        False,
    ),
    Population(
        "lognormal_0.5",
        "delta = 0.1 - 0.1 LogNormal(0, 0.5) (skewness 1.8), log-normal lengths",
        0.1 - 0.1 * float(np.exp(0.5**2 / 2)),
        _lognormal(0.5),
        False,
    ),
    Population(
        "lognormal_1",
        "delta = 0.1 - 0.1 LogNormal(0, 1) (skewness 6.2), log-normal lengths",
        0.1 - 0.1 * float(np.exp(0.5)),
        _lognormal(1.0),
        False,
    ),
)
METHODS = ("t", "skew_t")
SIZES = (30, 47, 100)


def population(name: str) -> Population:
    for p in POPULATIONS:
        if p.name == name:
            return p
    raise KeyError(f"no population {name!r}; known: {[p.name for p in POPULATIONS]}")


def coverage(
    pop: Population,
    n: int,
    method: str = DEFAULT_INTERVAL_METHOD,
    draws: int = 10_000,
    seed: int = 20261126,
    confidence: float = 0.95,
) -> float:
    """Share of ``draws`` simulated eval sets of ``n`` examples whose interval holds ``pop.truth`` (the same seed
    gives every method the same eval sets)."""
    differences, tokens = pop.draw(np.random.default_rng(seed), draws, n)
    _, low, high = ratio_bounds(differences, tokens, confidence, method)
    return float(np.mean((low <= pop.truth) & (pop.truth <= high)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=20261126)
    args = parser.parse_args()
    start = time.perf_counter()
    rows = []
    print(f"coverage of the 95% interval, {args.draws} simulated eval sets per cell (seed {args.seed})")
    print(f"{'population':<16}{'n':>5}" + "".join(f"{m:>10}" for m in METHODS) + "  required >= 0.93")
    for pop in POPULATIONS:
        for n in SIZES:
            cells = {m: coverage(pop, n, m, args.draws, args.seed) for m in METHODS}
            rows.append({"population": pop.name, "n": n, **cells, "guaranteed": pop.guaranteed})
            print(
                f"{pop.name:<16}{n:>5}"
                + "".join(f"{cells[m]:>10.3f}" for m in METHODS)
                + ("  yes" if pop.guaranteed else "  no (a limit, see docs/stages/evaluation.md)")
            )
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            {
                "bench": "interval_coverage",
                "draws": args.draws,
                "seed": args.seed,
                "default_method": DEFAULT_INTERVAL_METHOD,
                "rows": rows,
                "seconds": round(seconds, 2),
                "numpy": np.__version__,
                "python": platform.python_version(),
            }
        )
    )


if __name__ == "__main__":
    main()
