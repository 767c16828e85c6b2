"""A canary rolled back for its answers on real engines: SmolLM2-135M-Instruct (the project's real small model)
serves on the stable colour; the canary is the same weights with a broken chat template (the user's words without
the role markers, what a bad tokenizer export ships). The offline gate cannot see that (it scores the checkpoint's
weights on the eval set, not the template an engine applies), live answers can: the canary answers "The answer is:
Paris" where the stable model says "The capital of France is Paris.".

Real `transformers serve` engines on the colours' sockets, the real HAProxy keeping every exchange, the runner
scoring them with the answer book's reference answers (``reward: reference_f1``, word bigrams: open questions a
sentence can phrase many ways) and deciding under load from eight clients. The references are the plain answers a
person writes, not the model's own phrasings.

The engines batch the requests in flight (``--continuous-batching``), as a serving engine under live traffic does.
The test's cost is its answers: the decision took 90 to 170 scored answers a colour in the runs measured, what the
always-valid test needed for this difference on that run's traffic. A 135M model's decoding on a CPU is bound by
reading its weights, which a batch reads once for all its requests. Measured on the idle 2-core Xeon, one engine,
one thread, 12-token answers: 0.79-0.87 CPU-s an answer one at a time, 0.45 with two in flight, the same greedy
answers. This test alone, one thread an engine as in the suite: 0.83 CPU-s of the engines a request before (two
clients, no batching), 0.58 after (issue 49). Eight clients, about four requests in flight on each colour, since
2026-12-07: the machine's busy CPU over the whole test, alternating with four clients (the idle 2-core AMD EPYC), 0.76
and 0.81 CPU-s a request with four (407 and 328 requests), 0.59 and 0.61 with eight (188 and 239): a fuller batch.
How many answers the decision takes is the traffic's, not the client count's: 76 to 196 scored a colour in six runs,
three with each count."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from support.services import missing
from support.stand_in_engines import Load, router_on_blue

from nexa_dagster.core.llm.managed_server import ManagedServer
from nexa_dagster.core.serving.canary import CanaryPolicy, CanaryState
from nexa_dagster.core.serving.canary_runner import CanaryRunner
from nexa_dagster.core.serving.canary_store import Canary
from nexa_dagster.core.serving.haproxy import HAProxyRouter, haproxy_binary, socket_dir
from nexa_dagster.core.serving.live_quality import AnswerBook

MODEL = "nexa-moe"
QUESTIONS = {
    "What is the capital of France?": "The capital of France is Paris.",
    "What is the capital of Japan?": "The capital of Japan is Tokyo.",
    "What is the capital of Italy?": "The capital of Italy is Rome.",
    "What is the capital of Germany?": "The capital of Germany is Berlin.",
    "What is 2 + 2?": "2 + 2 is 4.",
    "How many days are in a week?": "There are 7 days in a week.",
    "What is the opposite of hot?": "The opposite of hot is cold.",
    "What language is spoken in Brazil?": "The language spoken in Brazil is Portuguese.",
    "What is the largest planet in the solar system?": "The largest planet in the solar system is Jupiter.",
    "What do bees make?": "Bees make honey.",
}
BROKEN_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


def broken_template_copy(model: Path, to: Path) -> Path:
    """The model's files linked, its chat template replaced: the same weights, a broken export."""
    to.mkdir(parents=True)
    for f in model.iterdir():
        if f.name != "chat_template.jinja":
            (to / f.name).symlink_to(f)
    (to / "chat_template.jinja").write_text(BROKEN_TEMPLATE)
    return to


def traffic(i: int) -> dict[str, Any]:
    draw = random.Random(i)
    question = draw.choice(list(QUESTIONS))
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 12,
        "temperature": 0.0,
    }


@pytest.fixture
def endpoint(smollm2_dir: Path, tmp_path: Path) -> Iterator[tuple[HAProxyRouter, Path]]:
    if haproxy_binary() is None:
        missing("haproxy", "scripts/install_services.sh, or: apt-get install haproxy")
    sockets = socket_dir(tmp_path)
    engines = {c: sockets / f"{c}.sock" for c in ("blue", "green")}
    models = {"blue": smollm2_dir, "green": broken_template_copy(smollm2_dir, tmp_path / "broken-template")}
    with ExitStack() as stack:
        for colour, model in models.items():
            server = ManagedServer(
                model,
                tmp_path / "engines" / colour,
                engine="transformers",
                socket_path=engines[colour],
                served_model_name=MODEL,
                startup_timeout_s=300,
                continuous_batching=True,
            ).start(attempts=1)
            stack.callback(server.stop)
        yield router_on_blue(stack, tmp_path, engines)


@pytest.mark.slow  # two SmolLM2 engines answering 185-358 requests: 1-2 minutes on the idle 2-core machine
@pytest.mark.timeout(900)
def test_a_canary_with_a_broken_chat_template_is_rolled_back_on_its_live_answers(
    endpoint, tmp_path: Path
) -> None:
    proxy, log_socket = endpoint
    book_path = tmp_path / "open-questions.jsonl"
    book_path.write_text(
        "".join(
            json.dumps({"prompt": q, "reward": "reference_f1", "reference": r}) + "\n"
            for q, r in QUESTIONS.items()
        )
    )
    # quality alone (failures and latency have their own tests: test_canary_runner.py), every answer kept; the
    # time limit only bounds the test
    policy = CanaryPolicy(
        share=0.5,
        max_failure_increase=None,
        max_slow_increase=None,
        quality_sample_share=1.0,
        max_duration_s=600,
    )
    state = CanaryState.start("smollm2", "smollm2-broken-template", policy, now=time.time())
    t0 = time.monotonic()
    with ExitStack() as clients:
        # eight clients, about four requests in flight on each colour: each client asks in an order of its own.
        # A request waits behind the three others in its engine's batch: 2 s alone, 3.3 s beside a core kept busy
        # (2026-12-07, the AMD EPYC); the client waits up to a minute, since latency is not what this canary
        # watches and a slower machine or hour must not turn a slow answer into a failed request
        loads = [
            clients.enter_context(Load(proxy.port, body=lambda i, k=k: traffic(10_000 * k + i), timeout_s=60))
            for k in range(8)
        ]
        runner = CanaryRunner(
            proxy, tmp_path / "serving", log_socket, check_every_s=1.0, answer_book=AnswerBook.load(book_path)
        )
        runner.start(Canary("blue", "green", policy, state))
        counts = runner.scorer.counts if runner.scorer else None
        decision = runner.wait(timeout_s=700)
        for load in loads:
            load.mark()
        time.sleep(2.0)
    assert decision is not None and decision.verdict == "roll back", decision
    assert decision.reason.startswith("canary worse: quality: "), decision.reason
    quality = {r.figure: r for r in decision.figures}["quality"]
    requests = sum(sum(load.answers.values()) for load in loads)
    print(
        f"rolled back after {time.monotonic() - t0:.0f} s, {requests} requests; scored {quality.n_stable} stable "
        f"(mean {quality.stable_mean:.2f}), {quality.n_canary} canary (mean {quality.canary_mean:.2f}); {dict(counts or {})}"
    )
    assert quality.stable_mean > quality.canary_mean
    assert [load.errors for load in loads] == [[]] * len(loads)
    assert all(status == 200 for load in loads for _, status in load.answers)
    assert set().union(*(load.after for load in loads)) == {
        ("blue", 200)
    }  # after the roll-back, the stable only
