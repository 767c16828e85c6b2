"""A canary's answers scored on live traffic through the real HAProxy: HAProxy keeps a sample of the requests and
their answers in its request log (nothing in the request path), the runner scores them off the log's thread (the
verifiable reward on a prompt of the answer book, the judge on the others, blind to the backend) and decides.

A canary that answers the checkable prompts wrong is rolled back on the quality figure alone; a canary answering as
the stable one does is promoted, with the judge (a stand-in OpenAI-style judge endpoint, reached by HTTP) scoring
the prompts no answer book checks. The engines are stand-ins answering chat completions on the colours' sockets:
under test are the sampling, the log, the scoring and the decision, not a model."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.openai_stub import json_judge, stub_server
from support.services import missing
from support.stand_in_engines import Load, router_on_blue, stand_in_engine

from nexa_dagster.core.serving.canary import CanaryPolicy, CanaryState
from nexa_dagster.core.serving.canary_runner import CanaryRunner
from nexa_dagster.core.serving.canary_store import Canary
from nexa_dagster.core.serving.haproxy import HAProxyRouter, haproxy_binary, socket_dir
from nexa_dagster.core.serving.live_quality import AnswerBook, EndpointJudge
from nexa_dagster.core.serving.request_log import RequestLogReceiver, RequestOutcome

# topics of varying length, as the RL stage's checkable prompts ask (core/rl/tasks.py's topic task)
TOPICS = ["json", "os.path", "the import system", "data model", "compound statements", "lexical analysis"]
BOOK = {
    f"Which reference topic is this passage from? Passage {i}: ... Choices: {', '.join(TOPICS)}": TOPICS[
        i % 6
    ]
    for i in range(30)
}


def _prompt(request: dict[str, Any]) -> str:
    return request["messages"][-1]["content"]


def right(request: dict[str, Any]) -> str:
    return BOOK.get(_prompt(request), "A general answer, in a sentence or two.")


def wrong(request: dict[str, Any]) -> str:
    """Right on the free prompts, wrong on the checkable ones: what a broken chat template does to a model."""
    return "I am not sure." if _prompt(request) in BOOK else right(request)


def traffic(i: int) -> dict[str, Any]:
    """About half the requests a checkable prompt (the book's, repeating), the rest free prompts of varying length,
    drawn at random: traffic that alternated strictly would meet HAProxy's round robin in step (every checkable
    prompt to one colour), which live traffic does not do."""
    draw = random.Random(i)
    content = (
        draw.choice(list(BOOK))
        if draw.random() < 0.5
        else "Tell me about " + "the topic " * draw.randint(1, 7)
    )
    return {"model": "nexa-moe", "messages": [{"role": "user", "content": content}]}


@pytest.fixture
def endpoint(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[HAProxyRouter, Path]]:
    """HAProxy with blue (answering right) serving and green (``request.param``) beside it, the request log on."""
    if haproxy_binary() is None:
        missing("haproxy", "scripts/install_services.sh, or: apt-get install haproxy")
    sockets = socket_dir(tmp_path)
    engines = {c: sockets / f"{c}.sock" for c in ("blue", "green")}
    with ExitStack() as stack:
        stack.enter_context(stand_in_engine(engines["blue"], "blue", answer=right))
        stack.enter_context(stand_in_engine(engines["green"], "green", answer=request.param))
        yield router_on_blue(stack, tmp_path, engines)


def _book(tmp_path: Path) -> AnswerBook:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in BOOK.items()))
    return AnswerBook.load(path)


def _run(proxy: HAProxyRouter, log_socket: Path, folder: Path, policy: CanaryPolicy, **scoring: Any):
    state = CanaryState.start("ckpt-blue", "ckpt-green", policy, now=time.time())
    with Load(proxy.port, body=traffic) as load_:
        runner = CanaryRunner(proxy, folder, log_socket, check_every_s=0.5, **scoring)
        runner.start(Canary("blue", "green", policy, state))
        scorer = runner.scorer
        decision = runner.wait(timeout_s=150)
        load_.mark()
        time.sleep(1.0)
    assert scorer is not None
    return decision, load_, scorer.counts


@pytest.mark.parametrize("endpoint", [wrong], indirect=True)
def test_a_canary_answering_checkable_prompts_wrong_is_rolled_back_on_its_scored_live_answers(
    endpoint, tmp_path: Path
) -> None:
    proxy, log_socket = endpoint
    policy = CanaryPolicy(share=0.5, max_slow_increase=None, quality_sample_share=0.5, max_duration_s=120)
    decision, load_, counts = _run(
        proxy, log_socket, tmp_path / "serving", policy, answer_book=_book(tmp_path)
    )
    assert decision is not None and decision.verdict == "roll back", decision
    assert decision.reason.startswith("canary worse: quality: "), decision.reason
    quality = {r.figure: r for r in decision.figures}["quality"]
    print(f"rolled back after {quality.n_stable} + {quality.n_canary} scored answers; {dict(counts)}")
    # both backends scored by the reward; the free prompts, with no judge, are unscored, not zeros
    assert counts["stable reward"] > 0 and counts["canary reward"] > 0 and counts["unscored"] > 0
    # every answer decided on was scored by the reward (a few more may be scored between the decision and the end)
    assert 0 < quality.n_stable <= counts["stable reward"] and 0 < quality.n_canary <= counts["canary reward"]
    # nothing failed: the failures figure is no reason, and nothing was lost in the switch back
    assert load_.errors == [] and all(status == 200 for _, status in load_.answers)
    assert load_.after and set(load_.after) == {("blue", 200)}
    assert "quality 0" in proxy.command(f"show map {proxy.sample_map}")  # no answer kept after the canary


@pytest.mark.parametrize("endpoint", [right], indirect=True)
def test_a_canary_answering_as_well_is_promoted_with_the_judge_scoring_the_prompts_no_book_checks(
    endpoint, tmp_path: Path
) -> None:
    proxy, log_socket = endpoint
    policy = CanaryPolicy(share=0.5, max_slow_increase=None, quality_sample_share=0.25, max_duration_s=140)
    with stub_server(json_judge({"score": 4, "rationale": "answers the question"})) as (url, calls, _):
        judge = EndpointJudge(url, "stub-judge")
        decision, load_, counts = _run(
            proxy, log_socket, tmp_path / "serving", policy, answer_book=_book(tmp_path), judge=judge
        )
        judged = [c for c in calls if not c.get("logprobs") and "probe" not in json.dumps(c)]
    assert decision is not None and decision.verdict == "promote", decision
    print(f"promoted: {dict(counts)}")
    assert min(counts["stable reward"], counts["canary reward"]) > 0
    assert min(counts["stable judge"], counts["canary judge"]) > 0
    # each judged answer asked the judge
    assert len(judged) >= counts["stable judge"] + counts["canary judge"]
    # the judge saw the answer, never which backend gave it
    assert not any("green" in json.dumps(c) or "blue" in json.dumps(c) for c in judged)
    assert load_.errors == [] and load_.after and set(load_.after) == {("green", 200)}


@pytest.mark.parametrize("endpoint", [right], indirect=True)
def test_haproxy_keeps_the_asked_share_of_exchanges_and_none_when_told_zero(endpoint) -> None:
    proxy, log_socket = endpoint
    seen: list[RequestOutcome] = []
    with RequestLogReceiver(log_socket, seen.append), httpx.Client(timeout=10) as client:
        for share, n in ((1.0, 40), (0.0, 40), (0.25, 200)):
            proxy.sample_answers(share)
            start = len(seen)
            for i in range(n):
                client.post(f"http://127.0.0.1:{proxy.port}/v1/chat/completions", json=traffic(i))
            deadline = time.monotonic() + 10
            while len(seen) < start + n and time.monotonic() < deadline:
                time.sleep(0.05)
            kept = [o.exchange for o in seen[start:] if o.exchange is not None]
            if share == 1.0:  # the request as sent and the answer as the caller got it
                assert len(kept) == n and json.loads(kept[3].request) == traffic(3)
                assert json.loads(kept[3].answer)["choices"][0]["message"]["content"] == right(traffic(3))
            elif share == 0.0:
                assert kept == []
            else:  # binomial(200, 0.25): 50 +- 24 at four standard deviations
                assert 26 <= len(kept) <= 74, len(kept)
