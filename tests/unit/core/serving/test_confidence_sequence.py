"""The confidence sequence a canary runs: the same bounds one request at a time as over a whole stream, through a
persisted state; covering the mean at every look at once on rare, skewed and heavy-tailed streams, where an interval
re-computed at every look does not; narrower where the observed variance is small; bad input refused by name."""

from __future__ import annotations

import json
from statistics import NormalDist

import numpy as np
import pytest

from nexa_dagster.core.serving.confidence_sequence import SequenceState, bounds

ALPHA = 0.05


def test_one_request_at_a_time_through_a_saved_state_gives_the_whole_streams_bounds() -> None:
    rng = np.random.default_rng(3)
    x = np.minimum(rng.lognormal(-1.5, 0.8, 400), 1.0)
    low, high = bounds(x, ALPHA)
    state = SequenceState(ALPHA)
    for i, value in enumerate(x):
        if i == 200:  # the canary's state file between two sensor ticks
            state = SequenceState.from_dict(json.loads(json.dumps(state.to_dict())))
        state.update(float(value))
        assert (state.low, state.high) == pytest.approx((low[i], high[i]), abs=1e-12)
    assert state.n == 400 and state.mean == pytest.approx(x.mean())


STREAMS = {
    "rare failures (1 %)": (lambda rng, shape: (rng.random(shape) < 0.01).astype(float), 0.01),
    "skewed scores (beta 0.3, 3)": (lambda rng, shape: rng.beta(0.3, 3.0, shape), 0.3 / 3.3),
    "heavy-tailed latency (log-normal, clipped)": (
        lambda rng, shape: np.minimum(rng.lognormal(-2.0, 1.2, shape), 1.0),
        None,
    ),
}


@pytest.mark.parametrize("name", list(STREAMS))
def test_the_sequence_covers_the_mean_at_every_look_where_a_rechecked_interval_does_not(name: str) -> None:
    draw, mean = STREAMS[name]
    rng = np.random.default_rng(11)
    if mean is None:  # the clipped log-normal's mean, from a large sample
        mean = float(draw(rng, 4_000_000).mean())
    x = draw(rng, (1000, 1500))
    low, high = bounds(x, ALPHA)
    ever_missed = ((low > mean) | (high < mean)).any(axis=1).mean()
    # 1000 streams: a true rate of 5 % is observed above 6.6 % with probability < 1 %
    assert ever_missed <= 0.066
    # the same streams, a 95 % normal interval re-computed after every observation from the 30th on
    t = np.arange(1, x.shape[1] + 1)
    m = np.cumsum(x, axis=1) / t
    sd = np.sqrt(np.maximum(np.cumsum(x * x, axis=1) / t - m**2, 0) * t / np.maximum(t - 1, 1))
    half = NormalDist().inv_cdf(1 - ALPHA / 2) * sd / np.sqrt(t)
    wald_missed = ((np.abs(m - mean) > half)[:, 29:]).any(axis=1).mean()
    assert wald_missed > 2 * ALPHA and wald_missed > 3 * ever_missed


def test_the_bounds_narrow_with_the_observed_variance() -> None:
    rng = np.random.default_rng(5)
    rare = (rng.random((200, 1000)) < 0.01).astype(float)
    even = (rng.random((200, 1000)) < 0.5).astype(float)
    width = [float(np.mean(h[:, -1] - lo[:, -1])) for lo, h in (bounds(rare, ALPHA), bounds(even, ALPHA))]
    assert width[0] < width[1] / 3
    assert all(w > 0 for w in width)


def test_a_value_outside_zero_to_one_or_a_bad_level_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"observation 2 is 1\.5"):
        bounds(np.array([0.1, 0.2, 1.5]), ALPHA)
    with pytest.raises(ValueError, match="observation 0 is -0.1"):
        SequenceState(ALPHA).update(-0.1)
    with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\)"):
        bounds(np.array([0.5]), 1.0)
