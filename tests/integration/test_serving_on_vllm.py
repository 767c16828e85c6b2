"""The serving service on vLLM engines: ``nexa-dagster serve`` and ``model_deployment`` with the engine ``auto``
picks where vLLM is installed and can run the checkpoint, behind the same HAProxy, key and stable name as
``transformers serve`` engines (``test_serving_endpoint.py``, whose service and client this module reuses).

The checkpoints: two tiny models of other weights, their heads widened 16 -> 32 (``core/llm/widen_heads``: the same
function, a head size vLLM's CPU attention takes). Real processes: HAProxy, vLLM's OpenAI server on Unix sockets
(the environment ``make test`` installs), the service, Dagster running ``model_deployment``, the OpenAI SDK.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from support.vllm_install import require_vllm
from test_serving_endpoint import (
    API_KEY,
    Endpoint,
    NonStopClient,
    _materialize_deployment,
    serving_endpoint,
)

from nexa_dagster.core.llm.widen_heads import widen_checkpoint
from nexa_dagster.core.tiny.model import build_tiny_causal_lm

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm-engine")]


@pytest.fixture(scope="module")
def vllm_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoint]:
    require_vllm()  # make test installs it beside the suite: wait for it (a failed install fails here)
    root = tmp_path_factory.mktemp("vllm-endpoint")
    a, b = (
        widen_checkpoint(
            build_tiny_causal_lm(root / "tiny" / name, seed=seed), root / "checkpoints" / name, 32
        )
        for name, seed in (("a", 0), ("b", 1))
    )
    yield from serving_endpoint(root, a, b, tmp_path_factory.getbasetemp())


def test_a_promotion_between_vllm_engines_fails_no_request(vllm_endpoint: Endpoint) -> None:
    """The service serves A on vLLM; ``model_deployment`` (a real Dagster run) promotes B, which loads in a second
    vLLM engine while A serves, while the official OpenAI SDK streams chats through the endpoint's key without
    pause: no request fails, every answer before is A's and after is B's, and the status names vLLM.

    A rollback is not repeated here: ``nexa-dagster rollback`` switches the service through the same
    ``ServingService.switch`` as the promotion (the engine is the service's, whichever way the switch goes), and
    test_serving_endpoint.py rolls back under the same streaming load; a third vLLM start was a third of this
    module's time (318 s on the Xeon kind, 2026-12-04) and exercised nothing new."""
    ep = vllm_endpoint
    client = ep.client()
    assert client.status()["engine"] == "vllm", client.status()
    with NonStopClient(ep.base_url, API_KEY) as load:
        time.sleep(2)
        deploying = time.monotonic()
        result = _materialize_deployment(ep, "b", ep.b, "promote")
        assert result.success, ep.log_tail()
        promoted = time.monotonic()
        time.sleep(2)
    print(f"a switch between vLLM engines: {len(load.records)} streamed chats, {len(load.failures())} failed")
    assert load.failures() == [], load.failures()[:5]
    answers_a = {r[2] for r in load.records if r[0] < deploying}
    answers_b = {r[2] for r in load.records if r[0] > promoted}
    assert len(answers_a) == 1 and len(answers_b) == 1 and answers_a != answers_b, (answers_a, answers_b)
    status = client.status()
    assert (status["checkpoint_id"], status["engine"]) == ("b", "vllm"), status
