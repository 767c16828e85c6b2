"""One interface to every model: in-process transformers, a real `transformers serve`, and failure handling.

Real components throughout (the tiny model, a real server process); small in-test HTTP stubs only where a real
engine cannot be had offline on a CPU: a flaky endpoint and an engine that honours ``logprobs`` (vLLM's shape).
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from support.openai_stub import DROP, chat_payload, json_judge, stub_server
from support.services import child_processes_matching

from nexa_dagster.core.common.config import load_yaml, read_text
from nexa_dagster.core.distill.sample_gate import SCORE_CHOICES, judge_one
from nexa_dagster.core.llm.base import LLMError, SamplingParams, expected_score
from nexa_dagster.core.llm.local import LocalTransformersClient
from nexa_dagster.core.llm.managed_server import ManagedServer, process_running, transformers_serve_options
from nexa_dagster.core.llm.openai_compat import MISSING_CHOICE_MARGIN, OpenAICompatibleClient
from nexa_dagster.resources.llm import LocalLLM, ManagedLLM, OpenAILLM

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
SECRET = "sk-test-secret-123"


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs. A zombie has exited: an orphan's waits for PID 1 to reap it, in some containers
    for seconds (CI failed on this when the server had a child: os.kill(pid, 0) succeeds on a zombie)."""
    try:
        return process_running(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False


def _group_running(pgid: int) -> list[int]:
    """The running processes of process group ``pgid`` (zombies have exited: see ``_alive``)."""
    running = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid and process_running(process):
                running.append(process.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return running


@pytest.fixture(scope="module")
def local(tiny_model_dir: Path) -> Iterator[LocalTransformersClient]:
    with LocalTransformersClient(tiny_model_dir, batch_size=4) as client:
        yield client


# -- in-process transformers --------------------------------------------------------------------------------------
def test_local_chat_counts_tokens_and_keeps_order(local: LocalTransformersClient) -> None:
    # prompts of different lengths, more of them than one batch: left padding and re-ordering are exercised
    convs = [
        [{"role": "user", "content": "Tell me about number " + "very " * (3 * i) + f"{i}."}] for i in range(6)
    ]
    out = local.chat_many(convs, GREEDY)
    assert len(out) == 6
    for conv, c in zip(convs, out, strict=True):
        rendered = local.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        assert c.prompt_tokens == len(local.tokenizer.encode(rendered, add_special_tokens=False))
        assert 0 < c.completion_tokens <= 8 and c.error is None and c.latency_s > 0
        assert (c.completion_tokens == 8) == (c.finish_reason == "length")
    # batched generation gives each conversation its own answer, in order (greedy = deterministic)
    assert [c.text for c in out] == [local.chat(m, GREEDY).text for m in convs]
    assert local.chat_many([], GREEDY) == []


def test_local_batching_beats_one_at_a_time(
    local: LocalTransformersClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    convs = [[{"role": "user", "content": f"Explain topic {i} in detail."}] for i in range(8)]
    params = SamplingParams(max_tokens=8)
    calls = []
    generate = local.model.generate
    monkeypatch.setattr(
        local.model, "generate", lambda **kw: calls.append(kw["input_ids"].shape[0]) or generate(**kw)
    )
    local.chat_many(convs, params)
    assert calls == [4, 4]  # batch_size=4: two generate() calls for eight conversations
    # the speed-up itself is measured by bench/bench_local_batching.py, not asserted here


def test_local_sampling_honours_the_seed(local: LocalTransformersClient) -> None:
    import torch

    msgs = [{"role": "user", "content": "Write something."}]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7)
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    first = local.chat(msgs, params)
    assert torch.equal(torch.rand(1), expected_next)  # the request's seed did not reset the caller's RNG
    assert local.chat(msgs, params).text == first.text
    others = {
        local.chat(msgs, SamplingParams(max_tokens=12, temperature=1.0, seed=s)).text for s in range(8, 12)
    }
    assert others != {first.text}


def test_local_scores_from_logprobs(local: LocalTransformersClient) -> None:
    msgs = [{"role": "user", "content": "Rate this answer from 1 to 5."}]
    logprobs = local.choice_logprobs(msgs, SCORE_CHOICES)
    assert set(logprobs) == set(SCORE_CHOICES)
    assert all(math.isfinite(v) and v < 0 for v in logprobs.values())
    assert 1.0 <= expected_score(logprobs) <= 5.0
    assert local.capabilities().logprobs and local.capabilities().engine == "transformers-local"
    verdict = judge_one(local, read_text("prompts/judge.jinja"), "Explain lists.", "A list holds items.")
    assert verdict.method == "logprobs" and verdict.score is not None and 1.0 <= verdict.score <= 5.0


def test_local_one_token_choices_are_read_from_one_pass_over_the_prompt(
    local: LocalTransformersClient,
) -> None:
    """A judge's scores ("1".."5", one token each): the prompt goes through the model once, one row, and each
    score's log-probability is the one an unpadded pass over prompt + score gives it."""
    import torch

    msgs = [{"role": "user", "content": "Rate this answer from 1 to 5: a list holds items in order."}]
    tok = local.tokenizer
    prompt_ids = tok.encode(
        tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    rows: list[int] = []
    hook = local.model.register_forward_pre_hook(
        lambda _m, _a, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        scored = local.choice_logprobs(msgs, SCORE_CHOICES)
    finally:
        hook.remove()
    assert rows == [1]
    for choice in SCORE_CHOICES:
        (token,) = tok.encode(choice, add_special_tokens=False)
        with torch.no_grad():
            logits = local.model(input_ids=torch.tensor([[*prompt_ids, token]])).logits.float()
        expected = float(torch.log_softmax(logits[0, len(prompt_ids) - 1], dim=-1)[token])
        assert scored[choice] == pytest.approx(expected, abs=1e-4)


def test_local_multi_token_choice_is_the_sum_of_its_tokens(local: LocalTransformersClient) -> None:
    import torch

    msgs = [{"role": "user", "content": "What holds items in order?"}]
    choice = "a list comprehension"
    tok = local.tokenizer
    choice_ids = tok.encode(choice, add_special_tokens=False)
    assert len(choice_ids) > 1
    # independent computation: one unpadded forward pass over prompt + choice
    prompt_ids = tok.encode(
        tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    ids = torch.tensor([prompt_ids + choice_ids])
    with torch.no_grad():
        logp = torch.log_softmax(local.model(input_ids=ids).logits.float(), dim=-1)[0]
    expected = sum(float(logp[len(prompt_ids) + j - 1, t]) for j, t in enumerate(choice_ids))
    # scored together with short choices (so its row is padded differently) and alone: same value
    together = local.choice_logprobs(msgs, ["1", choice, "2"])[choice]
    alone = local.choice_logprobs(msgs, [choice])[choice]
    assert together == pytest.approx(expected, abs=1e-3) and alone == pytest.approx(expected, abs=1e-3)


# -- a real `transformers serve` ------------------------------------------------------------------------------------
def test_real_transformers_serve_answers_through_the_openai_client(
    served: ManagedServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    assert served.engine == "transformers" and served.ready_s > 0
    # continuous batching is on by default only for a GPU device (teacher generation, as the shared server, asks)
    assert ManagedServer(tiny_model_dir, tmp_path).continuous_batching is False and served.continuous_batching
    assert "continuous_batching" in transformers_serve_options()
    with OpenAICompatibleClient(served.base_url, model=served.model_name) as client:
        answer = client.chat([{"role": "user", "content": "hello"}], GREEDY)
        assert answer.completion_tokens > 0 and answer.prompt_tokens > 0 and answer.latency_s > 0
        # prompts of different lengths: the answers come back in the prompts' order. (Their greedy text is not
        # compared: batched with continuous batching, a tiny model's near-tie can flip a token.)
        convs = [[{"role": "user", "content": "hi " * (1 + 4 * i)}] for i in range(3)]
        many = client.chat_many(convs, GREEDY)
        assert [c.error for c in many] == [None] * 3
        alone = [client.chat(m, GREEDY).prompt_tokens for m in convs]
        assert [c.prompt_tokens for c in many] == alone and len(set(alone)) == 3  # in order
        # transformers serve ignores logprobs: the client finds out, and the judge falls back to reading text
        assert client.capabilities().logprobs is False
        with pytest.raises(NotImplementedError):
            client.choice_logprobs([{"role": "user", "content": "x"}], SCORE_CHOICES)
        verdict = judge_one(client, read_text("prompts/judge.jinja"), "Explain lists.", "A list holds items.")
        assert verdict.method == "text"


def test_managed_backend_of_the_resource_starts_and_stops_a_server(tiny_model_dir: Path) -> None:
    before = {p.pid for p in child_processes_matching("serve")}
    resource = ManagedLLM(model=str(tiny_model_dir))
    with resource.get_client(log=logging.getLogger("test")) as client:
        assert client.chat([{"role": "user", "content": "hi"}], GREEDY).completion_tokens > 0
        base_url = client.base_url
        started = [p for p in child_processes_matching("serve") if p.pid not in before]
        assert started
    assert not any(process_running(p) for p in started)
    with pytest.raises(LLMError, match="cannot reach"):
        OpenAICompatibleClient(base_url, model="m", max_retries=0, timeout_s=2).chat(
            [{"role": "user", "content": "hi"}], GREEDY
        )


@pytest.mark.parametrize(
    ("setting", "on_gpu", "on_cpu"), [(False, False, False), (True, True, True), (None, True, False)]
)
def test_continuous_batching_setting_is_passed_as_it_is(
    tiny_model_dir: Path, tmp_path: Path, setting: bool | None, on_gpu: bool, on_cpu: bool
) -> None:
    """False turns it off even on a GPU (it used to become None, "auto", which is on there); None is auto."""
    resource = ManagedLLM(model=str(tiny_model_dir), continuous_batching=setting)
    assert resource.managed_server(tiny_model_dir, tmp_path, device="cuda").continuous_batching is on_gpu
    assert resource.managed_server(tiny_model_dir, tmp_path, device="cpu").continuous_batching is on_cpu


# Run by every Python that has it on its path; only `transformers serve` itself starts the workers.
_SERVER_WITH_WORKERS = """\
import os, subprocess, sys
if os.path.basename(sys.argv[0]) == "transformers_engine.py":  # the engine, not its model process
    stay = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    subprocess.Popen([sys.executable, "-c", stay])
    subprocess.Popen([sys.executable, "-c", stay], start_new_session=True)
"""


@pytest.mark.parametrize(
    "interrupt", [RuntimeError("boom"), KeyboardInterrupt()], ids=["exception", "ctrl-c"]
)
def test_server_is_stopped_when_the_block_fails(
    tiny_model_dir: Path, tmp_path: Path, interrupt: BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    """The server and its workers stop: here two workers it starts at its import (a ``sitecustomize``), one in its
    process group that ignores SIGTERM and one that moved to a session of its own, as an engine's workers may, and
    whatever workers the engine starts itself (on a fresh install, `transformers serve` had a multiprocessing
    worker and its resource tracker, which ignores SIGTERM and SIGINT; on another, none).

    And while the server loads (seconds here, minutes for a large model under vLLM) the log says it is still
    waiting, at the configured interval, naming the model: watched on this test's start rather than on an engine
    started for it alone (an engine start is ~10 CPU-s, issue 49)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SERVER_WITH_WORKERS)
    logger = logging.getLogger("test-server-block-fails")
    caplog.set_level(logging.INFO, logger=logger.name)
    server = ManagedServer(
        tiny_model_dir, tmp_path, extra_env={"PYTHONPATH": str(site)}, logger=logger, progress_every_s=0.5
    )
    with pytest.raises(type(interrupt)), server:
        assert server.ready_s > 0.5, server.ready_s  # slow enough for a progress line at 0.5 s
        said = [r.getMessage() for r in caplog.records if r.name == logger.name]
        waiting = [m for m in said if "not healthy yet" in m]
        assert waiting and all(str(Path(tiny_model_dir).resolve()) in m for m in waiting), waiting
        assert any("healthy at" in m for m in said)
        pid = server.pid
        assert pid is not None and _alive(pid)
        children = psutil.Process(pid).children(recursive=True)
        ours = [c for c in children if "time.sleep(600)" in " ".join(c.cmdline())]
        assert len(ours) == 2 and len({os.getsid(c.pid) for c in ours}) == 2
        raise interrupt
    assert not _alive(pid)
    assert not any(_alive(c.pid) for c in children)
    assert not _group_running(pid)  # the whole process group is gone
    assert server.log_path.exists()


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux-only")
def test_server_stops_when_its_parent_is_killed_outright(tiny_model_dir: Path, tmp_path: Path) -> None:
    script = (
        "import sys, time\n"
        "from nexa_dagster.core.llm.managed_server import ManagedServer\n"
        "server = ManagedServer(sys.argv[1], sys.argv[2]).start()\n"
        "print(server.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script, str(tiny_model_dir), str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        line = parent.stdout.readline() if parent.stdout else ""
        assert line.strip().isdigit(), "the parent did not start a server"
        server = psutil.Process(int(line))
        parent.kill()  # SIGKILL: no finally, no atexit
        parent.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if server.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.2)
        else:
            server.kill()
            pytest.fail("the server outlived its parent")
    finally:
        if parent.poll() is None:
            parent.kill()


def test_a_server_that_dies_or_hangs_is_reported_with_its_log(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # no model_type, no weights: transformers serve cannot load it
    with pytest.raises(LLMError, match="exited with code") as err:
        ManagedServer(broken, tmp_path).start()
    assert str(broken) in str(err.value) and "last log lines" in str(err.value)

    before = {
        p.pid for p in child_processes_matching("serve")
    }  # the module's `served` fixture may be running
    slow = ManagedServer(broken, tmp_path, startup_timeout_s=0.5)
    with pytest.raises(LLMError, match="not healthy after"):
        slow.start()
    assert slow.process is None
    assert not [p for p in child_processes_matching("serve") if p.pid not in before]

    with pytest.raises(LLMError, match="no config.json"):
        ManagedServer(tmp_path / "missing", tmp_path)


# -- failures, retries, secrets -------------------------------------------------------------------------------------
def test_unreachable_endpoint_is_named_and_the_key_never_leaks(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    client = OpenAICompatibleClient(
        "http://127.0.0.1:9/v1", model="m", api_key=SECRET, max_retries=1, timeout_s=2, backoff_s=0.01
    )
    with pytest.raises(LLMError) as err:
        client.chat([{"role": "user", "content": "hi"}], GREEDY)
    assert "cannot reach http://127.0.0.1:9/v1" in str(err.value) and SECRET not in str(err.value)
    assert (
        err.value.__cause__ is None and err.value.__context__ is None
    )  # the request (headers) is not attached
    assert SECRET not in repr(client)
    out = client.chat_many([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]], GREEDY)
    assert len(out) == 2 and all(c.error and "127.0.0.1:9" in c.error and SECRET not in c.error for c in out)
    assert all(c.text == "" and c.completion_tokens == 0 for c in out)
    resource = OpenAILLM(base_url=f"http://user:{SECRET}@x/v1?key={SECRET}", api_key=SECRET)
    assert SECRET not in json.dumps(resource.describe()) and resource.describe()["api_key_set"] is True
    assert SECRET not in caplog.text
    with pytest.raises(LLMError, match="127.0.0.1:9"):
        OpenAICompatibleClient(
            "http://127.0.0.1:9/v1", api_key=SECRET, max_retries=0, timeout_s=2
        )  # model lookup


def test_retries_with_backoff_on_503() -> None:
    def reply(n: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return (503, {"error": {"message": "busy"}}) if n <= 2 else (200, chat_payload("recovered"))

    with stub_server(reply) as (url, calls, _):
        client = OpenAICompatibleClient(url, model="stub", max_retries=3, backoff_s=0.01, timeout_s=5)
        answer = client.chat([{"role": "user", "content": "hi"}], GREEDY)
        assert answer.text == "recovered" and len(calls) == 3


def test_a_client_error_is_not_retried_and_an_echoed_key_is_scrubbed() -> None:
    def reply(n: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return 401, {"error": {"message": f"Incorrect API key provided: {SECRET}"}}

    with stub_server(reply) as (url, calls, _):
        client = OpenAICompatibleClient(url, model="stub", api_key=SECRET, max_retries=3, backoff_s=0.01)
        with pytest.raises(LLMError, match="HTTP 401") as err:
            client.chat([{"role": "user", "content": "hi"}], GREEDY)
        assert len(calls) == 1 and SECRET not in str(err.value) and url in str(err.value)


def test_choice_logprobs_from_an_engine_that_honours_them() -> None:
    top = [
        {"token": " 3", "logprob": -0.5},
        {"token": "3", "logprob": -2.0},
        {"token": "4", "logprob": -1.5},
        {"token": "The", "logprob": -3.0},
    ]

    def reply(n: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        first = {
            "token": " 3",
            "logprob": -0.5,
            "bytes": None,
            "top_logprobs": [{**t, "bytes": None} for t in top[: body.get("top_logprobs", 0)]],
        }
        return 200, chat_payload("3", {"content": [first]} if body.get("logprobs") else None)

    with stub_server(reply) as (url, calls, _):
        client = OpenAICompatibleClient(url, model="stub")
        assert client.capabilities().logprobs is True
        lp = client.choice_logprobs([{"role": "user", "content": "score"}], SCORE_CHOICES)
        assert calls[-1]["max_tokens"] == 1 and calls[-1]["top_logprobs"] == 20
        assert lp["3"] == pytest.approx(math.log(math.exp(-0.5) + math.exp(-2.0)))  # " 3" and "3" add up
        assert lp["4"] == -1.5
        assert lp["1"] == lp["2"] == lp["5"] == -3.0 - MISSING_CHOICE_MARGIN  # below the least likely listed
        assert 3.0 < expected_score(lp) < 4.0


def test_in_flight_requests_are_bounded_and_stream_in_completion_order() -> None:
    """At most ``max_concurrency`` requests reach the server at once; answers stream as they finish."""
    from nexa_dagster.core.llm.base import ChatRequest

    lock = threading.Lock()
    state = {"now": 0, "peak": 0}

    def reply(n: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
        delay = float(body["messages"][0]["content"])
        time.sleep(delay)
        with lock:
            state["now"] -= 1
        return 200, chat_payload(f"slept {delay}")

    delays = [0.6, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05]
    with stub_server(reply) as (url, calls, _):
        with OpenAICompatibleClient(url, model="stub", max_concurrency=3) as client:
            requests = [ChatRequest([{"role": "user", "content": str(d)}], GREEDY) for d in delays]
            order = [i for i, c in client.stream_chat(requests) if c.error is None]
        assert sorted(order) == list(range(len(delays))) and len(calls) == len(delays)
        assert state["peak"] == 3  # bounded, and the bound was reached
        assert order[-1] == 0  # the slow first request finished last, and did not hold back the others


@pytest.mark.parametrize(("json_schema", "method"), [(200, "json_schema"), (400, "text")])
def test_an_engine_that_rejects_logprobs_falls_back(json_schema: int, method: str) -> None:
    """The capability probe asks for ``logprobs``; an engine that refuses it with 400 is an engine without it, not
    a failed judge stage: the judge uses ``response_format`` where honoured, else text."""
    from nexa_dagster.core.distill.judge import Judge

    with (
        stub_server(json_judge(logprobs=400, json_schema=json_schema)) as (url, calls, _),
        OpenAICompatibleClient(url, model="stub", backoff_s=0.01) as client,
    ):
        judge = Judge(client, read_text("prompts/judge.jinja"), read_text("prompts/judge_verdict.jinja"))
        assert judge.method == method
        assert client.capabilities().logprobs is False
        verdict = judge.judge("Explain lists.", "A list holds items in order.")
        assert (verdict.score, verdict.error, verdict.method) == (4.0, None, method)
        assert len(calls) == 3  # two probes (neither retried: a 400 is an answer) and one verdict


def test_a_wrong_key_fails_the_probe_instead_of_passing_for_no_logprobs() -> None:
    def reply(n: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return 401, {"error": {"message": "invalid api key"}}

    with (
        stub_server(reply) as (url, calls, _),
        OpenAICompatibleClient(url, model="stub", backoff_s=0.01) as client,
    ):
        with pytest.raises(LLMError, match="HTTP 401") as err:
            client.capabilities()
        assert err.value.permanent and err.value.status == 401 and len(calls) == 1


@pytest.mark.parametrize(
    ("header", "max_backoff_s", "low", "high"),
    [("1", 30.0, 1.0, 1.6), ("3600", 0.3, 0.3, 0.9)],
    ids=["honoured", "bounded"],
)
def test_retry_after_is_honoured_and_bounded(
    header: str, max_backoff_s: float, low: float, high: float
) -> None:
    """429 with ``Retry-After: 1`` waits one second (not the 0.5x-1.5x jittered backoff); an hour is capped."""

    def reply(n: int, body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]] | tuple[int, Any]:
        if n == 1:
            return 429, {"error": {"message": "slow down"}}, {"Retry-After": header}
        return 200, chat_payload("ok")

    with (
        stub_server(reply) as (url, calls, times),
        OpenAICompatibleClient(url, model="stub", backoff_s=0.01, max_backoff_s=max_backoff_s) as client,
    ):
        assert client.chat([{"role": "user", "content": "hi"}], GREEDY).text == "ok"
        waited = times[1] - times[0]
        assert low <= waited < high, waited


def test_the_judge_asks_again_only_what_asking_again_can_fix() -> None:
    """A dropped connection is retried by the client and then, if it still fails, is one ``judge_error`` (not
    re-asked verdict by verdict on top of the client's retries); a 404 for an unknown model stops the judge; a 400
    for one sample (its prompt too long) is that sample's ``judge_error``, asked once, and the others are judged."""
    from nexa_dagster.core.distill.judge import Judge

    probe = json_judge()

    def dropping(n: int, body: dict[str, Any]) -> Any:
        return probe(n, body) if n <= 2 else DROP  # the probes answer, then every connection drops

    with (
        stub_server(dropping) as (url, calls, _),
        OpenAICompatibleClient(url, model="stub", max_retries=2, backoff_s=0.01, timeout_s=5) as client,
    ):
        judge = Judge(
            client, read_text("prompts/judge.jinja"), read_text("prompts/judge_verdict.jinja"), retries=2
        )
        verdict = judge.judge("Explain lists.", "A list holds items.")
        assert verdict.error and "cannot reach" in verdict.error and verdict.attempts == 1
        assert len(calls) == 2 + 3  # probes, then one verdict sent 1 + max_retries times, not 3 x 3

    def unknown_model(n: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return probe(n, body) if n <= 2 else (404, {"error": {"message": "The model `stub` does not exist."}})

    with (
        stub_server(unknown_model) as (url, calls, _),
        OpenAICompatibleClient(url, model="stub", max_retries=2, backoff_s=0.01) as client,
    ):
        judge = Judge(
            client, read_text("prompts/judge.jinja"), read_text("prompts/judge_verdict.jinja"), retries=2
        )
        with pytest.raises(LLMError, match="HTTP 404") as err:
            judge.judge("Explain lists.", "A list holds items.")
        assert err.value.permanent and len(calls) == 3

    def too_long(n: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if n > 2 and "LONG" in body["messages"][-1]["content"]:
            return 400, {"error": {"message": "maximum context length exceeded"}}
        return probe(n, body)

    with (
        stub_server(too_long) as (url, calls, _),
        OpenAICompatibleClient(url, model="stub", max_retries=2, backoff_s=0.01) as client,
    ):
        judge = Judge(
            client, read_text("prompts/judge.jinja"), read_text("prompts/judge_verdict.jinja"), retries=2
        )
        long, fine = judge.judge_many(
            [("Explain lists.", "LONG " * 50), ("Explain lists.", "A list holds items.")]
        )
        assert long.error and "HTTP 400" in long.error and long.attempts == 1  # this sample's, asked once
        assert fine.error is None and fine.score == 4.0
        assert len(calls) == 2 + 2


def test_a_verdict_too_short_for_json_is_refused_not_raised() -> None:
    """``max_tokens`` means what it says: too few for a JSON verdict is an error, not silently raised to 96; a
    negative retry count is an error, not silently 0."""
    from nexa_dagster.core.distill.judge import Judge

    with stub_server(json_judge()) as (url, _, _t), OpenAICompatibleClient(url, model="stub") as client:
        with pytest.raises(ValueError, match="max_tokens 8 is too few"):
            Judge(
                client,
                read_text("prompts/judge.jinja"),
                read_text("prompts/judge_verdict.jinja"),
                max_tokens=8,
            )
        judge = Judge(
            client, read_text("prompts/judge.jinja"), read_text("prompts/judge_verdict.jinja"), max_tokens=120
        )
        assert judge.max_tokens == 120
        with pytest.raises(ValueError, match="retries must be >= 0"):
            Judge(
                client, read_text("prompts/judge.jinja"), read_text("prompts/judge_verdict.jinja"), retries=-1
            )
    # the same limits where a user writes them: configs/filters.yaml and the resource's settings
    from nexa_dagster.core.common.config import ConfigError, validated
    from nexa_dagster.core.distill.sample_gate import GateConfig

    gate = load_yaml("filters.yaml")
    with pytest.raises(ConfigError, match="judge.max_tokens"):
        validated(GateConfig, "filters.yaml", {**gate, "judge": {**gate["judge"], "max_tokens": 8}})
    for bad in ({"max_retries": -1}, {"max_concurrency": 0}, {"timeout_s": 0}):
        with pytest.raises(Exception, match=next(iter(bad))):
            OpenAILLM(base_url="http://127.0.0.1:9/v1", **bad)
    with pytest.raises(Exception, match="batch_size"):
        LocalLLM(model="m", batch_size=0)
    with pytest.raises(ValueError, match="max_retries must be >= 0"):
        OpenAICompatibleClient("http://127.0.0.1:9/v1", model="m", max_retries=-1)
