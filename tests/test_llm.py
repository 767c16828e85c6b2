"""One interface to every model: in-process transformers, a real `transformers serve`, and failure handling."""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from nexa_dagster.core.config import read_text
from nexa_dagster.core.llm.base import LLMError, SamplingParams, expected_score
from nexa_dagster.core.llm.local import LocalTransformersClient
from nexa_dagster.core.llm.managed_server import ManagedServer
from nexa_dagster.core.llm.openai_compat import OpenAICompatibleClient
from nexa_dagster.core.sample_gate import SCORE_CHOICES, judge_one
from nexa_dagster.resources.llm import LLMResource

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def local(tiny_model_dir: Path):
    with LocalTransformersClient(tiny_model_dir) as client:
        yield client


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with ManagedServer(tiny_model_dir, tmp_path_factory.mktemp("serve")) as server:
        yield server


def test_local_chat_counts_tokens_and_keeps_order(local) -> None:
    convs = [[{"role": "user", "content": f"Tell me about number {i}."}] for i in range(5)]
    out = local.chat_many(convs, GREEDY)
    assert len(out) == 5
    assert all(0 < c.completion_tokens <= 8 and c.prompt_tokens > 5 and c.error is None for c in out)
    # batched generation gives each conversation its own answer, in order (greedy = deterministic)
    assert [c.text for c in out] == [local.chat(m, GREEDY).text for m in convs]


def test_local_scores_from_logprobs(local) -> None:
    msgs = [{"role": "user", "content": "Rate this answer from 1 to 5."}]
    logprobs = local.choice_logprobs(msgs, SCORE_CHOICES)
    assert set(logprobs) == set(SCORE_CHOICES) and all(v < 0 for v in logprobs.values())
    assert 1.0 <= expected_score(logprobs) <= 5.0
    verdict = judge_one(local, read_text("prompts/judge.jinja"), "Explain lists.", "A list holds items.", 8)
    assert verdict.method == "logprobs" and 1.0 <= verdict.score <= 5.0


def test_real_transformers_serve_answers_through_the_openai_client(served) -> None:
    with OpenAICompatibleClient(served.base_url, model=served.model_name) as client:
        answer = client.chat([{"role": "user", "content": "hello"}], GREEDY)
        assert answer.completion_tokens > 0 and answer.latency_s > 0
        many = client.chat_many([[{"role": "user", "content": f"hi {i}"}] for i in range(3)], GREEDY)
        assert [c.error for c in many] == [None] * 3
        # transformers serve ignores logprobs: the client finds out, and the judge falls back to reading text
        assert client.capabilities().logprobs is False
        with pytest.raises(NotImplementedError):
            client.choice_logprobs([{"role": "user", "content": "x"}], SCORE_CHOICES)
        verdict = judge_one(client, read_text("prompts/judge.jinja"), "Explain lists.", "A list holds items.", 8)
        assert verdict.method == "text"


def test_managed_backend_of_the_resource_starts_and_stops_a_server(tiny_model_dir: Path) -> None:
    resource = LLMResource(backend="managed", model=str(tiny_model_dir))
    with resource.get_client() as client:
        assert client.chat([{"role": "user", "content": "hi"}], GREEDY).completion_tokens > 0
        base_url = client.base_url
    with pytest.raises(LLMError, match="cannot reach"):
        OpenAICompatibleClient(base_url, model="m", max_retries=0, timeout_s=2).chat(
            [{"role": "user", "content": "hi"}], GREEDY)


def test_server_is_stopped_when_the_block_fails(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = ManagedServer(tiny_model_dir, tmp_path)
    with pytest.raises(RuntimeError, match="boom"), server:
        pid = server.pid
        assert pid is not None and _alive(pid)
        raise RuntimeError("boom")
    time.sleep(0.2)
    assert not _alive(pid)


def test_unreachable_endpoint_is_named_and_the_key_never_leaks() -> None:
    secret = "sk-test-secret-123"
    client = OpenAICompatibleClient("http://127.0.0.1:9/v1", model="m", api_key=secret, max_retries=1,
                                    timeout_s=2, backoff_s=0.01)
    with pytest.raises(LLMError) as err:
        client.chat([{"role": "user", "content": "hi"}], GREEDY)
    assert "http://127.0.0.1:9/v1" in str(err.value) and secret not in str(err.value)
    assert secret not in repr(client)
    out = client.chat_many([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]], GREEDY)
    assert all(c.error and "127.0.0.1:9" in c.error and secret not in c.error for c in out)
    assert secret not in json.dumps(LLMResource(backend="openai", base_url="http://x/v1", api_key=secret).describe())


class _Flaky(BaseHTTPRequestHandler):
    """An OpenAI-shaped endpoint that fails with 503 the first two times, then answers."""

    calls = 0

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        type(self).calls += 1
        self.rfile.read(int(self.headers.get("content-length", 0)))
        if type(self).calls <= 2:
            self.send_response(503)
            self.end_headers()
            return
        body = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "flaky",
                           "choices": [{"index": 0, "finish_reason": "stop",
                                        "message": {"role": "assistant", "content": "recovered"}}],
                           "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_retries_with_backoff_on_503() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        client = OpenAICompatibleClient(f"http://127.0.0.1:{server.server_port}/v1", model="flaky", max_retries=3,
                                        backoff_s=0.01, timeout_s=5)
        answer = client.chat([{"role": "user", "content": "hi"}], GREEDY)
        assert answer.text == "recovered" and _Flaky.calls == 3
    finally:
        server.shutdown()
