"""The judge stage (``sample_gate``) materialized by Dagster against a local OpenAI-shaped endpoint on 127.0.0.1.

* a permanent failure (a wrong key: 401) fails the step once, with no step retry and one request: retrying it could
  only fail again (the judge, and teacher generation);
* a transient one (the connection dropped under the first verdict) is retried by the client and the run succeeds;
* the tables' schema has one place, their Dagster types: a stored ``teacher_samples`` that breaks it, and a
  ``filtered_samples`` frame that breaks it, fail the step with the column named, nothing is stored, and there is
  no schema check that would always pass;
* the judge-validity check (``judge_prefers_real_answers``) passes a judge that reads the answers' word order and
  fails one that scores every answer alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import dagster as dg
import pandas as pd
import pytest
from support.openai_stub import DROP, chat_payload, json_judge, stub_server

from nexa_dagster.assets import distill as filtering
from nexa_dagster.assets.distill import sample_gate, teacher_samples
from nexa_dagster.definitions import config_resources
from nexa_dagster.resources.io_manager import NexaIOManager
from nexa_dagster.resources.llm import LocalLLM, OpenAILLM
from nexa_dagster.resources.storage import StorageResource

DAY = "2026-11-20"
GOOD = (
    "A context manager sets something up before a block runs and tears it down after, even when the block "
    "raises. Example: with open(path) as f: data = f.read() closes the file for you."
)


def _teacher_frame(**changes: list[Any]) -> pd.DataFrame:
    frame = pd.DataFrame(
        {
            "sample_id": ["g0"],
            "doc_id": ["d"],
            "day": [DAY],
            "generation_index": [0],
            "system_prompt": [""],
            "prompt": ["Explain the with statement."],
            "response": [GOOD],
            "reasoning": [None],
            "model": ["m"],
            "prompt_tokens": [5],
            "completion_tokens": [40],
            "latency_s": [0.1],
            "finish_reason": ["stop"],
            "error": [None],
        }
    )
    return frame.assign(**changes)


def _gate(tmp_path: Path, url: str, frame: pd.DataFrame) -> dg.ExecuteInProcessResult:
    data = tmp_path / "data"
    path = data / "assets" / "teacher_samples" / f"{DAY}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(path)
    resources = {
        **config_resources(),
        "io_manager": NexaIOManager(data_root=str(data)),
        "storage": StorageResource(data_root=str(data), landing_root=str(tmp_path / "landing")),
        "judge_llm": OpenAILLM(base_url=url, model="stub", max_retries=2, timeout_s=5),
    }
    return dg.materialize(
        [teacher_samples.to_source_asset(), sample_gate],
        partition_key=DAY,
        resources=resources,
        instance=dg.DagsterInstance.ephemeral(),
        raise_on_error=False,
    )


def _stored(tmp_path: Path) -> list[str]:
    return sorted(
        p.parent.name
        for p in (tmp_path / "data" / "assets").glob("*_samples/*.parquet")
        if p.parent.name != "teacher_samples"
    )


def _retries(result: dg.ExecuteInProcessResult) -> int:
    return sum(e.event_type == dg.DagsterEventType.STEP_UP_FOR_RETRY for e in result.all_events)


def test_a_wrong_key_fails_the_step_once(tmp_path: Path) -> None:
    def reply(n: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return 401, {"error": {"message": "Incorrect API key provided"}}

    with stub_server(reply) as (url, calls, _):
        result = _gate(tmp_path, url, _teacher_frame())
    assert not result.success
    failure = result.get_step_failure_events()[0].step_failure_data.user_failure_data
    assert failure is not None and "HTTP 401" in failure.description and url in failure.description
    assert _retries(result) == 0 and len(calls) == 1  # MODEL_CALL_RETRY did not repeat it
    assert _stored(tmp_path) == []


def test_a_dropped_connection_is_retried_and_the_run_succeeds(tmp_path: Path) -> None:
    judge = json_judge({"score": 5, "rationale": "clear and correct"})

    def reply(n: int, body: dict[str, Any]) -> Any:
        return DROP if n == 3 else judge(n, body)  # the first verdict request loses its connection

    with stub_server(reply) as (url, calls, _):
        result = _gate(tmp_path, url, _teacher_frame())
    assert result.success and _retries(result) == 0
    # two probes, the dropped verdict request and its retry, then the judge-validity check's shuffled answer
    assert len(calls) == 5
    filtered = pd.read_parquet(tmp_path / "data" / "assets" / "filtered_samples" / f"{DAY}.parquet")
    assert filtered["judge_score"].tolist() == [5.0] and filtered["judge_method"].tolist() == ["json_schema"]


def test_a_stored_table_that_breaks_the_schema_stops_at_the_boundary(tmp_path: Path) -> None:
    with stub_server(json_judge()) as (url, calls, _):
        result = _gate(tmp_path, url, _teacher_frame(latency_s=[-1.0]))  # e.g. written by another tool
    assert not result.success
    type_failures = [
        e
        for e in result.all_events
        if e.event_type == dg.DagsterEventType.STEP_INPUT
        and not e.event_specific_data.type_check_data.success
    ]
    assert type_failures and "latency_s" in str(
        result.get_step_failure_events()[0].step_failure_data.error.message
    )
    assert calls == [] and _stored(tmp_path) == []
    assert not result.get_asset_check_evaluations()


def test_an_output_that_breaks_the_schema_fails_the_step_not_a_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug that writes a score out of 1..5 (simulated by corrupting the real gate's result) is caught by the
    output's type, before the IO manager stores anything."""
    real = filtering.apply_sample_gate

    def buggy(*args: Any, **kwargs: Any):
        result = real(*args, **kwargs)
        result.filtered["judge_score"] = 7.0
        return result

    monkeypatch.setattr(filtering, "apply_sample_gate", buggy)
    with stub_server(json_judge()) as (url, _, _t):
        result = _gate(tmp_path, url, _teacher_frame())
    assert not result.success
    message = str(result.get_step_failure_events()[0].step_failure_data.error.message)
    assert "judge_score" in message and "filtered_samples" in message
    assert _stored(tmp_path) == []
    assert not result.get_asset_check_evaluations()
    assert [spec.name for spec in sample_gate.check_specs] == [
        "pass_rate_in_band",
        "judge_prefers_real_answers",  # passing and failing: test_the_judge_validity_check_passes_...
    ]  # no check that cannot fail


ANSWERS = [
    "A list keeps its items in order and can change: append adds one at the end, pop removes one.",
    "A dictionary maps each key to a value; looking a key up is fast whatever the size of the mapping.",
    "A generator yields values one at a time, so a loop over a huge range never holds it all in memory.",
    "The with statement closes the file for you when the block ends, even when an exception is raised.",
    "A set holds each value once, which makes membership tests quick and removes duplicates from data.",
    "A decorator wraps a function in another, adding behaviour such as logging without editing its body.",
    "An f-string formats values inside the braces: f'{name} is {age}' reads the two variables in place.",
    "A tuple is an immutable sequence, so it can be a dictionary key where a list would be refused.",
]


def order_reading_judge(n: int, body: dict[str, Any]) -> Any:
    """Scores 5 an answer whose words are in the teacher's order, 2 the same words shuffled; refuses the logprobs
    probe's logprobs, so the gate judges through JSON verdicts."""
    if body.get("response_format") and body["response_format"]["json_schema"]["name"] == "probe":
        return 200, chat_payload(json.dumps({"ok": True}))
    if body.get("logprobs"):
        return 200, chat_payload("1")
    real = any(answer in body["messages"][-1]["content"] for answer in ANSWERS)
    return 200, chat_payload(json.dumps({"score": 5 if real else 2, "rationale": "read it"}))


@pytest.mark.parametrize("reads", [True, False])
def test_the_judge_validity_check_passes_a_judge_that_reads_and_fails_one_that_does_not(
    tmp_path: Path, reads: bool
) -> None:
    """Through the asset, on eight answers: a judge that scores the teacher's word order above the same words
    shuffled wins 8 of 8 (p = 1/256) and the check passes; one that gives every answer the same score ties on all
    eight (a tie is not a win) and the check fails. Both are warnings: the day's data is stored either way."""
    frame = pd.concat([_teacher_frame()] * len(ANSWERS), ignore_index=True)
    frame = frame.assign(
        sample_id=[f"g{i}" for i in range(len(ANSWERS))], doc_id=[f"d{i}" for i in range(len(ANSWERS))]
    ).assign(response=ANSWERS)
    with stub_server(order_reading_judge if reads else json_judge()) as (url, _, _t):
        result = _gate(tmp_path, url, frame)
    assert result.success
    check = next(
        c for c in result.get_asset_check_evaluations() if c.check_name == "judge_prefers_real_answers"
    )
    figures = {k: getattr(v, "value", v) for k, v in check.metadata.items()}
    assert figures["pairs"] == len(ANSWERS) and figures["decided"], figures
    if reads:
        assert check.passed and figures["wins"] == 8 and figures["p_value"] == round(1 / 256, 4), figures
    else:
        assert not check.passed and figures["ties"] == 8 and figures["p_value"] == 1.0, figures
    assert check.severity == dg.AssetCheckSeverity.WARN
    assert len(pd.read_parquet(tmp_path / "data" / "assets" / "filtered_samples" / f"{DAY}.parquet")) == 8


def test_a_wrong_key_fails_teacher_generation_once(tmp_path: Path) -> None:
    """Every teacher request would get the same 401: the stage stops at the first, and is not retried."""
    from nexa_dagster.assets.ingest import raw_documents

    def reply(n: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return 401, {"error": {"message": "Incorrect API key provided"}}

    data = tmp_path / "data"
    path = data / "assets" / "raw_documents" / f"{DAY}.parquet"
    path.parent.mkdir(parents=True)
    texts = [f"Document {i} explains the with statement and context managers in Python." for i in range(6)]
    pd.DataFrame(
        {
            "doc_id": [f"{i:016d}" for i in range(6)],
            "day": [DAY] * 6,
            "source": ["s"] * 6,
            "title": ["t"] * 6,
            "text": texts,
            "n_chars": [len(t) for t in texts],
        }
    ).to_parquet(path)
    with stub_server(reply) as (url, calls, _):
        resources = {
            **config_resources(),
            "io_manager": NexaIOManager(data_root=str(data)),
            "storage": StorageResource(data_root=str(data), landing_root=str(tmp_path / "landing")),
            "teacher_llm": OpenAILLM(base_url=url, model="stub", max_concurrency=2),
            **config_resources(),
        }
        result = dg.materialize(
            [raw_documents.to_source_asset(), teacher_samples],
            partition_key=DAY,
            resources=resources,
            instance=dg.DagsterInstance.ephemeral(),
            raise_on_error=False,
        )
    assert not result.success and _retries(result) == 0
    failure = result.get_step_failure_events()[0].step_failure_data.user_failure_data
    assert failure is not None and "HTTP 401" in failure.description
    assert (
        len(calls) <= 2
    )  # the requests already in flight, not one per document (6), nor again per step retry


def test_a_corrupt_local_model_fails_the_step_once_naming_the_file(tmp_path: Path) -> None:
    """A local judge whose weights file is corrupt fails the same way on every attempt: the step fails once, with
    no step retry, and the message names the file (transformers' own error says only that a header is invalid)."""
    from nexa_dagster.core.tiny.model import build_tiny_causal_lm

    model = build_tiny_causal_lm(tmp_path / "models" / "tiny-judge")
    (model / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a safetensors header")
    data = tmp_path / "data"
    path = data / "assets" / "teacher_samples" / f"{DAY}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    _teacher_frame().to_parquet(path)
    resources = {
        **config_resources(),
        "io_manager": NexaIOManager(data_root=str(data)),
        "storage": StorageResource(data_root=str(data), landing_root=str(tmp_path / "landing")),
        "judge_llm": LocalLLM(model=str(model)),
    }
    result = dg.materialize(
        [teacher_samples.to_source_asset(), sample_gate],
        partition_key=DAY,
        resources=resources,
        instance=dg.DagsterInstance.ephemeral(),
        raise_on_error=False,
    )
    assert not result.success
    failure = result.get_step_failure_events()[0].step_failure_data.user_failure_data
    assert failure is not None and f"{model}: model.safetensors" in failure.description, failure
    assert _retries(result) == 0  # MODEL_CALL_RETRY did not load it again three times
    assert _stored(tmp_path) == []
