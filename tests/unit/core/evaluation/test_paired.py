"""The paired statistics of the promotion gate (core/evaluation/paired.py): pairing, the bootstrap interval, and the judge's
order-consistent win rate. Pure numerics on constructed examples whose answer is known."""

import math

import numpy as np
import pytest

from nexa_dagster.core.evaluation.interval_coverage import POPULATIONS, coverage, population
from nexa_dagster.core.evaluation.paired import (
    DEFAULT_INTERVAL_METHOD,
    Interval,
    LengthControlled,
    PairedLoss,
    bootstrap_mean_loss,
    length_controlled_win_rate,
    mean_loss,
    mean_loss_interval,
    order_consistent_win_rate,
    paired_loss_difference,
    pointwise_win_rate,
    ratio_bounds,
    ratio_interval,
    wilson_interval,
)


def _eval_set(n: int = 40, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Examples of very unequal difficulty (per-token loss 1..8) and length: the spread pairing removes."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(5, 60, size=n)
    per_token = rng.uniform(1.0, 8.0, size=n)
    return per_token * tokens, tokens


def test_a_small_consistent_improvement_is_detected_because_the_examples_are_paired() -> None:
    prod, tokens = _eval_set()
    cand = prod - 0.05 * tokens * np.random.default_rng(2).uniform(0.5, 1.5, size=len(tokens))
    paired = paired_loss_difference(cand, prod, tokens)
    assert paired.difference.high < 0 and paired.difference.excludes(0.0)
    assert paired.difference.estimate == pytest.approx(paired.candidate - paired.production)
    # unpaired, the same two models are indistinguishable: each one's own interval is far wider than the gap
    alone = bootstrap_mean_loss(prod, tokens)
    assert alone.high - alone.low > 10 * abs(paired.difference.estimate)
    # and the worse direction is detected just as well
    worse = paired_loss_difference(prod, cand, tokens)
    assert worse.difference.low > 0 and worse.difference.estimate == pytest.approx(
        -paired.difference.estimate
    )


def test_no_difference_gives_an_interval_that_contains_zero() -> None:
    prod, tokens = _eval_set()
    noise = (
        np.where(np.arange(len(tokens)) % 2 == 0, 0.3, -0.3) * tokens
    )  # +-0.3 per token, mean 0 by example
    paired = paired_loss_difference(prod + noise, prod, tokens)
    assert paired.difference.low < 0 < paired.difference.high
    assert paired.examples == len(tokens) and paired.tokens == int(tokens.sum())


def test_bad_paired_input_is_a_clear_error() -> None:
    prod, tokens = _eval_set(5)
    with pytest.raises(ValueError, match="same examples"):
        paired_loss_difference(prod[:4], prod, tokens)
    with pytest.raises(ValueError, match="example 2 has no scored tokens"):
        paired_loss_difference(prod, prod, np.array([3, 3, 0, 3, 3]))
    with pytest.raises(ValueError, match="non-finite"):
        paired_loss_difference(np.array([1.0, np.nan, 1, 1, 1]), prod, tokens)


def test_win_rate_counts_only_verdicts_that_survive_swapping_the_answers() -> None:
    # a judge that always prefers whatever it reads first is pure position bias: nothing is learnt
    biased = order_consistent_win_rate(["candidate"] * 10, ["production"] * 10)
    assert (biased.wins, biased.losses, biased.inconsistent) == (0, 0, 10)
    assert (biased.rate.estimate, biased.rate.low, biased.rate.high) == (0.5, 0.0, 1.0)
    # 18 consistent wins, 2 consistent losses, 5 flips and 2 unreadable verdicts
    first = ["candidate"] * 18 + ["production"] * 2 + ["candidate"] * 5 + [None, "candidate"]
    second = ["candidate"] * 18 + ["production"] * 2 + ["production"] * 5 + ["candidate", None]
    rate = order_consistent_win_rate(first, second)
    assert (rate.wins, rate.losses, rate.inconsistent, rate.unreadable) == (18, 2, 5, 2)
    assert rate.rate.estimate == pytest.approx(0.9) and rate.rate.low > 0.5
    # the flips are counted apart from the unreadable replies: 20 of the 25 readable prompts survived the swap
    assert rate.order_consistency == pytest.approx(20 / 25) and rate.prompts == 27
    # the headline rate counts a flip as a tie (MT-Bench, Arena-Hard): (18 + 5 / 2) / 25
    assert rate.headline == pytest.approx(20.5 / 25)
    assert rate.to_json()["order_consistency"] == pytest.approx(0.8)
    assert biased.order_consistency == 0.0 and biased.headline == 0.5
    lose = order_consistent_win_rate(second[:20], ["production"] * 18 + ["candidate"] * 2)
    assert lose.rate.estimate == 0.5 and lose.inconsistent == 20


def test_pointwise_verdicts_take_the_higher_score_with_ties_and_unreadable_scores_counted_apart() -> None:
    """Each answer scored alone (a 1-5 expected score): no answer order, so nothing can flip; a difference within
    ``tie_epsilon`` is a tie, a missing score unreadable; neither counts in the n of the conditional rate."""
    candidate = [4.2, 3.9, 2.0, 3.00, 3.0, None, 4.5] + [4.0] * 20
    production = [3.1, 3.0, 2.5, 3.04, 3.0, 3.0, None] + [3.0] * 20
    w = pointwise_win_rate(candidate, production, tie_epsilon=0.05)
    assert (w.wins, w.losses, w.ties, w.unreadable, w.inconsistent) == (22, 1, 2, 2, 0)
    assert w.consistent == 23 and w.prompts == 27 and w.mode == "pointwise" and w.order_consistency is None
    assert w.rate.estimate == pytest.approx(22 / 23) and w.rate.low > 0.7
    assert w.headline == pytest.approx((22 + 1) / 25) and "pointwise" in w.method
    # with no epsilon, 3.00 vs 3.04 is a loss: only exact equality ties
    assert pointwise_win_rate(candidate, production).ties == 1
    with pytest.raises(ValueError, match="same prompts"):
        pointwise_win_rate([1.0], [1.0, 2.0])


def test_wilson_interval_matches_the_textbook_values() -> None:
    low, high = wilson_interval(8, 10)  # Wilson 95%: 0.4902 .. 0.9433
    assert (round(low, 4), round(high, 4)) == (0.4902, 0.9433)
    assert wilson_interval(0, 10)[0] == pytest.approx(0.0) and wilson_interval(10, 10)[1] == pytest.approx(
        1.0
    )
    assert wilson_interval(0, 0) == (0.0, 1.0)


def _paired_draw(rng: np.random.Generator, n: int, true_difference: float) -> tuple[np.ndarray, ...]:
    """One eval set of ``n`` examples of unequal length and difficulty, production's and candidate's summed NLL
    per example, the candidate better by ``true_difference`` nats per token in expectation (noise per example)."""
    tokens = rng.integers(10, 80, size=n)
    production = rng.uniform(2.0, 7.0, size=n) * tokens
    candidate = production + (true_difference + rng.normal(0.0, 0.4, size=n)) * tokens
    return candidate, production, tokens


def _coverage(n: int, method: str, draws: int = 1000, true_difference: float = -0.1) -> float:
    rng = np.random.default_rng(20261125)
    covered = 0
    for _ in range(draws):
        candidate, production, tokens = _paired_draw(rng, n, true_difference)
        d = paired_loss_difference(candidate, production, tokens, method=method, resamples=400).difference
        covered += d.low <= true_difference <= d.high
    return covered / draws


def test_the_gate_interval_covers_the_true_difference_95_times_in_100_at_n_30() -> None:
    """The gate's interval (the default, skew-corrected t) on 1,000 simulated eval sets of 30 paired examples with a
    known difference, each through ``paired_loss_difference``: it covers the truth in 93-97 % of them (a 95 %
    interval, Monte-Carlo error about 0.7 %)."""
    assert 0.93 <= _coverage(30, "skew_t") <= 0.97


@pytest.mark.parametrize("name", [p.name for p in POPULATIONS if p.guaranteed])
@pytest.mark.parametrize("n", [30, 47, 100])
def test_the_default_interval_holds_93_percent_on_skewed_and_heavy_tailed_eval_sets(
    name: str, n: int
) -> None:
    """10,000 simulated eval sets per cell (binomial error about 0.25 %), log-normal example lengths: a skewed
    mixture (10 % of examples improve a lot, the rest get slightly worse), Student's t with 3 df and a symmetric
    population. Measured at 20,000 draws: skew_t 0.935-0.972 (docs/stages/evaluation.md)."""
    assert coverage(population(name), n) >= 0.93


def test_the_plain_t_interval_misses_the_long_tail_of_a_skewed_population() -> None:
    """The failing case the default method answers: on the skewed mixture the symmetric t-interval covers the truth
    in about 82 % of eval sets at n = 30 (86 % at 47, 90 % at 100) where it claims 95 %; the skew-corrected one, on
    the same eval sets, holds."""
    skewed = population("skewed_mixture")
    for n in (30, 47, 100):
        assert coverage(skewed, n, "t") < 0.91 < 0.93 <= coverage(skewed, n, "skew_t")


def test_the_vectorised_bounds_are_what_paired_loss_difference_reports() -> None:
    """The coverage simulation computes many eval sets at once with ``ratio_bounds``: the same numbers, eval set by
    eval set, as the gate's ``paired_loss_difference``; and the skew-corrected interval reaches further on the side
    of the long tail (the improvements), never narrower than the plain t on either side."""
    differences, tokens = population("skewed_mixture").draw(np.random.default_rng(5), 50, 30)
    _, low, high = ratio_bounds(differences, tokens, 0.95, "skew_t")
    _, t_low, t_high = ratio_bounds(differences, tokens, 0.95, "t")
    for i in range(50):
        production = np.full(30, 100.0) * tokens[i]
        d = paired_loss_difference(production + differences[i], production, tokens[i]).difference
        assert (d.low, d.high) == pytest.approx((low[i], high[i]))
    assert (low <= t_low).all() and (high >= t_high).all()
    # the improvements are the long tail: Hall's bound reaches further below; above, the plain t's bound is kept
    assert np.mean(t_low - low) > 0.5 * np.mean(t_high - t_low) and np.mean(high - t_high) < 1e-9


def test_a_percentile_bootstrap_of_few_examples_understates_the_uncertainty() -> None:
    """Why the gate no longer uses it: at n = 5 the percentile bootstrap covers the truth far less often than it
    says, while the t-interval stays honest; with one example the bootstrap's interval has zero width."""
    assert _coverage(5, "bootstrap", draws=400) < 0.88 < 0.92 < _coverage(5, "t", draws=400)
    candidate, production, tokens = _paired_draw(np.random.default_rng(3), 1, -0.1)
    one = paired_loss_difference(candidate, production, tokens, method="bootstrap", resamples=200).difference
    assert one.low == one.high  # the zero-width "interval" the gate once promoted on
    t_one = paired_loss_difference(candidate, production, tokens).difference
    assert t_one.low == -np.inf and t_one.high == np.inf  # no spread can be estimated from one example


def test_length_controlled_win_rate_removes_a_win_bought_with_length() -> None:
    """A judge that prefers longer answers (P = sigmoid(2.5 tanh(d / 100)), d the length difference) and two models
    of the same quality, the candidate ~80 characters longer: the raw win rate is ~0.72, the length-controlled one
    ~0.5 (five simulated eval sets of 300 verdicts each)."""
    for seed in range(5):
        rng = np.random.default_rng(seed)
        d = rng.normal(80, 100, 300)
        judge_prefers_candidate = rng.random(300) < 1 / (1 + np.exp(-2.5 * np.tanh(d / 100)))
        verdicts = ["candidate" if x else "production" for x in judge_prefers_candidate]
        raw = order_consistent_win_rate(verdicts, verdicts)
        lc = length_controlled_win_rate(verdicts, verdicts, (300 + d).astype(int), np.full(300, 300))
        assert raw.rate.low > 0.6 and lc.verdicts == 300
        assert abs(lc.win_rate - 0.5) < 0.06 and lc.length_coefficient > 1.5 and lc.mean_length_change > 60


def test_length_controlled_win_rate_keeps_a_win_that_does_not_depend_on_length() -> None:
    rng = np.random.default_rng(8)
    cand_len, prod_len = rng.integers(100, 400, size=60), rng.integers(100, 400, size=60)
    verdicts = ["candidate" if i % 4 else "production" for i in range(60)]  # 75% wins, whatever the lengths
    lc = length_controlled_win_rate(verdicts, verdicts, cand_len, prod_len)
    assert abs(lc.win_rate - 0.75) < 0.06
    # an order-inconsistent verdict is not counted
    flipped = ["production" if i == 1 else v for i, v in enumerate(verdicts)]
    assert length_controlled_win_rate(verdicts, flipped, cand_len, prod_len).verdicts == 59


def test_one_models_mean_loss_interval_is_the_ratio_interval_or_its_percentile_bootstrap() -> None:
    """``mean_loss_interval`` (one model's token-weighted mean loss, as the eval report shows it): the project's
    interval by default (95 %, ``DEFAULT_INTERVAL_METHOD``), the method asked for, or a percentile bootstrap of
    2,000 resamples from seed 0 unless told otherwise, each written out here; too few resamples and a confidence
    outside (0, 1) are refused. An interval holds its own bounds."""
    rng = np.random.default_rng(5)
    tokens = rng.integers(10, 60, 40).astype(float)
    nll = tokens * rng.gamma(2.0, 1.5, 40)
    assert mean_loss_interval(nll, tokens) == ratio_interval(nll, tokens, 0.95, DEFAULT_INTERVAL_METHOD)
    assert mean_loss_interval(nll, tokens, 0.9, "t") == ratio_interval(nll, tokens, 0.9, "t")
    assert ratio_interval(nll, tokens, 0.9, "t") == Interval(
        *map(float, ratio_bounds(nll, tokens, 0.9, "t")), 0.9
    )

    def percentile(resamples: int, seed: int, confidence: float) -> Interval:
        idx = np.random.default_rng(seed).integers(0, 40, size=(resamples, 40))
        stats = nll[idx].sum(axis=1) / tokens[idx].sum(axis=1)
        alpha = (1 - confidence) / 2
        low, high = np.quantile(stats, [alpha, 1 - alpha])
        return Interval(float(nll.sum() / tokens.sum()), float(low), float(high), confidence)

    told = mean_loss_interval(nll, tokens, 0.9, "bootstrap", resamples=500, seed=3)
    assert told == pytest.approx(percentile(500, 3, 0.9), rel=1e-12)
    default = percentile(2000, 0, 0.95)
    assert mean_loss_interval(nll, tokens, method="bootstrap") == pytest.approx(default, rel=1e-12)
    assert bootstrap_mean_loss(nll, tokens) == pytest.approx(default, rel=1e-12)
    with pytest.raises(ValueError, match="bootstrap needs at least 100 resamples, got 99"):
        bootstrap_mean_loss(nll, tokens, resamples=99)
    for confidence in (0.0, 1.0):
        with pytest.raises(ValueError, match=rf"confidence must be in \(0, 1\), got {confidence}"):
            bootstrap_mean_loss(nll, tokens, confidence=confidence)
    assert bootstrap_mean_loss(nll, tokens, resamples=100).low < mean_loss(nll, tokens)  # 100 is enough
    interval = Interval(0.1, -0.2, 0.3, 0.95)
    assert not interval.excludes(-0.2) and not interval.excludes(0.3)
    assert interval.excludes(-0.2001) and interval.excludes(0.3001)
    paired = PairedLoss(3.1, 3.0, Interval(0.1, 0.05, 0.15, 0.95), examples=40, tokens=1400, method="t")
    assert paired.to_json() == {
        "candidate": 3.1,
        "production": 3.0,
        "difference": {"estimate": 0.1, "low": 0.05, "high": 0.15, "confidence": 0.95},
        "examples": 40,
        "tokens": 1400,
        "method": "t",
    }


def test_a_loss_comparison_refuses_input_that_is_not_one_finite_loss_and_token_count_per_example() -> None:
    """Each malformed input is refused naming what is wrong (and which example) before any figure is computed."""
    cases = {
        r"need one NLL sum and one token count per example, got \(2, 2\) and \(2, 2\)": (
            np.ones((2, 2)),
            np.ones((2, 2)),
        ),
        r"need one NLL sum and one token count per example, got \(3,\) and \(2,\)": (np.ones(3), np.ones(2)),
        "^no examples to compare$": (np.ones(0), np.ones(0)),
        "^example 2 has no scored tokens$": (np.ones(3), np.array([5.0, 1.0, 0.0])),
        "^example 1 has a non-finite loss$": (np.array([1.0, np.nan, 2.0]), np.ones(3)),
    }
    for message, (nll, tokens) in cases.items():
        with pytest.raises(ValueError, match=message):
            mean_loss_interval(nll, tokens, method="t")
    with pytest.raises(ValueError, match="^no scored tokens$"):
        mean_loss([1.0, 2.0], [0, 0])
    assert mean_loss([1.0, 2.0], [1, 0]) == 3.0  # one token in all is enough


def test_the_win_rates_json_carries_the_figures_the_report_shows() -> None:
    """``report.json``'s ``win_rate``: the counts, the conditional rate with its Wilson interval at the gate's own
    confidence (not 95 % whatever the policy says), its n (``usable``), the prompts asked, the order consistency
    and the headline rate, each under the name the report reads."""
    # 6 consistent wins, 2 consistent losses, 2 flips, 1 unreadable reply; at 90 %
    first = ["candidate"] * 6 + ["production"] * 2 + ["candidate"] * 2 + [None]
    second = ["candidate"] * 6 + ["production"] * 2 + ["production"] * 2 + ["candidate"]
    out = order_consistent_win_rate(first, second, confidence=0.9).to_json()
    z, p, n = 1.6448536269514722, 6 / 8, 8  # the 95th percentile of the normal: a two-sided 90 % interval
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert out == {  # exactly these keys: the report holds nothing else under win_rate
        "wins": 6,
        "losses": 2,
        "inconsistent": 2,
        "unreadable": 1,
        "ties": 0,
        "mode": "pairwise",
        "method": "Wilson score interval over order-consistent pairwise verdicts (both answer orders)",
        "rate": pytest.approx(
            {"estimate": 0.75, "low": centre - half, "high": centre + half, "confidence": 0.9}
        ),
        "usable": 8,
        "prompts": 11,
        "order_consistency": pytest.approx(8 / 10),
        "headline": pytest.approx(7 / 10),
    }
    with pytest.raises(
        ValueError, match="both answer orders must be judged on the same prompts: 2 vs 1 verdicts"
    ):
        order_consistent_win_rate(["candidate", "candidate"], ["candidate"])


def test_the_length_controlled_win_rates_json_names_its_figures() -> None:
    verdicts = ["candidate", "candidate", "production"]
    lc = length_controlled_win_rate(verdicts, verdicts, [120, 90, 100], [100, 100, 100])
    assert lc.to_json() == {
        "win_rate": lc.win_rate,
        "length_coefficient": lc.length_coefficient,
        "mean_length_change": pytest.approx(10 / 3),
        "verdicts": 3,
    }


def test_a_proportions_interval_never_reaches_past_0_or_1() -> None:
    """Clamped to [0, 1]: at k = n float rounding lands the Wilson high end at 1 + 2e-16 (n = 9, 26, 30, ...)."""
    bounds = [wilson_interval(k, n) for n in range(1, 100) for k in range(n + 1)]
    assert all(0.0 <= low <= high <= 1.0 for low, high in bounds)


def test_pointwise_verdicts_refuse_a_negative_epsilon_and_count_a_non_finite_score_unreadable() -> None:
    from nexa_dagster.core.evaluation.paired import pointwise_verdicts

    nan, inf = float("nan"), float("inf")
    assert pointwise_verdicts([nan, 4.0, 3.0], [3.0, inf, 2.0]) == [None, None, "candidate"]
    with pytest.raises(ValueError, match="tie_epsilon must be >= 0, got -0.1"):
        pointwise_verdicts([1.0], [2.0], tie_epsilon=-0.1)


def test_the_length_controlled_win_rate_is_the_ridge_penalised_logistic_fit() -> None:
    """``sigmoid(a)`` of the maximiser of the log-likelihood of ``P(win) = sigmoid(a + b tanh(d / sd(d)))`` less
    the ridge ``(1e-3 a^2 + 0.1 b^2) / 2``, here found by a general-purpose optimiser; with no verdict 0.5 and no
    length change; lengths for a different number of prompts are an error, not a fit on the first ones."""
    from scipy.optimize import minimize

    verdicts = [
        "candidate",
        "candidate",
        "production",
        "candidate",
        "production",
        "candidate",
        None,
        "candidate",
    ]
    cand = [130, 90, 100, 180, 60, 100, 50, 140]
    prod = [100, 100, 120, 100, 100, 90, 50, 100]
    lc = length_controlled_win_rate(verdicts, verdicts, cand, prod)
    y = np.array([1.0, 1, 0, 1, 0, 1, 1])
    d = np.array([c - p for c, p, v in zip(cand, prod, verdicts, strict=True) if v], dtype=float)
    x = np.tanh(d / d.std())

    def loss(beta: np.ndarray) -> float:
        eta = beta[0] + beta[1] * x
        return float(np.sum(np.logaddexp(0, eta) - y * eta) + (1e-3 * beta[0] ** 2 + 0.1 * beta[1] ** 2) / 2)

    a, b = minimize(loss, np.zeros(2), method="BFGS", options={"gtol": 1e-12}).x
    assert lc.win_rate == pytest.approx(1 / (1 + math.exp(-a)), abs=1e-7)
    assert lc.length_coefficient == pytest.approx(b, abs=1e-6)
    assert lc.verdicts == 7 and lc.mean_length_change == pytest.approx(np.mean(np.subtract(cand, prod)))
    assert length_controlled_win_rate([], [], [], []) == LengthControlled(0.5, 0.0, 0.0, 0)
    flips = length_controlled_win_rate(["candidate"], ["production"], [120], [100])
    assert flips == LengthControlled(0.5, 0.0, 20.0, 0)
    with pytest.raises(ValueError):
        length_controlled_win_rate(verdicts[:3], verdicts[:3], [120], [100])
