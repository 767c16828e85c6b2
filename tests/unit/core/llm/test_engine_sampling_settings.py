"""What a request samples with in the ``transformers serve`` engine (``transformers_engine.per_request_sampling`` and
``batching_generation_config``): its own temperature decides, and under continuous batching every setting is the
request's, none the manager's placeholders. The engine itself, on real requests: tests/integration/
test_engine_sampling.py."""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

from nexa_dagster.core.llm.transformers_engine import batching_generation_config, per_request_sampling

VOCAB = 600


@pytest.mark.parametrize(
    "kwargs",
    [
        {"do_sample": False, "temperature": 0.8, "top_k": None, "top_p": 0.95},  # the model's config: greedy
        {"do_sample": True, "temperature": 0.0, "top_k": 50, "top_p": 1.0},  # the request's temperature 0
        {"do_sample": None, "temperature": None, "top_k": None, "top_p": None},
    ],
)
def test_a_greedy_request_sends_top_k_1_alone(kwargs: dict) -> None:
    assert per_request_sampling(kwargs, VOCAB) == {"top_k": 1}


def test_a_sampling_request_sends_every_setting_filling_what_it_lacks_with_what_changes_nothing() -> None:
    given = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.9}
    assert per_request_sampling(given, VOCAB) == {"temperature": 0.7, "top_k": 20, "top_p": 0.9}
    bare = {"do_sample": True, "temperature": None, "top_k": None, "top_p": None}
    assert per_request_sampling(bare, VOCAB) == {"temperature": 1.0, "top_k": VOCAB, "top_p": 1.0}
    assert per_request_sampling({**bare, "top_k": 0}, VOCAB)["top_k"] == VOCAB  # 0: no top-k, as in generate


def test_the_managers_config_has_every_per_request_setting_and_keeps_the_models_other_settings() -> None:
    model = GenerationConfig(do_sample=False, temperature=1.0, suppress_tokens=[5, 6], eos_token_id=4)
    config = batching_generation_config(model, VOCAB)
    # transformers builds a per-request processor only for a temperature other than 1, a top-k, a top-p under 1
    assert config.do_sample and config.temperature not in (None, 1.0)
    assert config.top_k == VOCAB and config.top_p < 1.0
    assert config.suppress_tokens == [5, 6] and config.eos_token_id == 4
    assert (model.do_sample, model.temperature) == (
        False,
        1.0,
    ) and model.top_k != VOCAB  # the model's: unchanged
