"""``OpenAICompatibleClient.sample``: ``n`` answers in one request, each with its tokens' log-probabilities, parsed
from vLLM's answer shape; an engine that ignores ``n`` or ``logprobs`` (``transformers serve`` does) is an error
that says so, never fewer samples than the caller counts. The real engine: tests/integration/test_vllm_engine.py."""

from __future__ import annotations

from typing import Any

import pytest
from support.openai_stub import chat_payload, stub_server

from nexa_dagster.core.llm.base import LLMError, SamplingParams
from nexa_dagster.core.llm.openai_compat import OpenAICompatibleClient

ASK = [{"role": "user", "content": "Say hi."}]


def _choice(i: int, tokens: list[tuple[str, float]]) -> dict[str, Any]:
    content = [{"token": t, "logprob": lp, "bytes": None, "top_logprobs": []} for t, lp in tokens]
    return {
        "index": i,
        "finish_reason": "length",
        "logprobs": {"content": content},
        "message": {"role": "assistant", "content": "".join(t for t, _ in tokens)},
    }


def test_n_answers_come_back_with_their_tokens_and_log_probabilities() -> None:
    def honours(_: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        payload = chat_payload("")
        payload["choices"] = [
            _choice(i, [(f"token_id:{i}", -0.5), ("token_id:7", -1.25)]) for i in range(body["n"])
        ]
        return 200, payload

    with stub_server(honours) as (url, calls, _), OpenAICompatibleClient(url, "m", max_retries=0) as client:
        samples = client.sample(
            ASK, SamplingParams(max_tokens=2, temperature=1.0, seed=3), n=3, token_ids=True
        )
    assert [s.tokens for s in samples] == [[f"token_id:{i}", "token_id:7"] for i in range(3)]
    assert all(s.logprobs == [-0.5, -1.25] and s.finish_reason == "length" for s in samples)
    sent = calls[-1]
    assert sent["n"] == 3 and sent["logprobs"] is True and sent["return_tokens_as_token_ids"] is True
    assert sent["seed"] == 3 and sent["temperature"] == 1.0


@pytest.mark.parametrize("ignored", ["n", "logprobs"])
def test_an_engine_that_ignores_n_or_logprobs_is_an_error_that_says_so(ignored: str) -> None:
    def ignores(_: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        payload = chat_payload("hi")
        if ignored == "logprobs":  # n answers, none with log-probabilities
            payload["choices"] = [{**payload["choices"][0], "index": i} for i in range(body["n"])]
        return 200, payload  # else one answer, whatever n asked

    with (
        stub_server(ignores) as (url, _, _),
        OpenAICompatibleClient(url, "m", max_retries=0) as client,
        pytest.raises(LLMError, match="ignored n=2 or logprobs") as e,
    ):
        client.sample(ASK, SamplingParams(max_tokens=1), n=2)
    assert e.value.permanent and "serve it with vLLM" in str(e.value)
