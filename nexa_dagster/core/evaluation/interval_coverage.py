"""How often the promotion gate's eval-loss interval holds the true difference, and how often the whole gate
(interval, minimum n and the guards of ``core/evaluation/guards.py``) promotes a truly worse model, on simulated
eval sets; and the same on a lab's own eval set's per-example differences.

A 95 % interval that covers the truth in 87 % of eval sets promotes on noise three times as often as it says. Per-
example loss differences are rarely normal: a few examples improve a lot while most move a little (skewed), or a
few move wildly either way (heavy-tailed), and example lengths are log-normal. Each population below draws many
eval sets of ``n`` examples at once (vectorised numpy), each example's summed loss difference ``delta * tokens``,
and the true difference is the population's token-weighted mean ``E[delta]`` (``delta`` is independent of the
length): the estimand of ``paired_loss_difference``, a ratio of sums. The intervals are computed by
``paired.ratio_bounds``, the code ``paired_loss_difference`` runs.

    .venv/bin/python -m nexa_dagster.core.evaluation.interval_coverage [--draws 20000] [--seed 20261126]

prints the coverage table (population, n, coverage of each method), then the false-promotion table of the gate
with ``configs/promotion.yaml`` on the populations of issue 40 (``GATE_POPULATIONS``: per-token losses gamma,
token counts log-normal, the candidate truly worse by +0.01 nats per token, token-weighted), and, last, one JSON
object.

    .venv/bin/python -m nexa_dagster.core.evaluation.interval_coverage --differences diffs.csv \
        [--column difference] [--weights tokens] [--worse-by 0.01]

runs the gate on eval sets resampled from a lab's own per-example differences (candidate - production, nats per
token; ``--weights`` the column of token counts, else every example weighs the same), shifted so that the
candidate is truly worse by ``--worse-by``: how often it would promote a model that much worse, at n = 30, 47,
100 and the file's own n; and how often the interval covers the truth. A CSV or a JSONL file (one object a line).

    .venv/bin/python -m nexa_dagster.core.evaluation.interval_coverage --sizes

prints how big an eval set a lab needs for the regressions it wants to catch (``size_table``).
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

from nexa_dagster.core.evaluation.guards import regressed_bounds, required_examples, skew_refuses, skewness
from nexa_dagster.core.evaluation.paired import DEFAULT_INTERVAL_METHOD, ratio_bounds
from nexa_dagster.core.evaluation.promotion import PromotionPolicy, load_policy

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


def _gamma_noise(
    rng: np.random.Generator, tokens: np.ndarray, shape: float = 1.0, scale: float = 0.1
) -> np.ndarray:
    """Each example's summed per-token noise: per-token loss differences gamma (skewed, as token losses are),
    centred; a sum of ``tokens`` gammas is one gamma of ``shape * tokens``."""
    return rng.gamma(shape * tokens, scale) - shape * scale * tokens


def _effects(effect: Callable[[np.random.Generator, tuple[int, int]], np.ndarray]) -> Callable[..., Draw]:
    """A population whose example ``i`` changes by ``effect`` nats per token on each of its log-normal number of
    tokens, plus gamma per-token noise: the summed difference and the tokens."""

    def draw(rng: np.random.Generator, draws: int, n: int) -> Draw:
        tokens = _lognormal_tokens(rng, (draws, n))
        return effect(rng, (draws, n)) * tokens + _gamma_noise(rng, tokens), tokens

    return draw


def _two_point(
    share: float, rare: float, common: float
) -> Callable[[np.random.Generator, tuple[int, int]], np.ndarray]:
    """``share`` of the examples change by ``rare`` nats per token, the rest by ``common`` (each +- 0.05)."""

    def effect(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
        return np.where(rng.random(shape) < share, rare, common) + rng.normal(0.0, 0.05, size=shape)

    return effect


WORSE_BY = 0.01  # issue 40: every gate population's candidate is truly worse by this, nats per token
GATE_POPULATIONS = (
    Population(
        "normal_worse",
        "per-example change N(+0.01, 0.3) nats/token",
        WORSE_BY,
        _effects(lambda rng, shape: WORSE_BY + rng.normal(0.0, 0.3, size=shape)),
        True,
    ),
    Population(
        "student_t2.5_worse",
        "per-example change +0.01 + 0.3 t(2.5 df)",
        WORSE_BY,
        _effects(lambda rng, shape: WORSE_BY + 0.3 * rng.standard_t(2.5, size=shape)),
        True,
    ),
    Population(
        "rare_regressions",
        "10% of examples 1.0 nats/token worse, 90% 0.1 better (mean +0.01)",
        0.1 * 1.0 + 0.9 * -0.1,
        _effects(_two_point(0.1, 1.0, -0.1)),
        True,
    ),
    Population(
        "rarer_regressions",
        "5% of examples 2.0 nats/token worse, 95% 0.0947 better (mean +0.01): rarer than max_regressed_share",
        0.05 * 2.0 + 0.95 * -(0.09 / 0.95),
        _effects(_two_point(0.05, 2.0, -(0.09 / 0.95))),
        False,
    ),
    Population(
        "rare_gains",
        "10% of examples 1.0 nats/token better, 90% 0.1 worse (mean -0.01): the mirror, truly better",
        0.1 * -1.0 + 0.9 * 0.1,
        _effects(_two_point(0.1, -1.0, 0.1)),
        False,
    ),
    Population(
        "broad_gain",
        "per-example change N(-0.1, 0.3) nats/token: a real gain (how often the gate promotes it)",
        -0.1,
        _effects(lambda rng, shape: -0.1 + rng.normal(0.0, 0.3, size=shape)),
        False,
    ),
)
GATE_SIZES = (30, 47, 100, 200)


def promotes(
    differences: np.ndarray, tokens: np.ndarray, policy: PromotionPolicy | None = None
) -> np.ndarray:
    """Whether the eval_loss gate with ``policy`` (default ``configs/promotion.yaml``) promotes, per simulated eval
    set (rows of summed loss differences and token counts): the interval's high end below -margin on at least
    ``min_examples`` examples, and no guard against it (``guards.skew_refuses``, ``guards.regressed_bounds``),
    the code ``decide`` and ``paired_guards`` run. Slices are not simulated (the populations have none)."""
    policy = policy or load_policy()
    n = differences.shape[-1]
    _, _, high = ratio_bounds(differences, tokens, policy.confidence, policy.interval_method)
    passed = (high < -policy.margin) & (n >= policy.min_examples)
    g = policy.guards
    if g.skew_rule:
        passed &= ~skew_refuses(skewness(differences / tokens, tokens), n)
    if g.max_regressed_share is not None:
        regressed = np.sum(differences / tokens > g.regression_margin, axis=-1)
        passed &= regressed_bounds(regressed, n, policy.confidence)[1] < g.max_regressed_share
    return passed


def gate_rates(pop: Population, n: int, draws: int = 10_000, seed: int = 20261126) -> dict[str, float]:
    """The share of ``draws`` simulated eval sets of ``n`` examples on which the gate promotes, with the mean rule
    alone (``interval``) and with the guards (``gate``), and the interval's coverage of ``pop.truth``."""
    policy = load_policy()
    differences, tokens = pop.draw(np.random.default_rng(seed), draws, n)
    _, low, high = ratio_bounds(differences, tokens, policy.confidence, policy.interval_method)
    return {
        "interval_alone": float(np.mean(high < -policy.margin)),
        "gate": float(np.mean(promotes(differences, tokens, policy))),
        "coverage": float(np.mean((low <= pop.truth) & (pop.truth <= high))),
    }


def size_table(
    shares: tuple[float, ...] = (0.20, 0.10, 0.05, 0.02), draws: int = 4000, seed: int = 20261126
) -> list[dict]:
    """How big an eval set a lab needs for the regressions it wants to catch: for each share ``p`` (the gate's
    ``max_regressed_share`` set to it), the smallest n on which a candidate with no regressed example can pass
    (exact), and at that n and twice it, the gate's promotion rate on two simulated candidates: one truly worse
    (``p`` of examples 1.0 nats/token worse, the rest better, mean +0.01: false promotions) and one truly better
    (``p / 4`` of examples 1.0 worse, the rest 0.1 better: how often the gate lets a good model through)."""
    base = load_policy()
    rows = []
    for p in shares:
        policy = base.model_copy(update={"guards": base.guards.model_copy(update={"max_regressed_share": p})})
        n_min = required_examples(p, policy.confidence)
        worse = _effects(_two_point(p, 1.0, (WORSE_BY - p) / (1 - p)))
        better = _effects(_two_point(p / 4, 1.0, -0.1))
        for n in (n_min, 2 * n_min):
            rng = np.random.default_rng(seed)
            rows.append(
                {
                    "max_regressed_share": p,
                    "n": n,
                    "smallest_n": n_min,
                    "false_promotions": float(np.mean(promotes(*worse(rng, draws, n), policy))),
                    "good_promoted": float(np.mean(promotes(*better(rng, draws, n), policy))),
                }
            )
    return rows


def resampled(differences: np.ndarray, weights: np.ndarray, worse_by: float) -> Population:
    """A population of a lab's own per-example differences (nats per token) and weights, shifted so that the
    token-weighted mean is ``worse_by``: eval sets are drawn from it with replacement, examples whole."""
    shifted = differences - float(np.sum(differences * weights) / np.sum(weights)) + worse_by

    def draw(rng: np.random.Generator, draws: int, n: int) -> Draw:
        idx = rng.integers(0, len(shifted), size=(draws, n))
        return shifted[idx] * weights[idx], weights[idx]

    return Population(
        "own_eval_set", f"{len(shifted)} examples, shifted to {worse_by:+g}", worse_by, draw, False
    )


def _read_differences(path: str, column: str, weights: str | None) -> tuple[np.ndarray, np.ndarray]:
    import pandas as pd

    frame = pd.read_json(path, lines=True) if path.endswith((".jsonl", ".json")) else pd.read_csv(path)
    for name in (column, weights):
        if name is not None and name not in frame.columns:
            raise SystemExit(f"{path}: no column {name!r} (columns are {list(frame.columns)})")
    d = frame[column].to_numpy(np.float64)
    w = frame[weights].to_numpy(np.float64) if weights else np.ones_like(d)
    if not (np.isfinite(d).all() and (w > 0).all()):
        raise SystemExit(f"{path}: {column} must be finite and {weights} positive on every row")
    return d, w


def _gate_table(pops: tuple[Population, ...], sizes: tuple[int, ...], draws: int, seed: int) -> list[dict]:
    rows = []
    print(f"\nthe gate (configs/promotion.yaml) on {draws} simulated eval sets per cell: share promoted")
    print(f"{'population':<20}{'n':>5}{'interval alone':>16}{'gate':>8}{'coverage':>10}")
    for pop in pops:
        for n in sizes:
            cells = gate_rates(pop, n, draws, seed)
            rows.append({"population": pop.name, "n": n, "truth": pop.truth, **cells})
            print(
                f"{pop.name:<20}{n:>5}{cells['interval_alone']:>16.4f}{cells['gate']:>8.4f}{cells['coverage']:>10.3f}"
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=20261126)
    parser.add_argument("--differences", help="a CSV/JSONL of a lab's own per-example differences")
    parser.add_argument("--column", default="difference")
    parser.add_argument("--weights", default=None, help="the column of token counts (weights)")
    parser.add_argument("--worse-by", type=float, default=WORSE_BY)
    parser.add_argument(
        "--sizes", action="store_true", help="the eval-set size table (docs/stages/evaluation.md)"
    )
    args = parser.parse_args()
    start = time.perf_counter()
    if args.sizes:
        rows = size_table(draws=args.draws, seed=args.seed)
        print(
            f"{'max_regressed_share':>20}{'smallest n':>12}{'n':>6}{'false promotions':>18}{'good promoted':>15}"
        )
        for r in rows:
            print(
                f"{r['max_regressed_share']:>20.2f}{r['smallest_n']:>12}{r['n']:>6}"
                f"{r['false_promotions']:>18.4f}{r['good_promoted']:>15.3f}"
            )
        result = {"sizes": rows}
    elif args.differences:
        d, w = _read_differences(args.differences, args.column, args.weights)
        sizes = tuple(sorted({30, 47, 100, len(d)}))
        result = {"gate": _gate_table((resampled(d, w, args.worse_by),), sizes, args.draws, args.seed)}
    else:
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
        result = {"rows": rows, "gate": _gate_table(GATE_POPULATIONS, GATE_SIZES, args.draws, args.seed)}
    print(
        json.dumps(
            {
                "bench": "interval_coverage",
                "draws": args.draws,
                "seed": args.seed,
                "default_method": DEFAULT_INTERVAL_METHOD,
                **result,
                "seconds": round(time.perf_counter() - start, 2),
                "numpy": np.__version__,
                "python": platform.python_version(),
            }
        )
    )


if __name__ == "__main__":
    main()
