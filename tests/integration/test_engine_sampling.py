"""A ``transformers serve`` engine batching its requests (``--continuous-batching``: the teacher's and the judge's
``managed`` backend, the serving endpoint) answers each request as the request asks: temperature 0 is greedy whatever
the model's generation config says, and a temperature above 0 samples on a model whose config is greedy
(``transformers_engine.requests_decide_sampling``). Without it, on transformers 5.25, the first test's repeated
greedy requests came back different and the second's sampled requests all the same (both fail).

Three engines of the tiny model (5-10 s each to start on the 2-core machine)."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from nexa_dagster.core.llm.managed_server import ManagedServer


def _engine(model: Path, tmp_path: Path, model_process: str = "fork") -> Iterator[ManagedServer]:
    server = ManagedServer(
        model,
        tmp_path / "engine",
        engine="transformers",
        continuous_batching=True,
        served_model_name="m",
        model_process=model_process,
    )
    server.start(attempts=1)
    try:
        yield server
    finally:
        server.stop()


def _answer(server: ManagedServer, prompt: str, **sampling: float | int) -> str:
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 12, **sampling}
    reply = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120)
    reply.raise_for_status()
    return reply.json()["choices"][0]["message"]["content"]


@pytest.fixture(params=["fork", "spawn"])
def sampling_model_engine(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path: Path
) -> Iterator[ManagedServer]:
    """The random tiny model, whose generation config samples (temperature 0.8, top-p 0.95, no top-k); its model
    process forked from the engine (a CPU) or spawned (transformers' own start, a GPU's: the patch is applied
    there when the process imports the engine script as its main module)."""
    config = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert config.get("do_sample") and not config.get("top_k"), config  # the case this test is about
    yield from _engine(tiny_model_dir, tmp_path, request.param)


@pytest.fixture
def greedy_model_engine(tiny_model_dir: Path, tmp_path: Path) -> Iterator[ManagedServer]:
    """The same weights with a generation config that does not sample (SmolLM2-135M-Instruct's kind)."""
    model = tmp_path / "greedy-model"
    model.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.name != "generation_config.json":
            (model / f.name).symlink_to(f)
    config = json.loads((tiny_model_dir / "generation_config.json").read_text())
    for key in ("do_sample", "temperature", "top_p", "top_k"):
        config.pop(key, None)
    (model / "generation_config.json").write_text(json.dumps(config))
    yield from _engine(model, tmp_path)


PROMPTS = ["Rate the answer from 1 to 5: a list is a sequence.", "Explain how to reverse a string.", "hi"]


def test_a_greedy_request_is_greedy_alone_repeated_and_batched_on_a_model_that_samples(
    sampling_model_engine: ManagedServer,
) -> None:
    alone = [_answer(sampling_model_engine, p, temperature=0) for p in PROMPTS]
    for prompt, answer in zip(PROMPTS, alone, strict=True):
        assert {_answer(sampling_model_engine, prompt, temperature=0) for _ in range(3)} == {answer}, prompt
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: _answer(sampling_model_engine, p, temperature=0), PROMPTS))
    assert together == alone
    # a request that says nothing gets the model's own config: it samples (the control of this test's premise)
    assert len({_answer(sampling_model_engine, PROMPTS[1], seed=s) for s in range(4)}) > 1


def test_a_request_with_a_temperature_samples_on_a_model_whose_config_is_greedy(
    greedy_model_engine: ManagedServer,
) -> None:
    sampled = {_answer(greedy_model_engine, PROMPTS[1], temperature=1.0, seed=s) for s in range(4)}
    assert len(sampled) > 1, sampled
    # without a temperature the model's config decides: greedy, the same answer each time
    assert len({_answer(greedy_model_engine, PROMPTS[1]) for _ in range(3)}) == 1
