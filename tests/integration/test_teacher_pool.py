"""The documented recipe for a pool of engines behind one URL (docs/stages/distillation.md, "A pool of vLLM
servers"): HAProxy, configured with the block that page shows, in front of two OpenAI-compatible engines (stubs on
127.0.0.1); the project's client sees one ``base_url``."""

import subprocess
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
from support.openai_stub import chat_payload, stub_server
from support.services import missing

from nexa_dagster.core.common.config import REPO_ROOT
from nexa_dagster.core.common.net import free_port
from nexa_dagster.core.common.processes import stop_process_group
from nexa_dagster.core.llm.base import SamplingParams
from nexa_dagster.core.llm.openai_compat import OpenAICompatibleClient
from nexa_dagster.core.serving.haproxy import haproxy_binary

# a load balancer over several model servers, one killed: left out of make test-fast
pytestmark = pytest.mark.slow


def documented_pool_config() -> str:
    """The HAProxy block of docs/stages/distillation.md's "A pool of vLLM servers" section, as written there."""
    text = (REPO_ROOT / "docs" / "stages" / "distillation.md").read_text(encoding="utf-8")
    section = text[text.index("## A pool of vLLM servers") :]
    return section.split("```\n", 2)[1]


def engine(name: str):
    def reply(n: int, body: dict) -> tuple[int, dict]:
        time.sleep(0.05)  # a request takes a while, so several are in flight at once
        return 200, chat_payload(f"answer from {name}")

    return stub_server(reply)


def test_a_load_balancer_spreads_teacher_requests_over_engines_and_routes_around_a_dead_one(
    tmp_path: Path,
) -> None:
    exe = haproxy_binary()
    if exe is None:
        missing("HAProxy", "apt-get install haproxy")
    with ExitStack() as first_engine, engine("v1") as (url1, calls1, _):
        url0, calls0, _ = first_engine.enter_context(engine("v0"))
        port = free_port()
        config = (
            documented_pool_config()
            .replace("bind :8000", f"bind 127.0.0.1:{port}")
            .replace("gpu-node-0:8000", url0.split("//")[1].removesuffix("/v1"))
            .replace("gpu-node-1:8000", url1.split("//")[1].removesuffix("/v1"))
        )
        assert "balance leastconn" in config and "option httpchk GET /health" in config
        (tmp_path / "pool.cfg").write_text(config)
        check = subprocess.run([exe, "-c", "-f", str(tmp_path / "pool.cfg")], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        with open(tmp_path / "haproxy.log", "w") as log:
            proxy = subprocess.Popen(
                [exe, "-db", "-f", str(tmp_path / "pool.cfg")],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            with OpenAICompatibleClient(
                f"http://127.0.0.1:{port}/v1", model="teacher", max_concurrency=8, max_retries=0, timeout_s=10
            ) as client:  # no retry: the balancer alone
                prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(32)]
                deadline = time.monotonic() + 20
                while True:  # haproxy binds within a moment of starting
                    first = client.chat_many(prompts[:1], SamplingParams(max_tokens=8))
                    if not first[0].error or time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
                answers = client.chat_many(prompts, SamplingParams(max_tokens=8))
                assert [a.error for a in answers] == [None] * 32
                assert {a.text for a in answers} == {
                    "answer from v0",
                    "answer from v1",
                }  # both engines worked
                assert len(calls0) >= 4 and len(calls1) >= 4, (len(calls0), len(calls1))
                # one engine dies: every request is still answered, by the other one
                before = len(calls1)
                first_engine.close()  # v0's server is shut down and its port closed
                answers = client.chat_many(prompts, SamplingParams(max_tokens=8))
                assert [a.error for a in answers] == [None] * 32, [a.error for a in answers][:3]
                assert {a.text for a in answers} == {"answer from v1"} and len(calls1) == before + 32
        finally:
            stop_process_group(proxy)
