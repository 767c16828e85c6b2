"""Teacher generation and judging against a real `transformers serve` on the tiny model (no mocks).

* answers are stored as they arrive and reused: a second run sends nothing; changed sampling settings, model or
  number of generations invalidate exactly the affected keys;
* the server is SIGKILLed halfway through a partition and restarted on the same port: the client's retries carry
  the partition through and every key comes back exactly once;
* the process materializing ``teacher_samples`` is SIGKILLed halfway, then the asset is materialized again: answers
  paid for before the kill are reused, and the rows have the same keys as an uninterrupted run;
* a judge that answers garbage (the tiny random model asked for a JSON verdict) yields ``judge_error`` rows and
  passes nothing.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
from support.sandbox import SAMPLE_LANDING

from nexa_dagster.core.common.config import REPO_ROOT, load_scale, read_text
from nexa_dagster.core.common.net import free_port
from nexa_dagster.core.distill.generation_store import GenerationStore
from nexa_dagster.core.distill.sample_gate import apply_sample_gate, load_gate_config
from nexa_dagster.core.distill.teacher import PromptSpec, build_prompts, generate_teacher_samples
from nexa_dagster.core.llm.base import SamplingParams
from nexa_dagster.core.llm.managed_server import ManagedServer
from nexa_dagster.core.llm.openai_compat import OpenAICompatibleClient

DAY = "2026-11-20"
PARAMS = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7)
TEMPLATE = read_text("prompts/teacher.jinja")
SYSTEM = read_text("prompts/teacher_system.txt").strip()


def _documents(n: int, day: str = DAY) -> pd.DataFrame:
    rows = [
        json.loads(line)
        # make run's sample day: the tests' small copy holds 12 documents, fewer than some tests ask for
        for line in (REPO_ROOT / "sample_data" / "landing" / DAY / "python_reference.jsonl")
        .read_text()
        .splitlines()
        if line.strip()
    ]
    return pd.DataFrame(
        {
            "doc_id": [f"{i:016d}" for i in range(n)],
            "day": [day] * n,
            "title": [r.get("title", "") for r in rows[:n]],
            "text": [str(r.get("text", ""))[:300] for r in rows[:n]],
        }
    )


def _stored(path: Path) -> int:
    """Answers committed to a store file, read through a connection of its own (as another process would)."""
    if not path.exists():
        return 0
    with sqlite3.connect(path, timeout=5) as db:
        try:
            return int(db.execute("SELECT COUNT(*) FROM answers").fetchone()[0])
        except sqlite3.OperationalError:  # the table is not created yet
            return 0


def test_answers_are_stored_once_and_reused(served: ManagedServer, tmp_path: Path) -> None:
    docs = _documents(6)
    with (
        OpenAICompatibleClient(served.base_url, served.model_name, max_concurrency=4) as client,
        GenerationStore(tmp_path) as store,
    ):
        prompts = build_prompts(docs, TEMPLATE, SYSTEM, client.identity, PARAMS, generations_per_prompt=2)
        first, stats = generate_teacher_samples(client, prompts, PARAMS, store)
        assert (stats.requested, stats.reused, stats.generated, stats.failed) == (12, 0, 12, 0)
        assert first["sample_id"].is_unique and first["error"].isna().all()
        assert list(first["sample_id"]) == [
            p.sample_id for p in prompts
        ]  # prompt order, not completion order
        assert stats.completion_tokens == first["completion_tokens"].sum() > 0 and stats.tokens_per_s > 0
        assert store.count(DAY) == 12

        again, stats = generate_teacher_samples(client, prompts, PARAMS, store)
        assert (stats.reused, stats.generated, stats.completion_tokens) == (12, 0, 0)
        pd.testing.assert_frame_equal(again, first)  # the stored answers, as they were

        # a third generation per prompt: only the new keys are asked for
        more = build_prompts(docs, TEMPLATE, SYSTEM, client.identity, PARAMS, generations_per_prompt=3)
        _, stats = generate_teacher_samples(client, more, PARAMS, store)
        assert (stats.reused, stats.generated) == (12, 6)
        # changed sampling settings or model: every key is new (checked on the keys, no request needed)
        hotter = SamplingParams(24, 1.0, 0.95, 7)
        assert not {
            p.sample_id for p in build_prompts(docs, TEMPLATE, SYSTEM, client.identity, hotter, 2)
        } & {p.sample_id for p in prompts}
        assert not {p.sample_id for p in build_prompts(docs, TEMPLATE, SYSTEM, "other-model", PARAMS, 2)} & {
            p.sample_id for p in prompts
        }
        # the same prompt listed twice is asked and returned once
        doubled, stats = generate_teacher_samples(client, prompts + prompts[:3], PARAMS, store)
        assert len(doubled) == 12 and stats.requested == 12


@pytest.mark.slow
def test_server_killed_mid_partition_and_restarted(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="nexa_dagster.core.llm.openai_compat")
    docs = _documents(16)
    server = ManagedServer(tiny_model_dir, tmp_path / "logs", port=free_port(), continuous_batching=True)
    store_file = tmp_path / "store" / f"{DAY}.sqlite"
    outcome: dict[str, object] = {}
    with server:
        # retries with backoff span well over a server restart (~10 s): 12 retries, 0.5 s doubling to 4 s
        client = OpenAICompatibleClient(
            server.base_url,
            server.model_name,
            max_concurrency=2,
            max_retries=12,
            backoff_s=0.5,
            max_backoff_s=4.0,
            timeout_s=60,
        )
        prompts = build_prompts(docs, TEMPLATE, SYSTEM, client.identity, SamplingParams(48, 0.8, 0.95, 3), 2)

        def run() -> None:
            with GenerationStore(tmp_path / "store") as store:
                outcome["result"] = generate_teacher_samples(
                    client, prompts, SamplingParams(48, 0.8, 0.95, 3), store
                )

        worker = threading.Thread(target=run)
        worker.start()
        deadline = time.monotonic() + 120
        while _stored(store_file) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.pid is not None
        os.killpg(server.pid, signal.SIGKILL)  # the whole server, mid-partition, no goodbye
        at_kill = _stored(store_file)
        server.stop()  # reap it
        time.sleep(1.0)  # some requests now fail and back off
        server.start()  # same port: the retries find it again
        worker.join(timeout=300)
        client.close()
    assert not worker.is_alive()
    assert 4 <= at_kill < len(prompts), (
        f"the kill did not land mid-partition ({at_kill}/{len(prompts)} stored)"
    )
    assert any("retry" in r.getMessage() and "cannot reach" in r.getMessage() for r in caplog.records)
    frame, stats = outcome["result"]  # type: ignore[misc]
    assert stats.failed == 0 and frame["error"].isna().all()
    assert sorted(frame["sample_id"]) == sorted(p.sample_id for p in prompts)  # every key, exactly once
    with GenerationStore(tmp_path / "store") as store:
        assert store.keys(DAY) == {p.sample_id for p in prompts}


# -- the materializing process is killed -----------------------------------------------------------------------------
MATERIALIZE = """
import json, sys
import dagster as dg
from nexa_dagster.assets.distill import teacher_samples
from nexa_dagster.assets.distill import sample_gate
from nexa_dagster.assets.ingest import raw_documents
from nexa_dagster.resources.io_manager import NexaIOManager
from nexa_dagster.resources.llm import OpenAILLM
from nexa_dagster.definitions import config_resources
from nexa_dagster.resources.storage import StorageResource

root, landing, url, model, with_gate = sys.argv[1:6]
llm = OpenAILLM(base_url=url, model=model, max_concurrency=2, max_retries=1)
assets = [raw_documents, teacher_samples] + ([sample_gate] if with_gate == "1" else [])
result = dg.materialize(assets, partition_key=sys.argv[6], resources={
    "io_manager": NexaIOManager(data_root=root), "storage": StorageResource(data_root=root, landing_root=landing),
    "teacher_llm": llm, "judge_llm": llm, **config_resources()})
out = {"success": result.success, "checks": {}}
for event in result.get_asset_materialization_events():
    mat = event.event_specific_data.materialization
    out[mat.asset_key.to_user_string()] = {k: v.value for k, v in mat.metadata.items()
                                           if isinstance(v.value, (int, float, str))}
for check in result.get_asset_check_evaluations():
    out["checks"][f"{check.asset_key.to_user_string()}:{check.check_name}"] = [check.passed, str(check.severity)]
print("RESULT " + json.dumps(out), flush=True)
"""


def _materialize(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", MATERIALIZE, *args],
        env=env,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _result(proc: subprocess.Popen[str]) -> dict:
    out, err = proc.communicate(timeout=420)
    assert proc.returncode == 0, err[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, err[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.slow
def test_kill_9_of_the_materializing_process_then_rerun(served: ManagedServer, tmp_path: Path) -> None:
    landing = tmp_path / "landing"
    shutil.copytree(SAMPLE_LANDING / DAY, landing / DAY)
    root = tmp_path / "data"
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    (tmp_path / "home").mkdir()
    store_file = root / "generation_store" / "teacher_samples" / f"{DAY}.sqlite"
    args = [str(root), str(landing), served.base_url, served.model_name]

    proc = _materialize([*args, "0", DAY], env)
    deadline = time.monotonic() + 240
    while _stored(store_file) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, (
        "the materialization ended before it could be killed: " + proc.stderr.read()[-2000:]
    )
    os.killpg(proc.pid, signal.SIGKILL)  # kill -9, no cleanup of any kind
    proc.wait()
    before_rerun = _stored(store_file)
    assert not (root / "assets" / "teacher_samples" / f"{DAY}.parquet").exists()

    # the rerun also gates the day, with the tiny random model as the judge: its verdicts are garbage
    out = _result(_materialize([*args, "1", DAY], env))
    teacher = out["teacher_samples"]
    rows = teacher["dagster/row_count"]
    assert 3 <= before_rerun < rows or before_rerun == rows  # killed with part of the partition paid for
    assert teacher["reused"] == before_rerun > 0 and teacher["generated"] == rows - before_rerun
    assert teacher["failed_requests"] == 0 and teacher["tokens_per_s"] > 0
    frame = pd.read_parquet(root / "assets" / "teacher_samples" / f"{DAY}.parquet")
    assert frame["sample_id"].is_unique and len(frame) == rows

    # an uninterrupted run over the same documents has exactly the same keys
    docs = pd.read_parquet(root / "assets" / "raw_documents" / f"{DAY}.parquet")
    scale = load_scale()
    params = SamplingParams(
        scale.teacher.max_new_tokens, scale.teacher.temperature, scale.teacher.top_p, scale.teacher.seed
    )
    with (
        OpenAICompatibleClient(served.base_url, served.model_name, max_concurrency=4) as client,
        GenerationStore(tmp_path / "uninterrupted") as store,
    ):
        prompts: list[PromptSpec] = build_prompts(
            docs, TEMPLATE, SYSTEM, client.identity, params, scale.generations_per_prompt
        )
        clean, stats = generate_teacher_samples(client, prompts, params, store)
    assert stats.reused == 0 and sorted(clean["sample_id"]) == sorted(frame["sample_id"])

    # garbage judge: nothing passes, what reached the judge is judge_error, the run itself succeeds
    assert out["success"]
    assert out["filtered_samples"]["dagster/row_count"] == 0
    rejected = pd.read_parquet(root / "assets" / "rejected_samples" / f"{DAY}.parquet")
    assert len(rejected) == rows
    judged = rejected[rejected["judge_method"].notna()]
    assert len(judged) > 0 and judged["reason"].str.startswith("judge_error").all()
    assert (judged["judge_method"] == "text").all() and judged["judge_score"].isna().all()
    assert out["rejected_samples"]["judge_errors"] == len(judged)
    assert out["checks"]["filtered_samples:pass_rate_in_band"] == [False, "AssetCheckSeverity.WARN"]
    assert set(out["checks"]) == {
        "filtered_samples:pass_rate_in_band",
        "filtered_samples:judge_prefers_real_answers",  # undecided here: no verdict to rank against
    }  # the schema is the tables' Dagster type


def test_a_garbage_judge_passes_nothing(served: ManagedServer) -> None:
    good = (
        "A context manager sets something up before a block runs and tears it down after, even when the "
        "block raises. Example: with open(path) as f: data = f.read() closes the file for you."
    )
    frame = pd.DataFrame(
        {
            "sample_id": ["g0", "g1"],
            "doc_id": ["d", "d"],
            "day": [DAY, DAY],
            "generation_index": [0, 1],
            "system_prompt": ["", ""],
            "prompt": ["Explain the with statement."] * 2,
            "response": [good, good.replace("context manager", "with-block helper")],
            "reasoning": [None, None],
            "model": ["m", "m"],
            "prompt_tokens": [5, 5],
            "completion_tokens": [40, 40],
            "latency_s": [0.1, 0.1],
            "finish_reason": ["stop", "stop"],
            "error": [None, None],
        }
    )
    config = load_gate_config("filters.yaml")
    config = config.model_copy(
        update={
            "judge": config.judge.model_copy(update={"min_score": 1.0, "retries": 1}),
            "dedup": config.dedup.model_copy(update={"enabled": False}),
        }
    )
    with OpenAICompatibleClient(served.base_url, served.model_name, max_concurrency=2) as judge:
        result = apply_sample_gate(
            frame, config, judge, read_text("prompts/judge.jinja"), read_text("prompts/judge_verdict.jinja")
        )
    assert result.judge_method == "text"  # transformers serve honours neither response_format nor logprobs
    assert result.judge_capabilities == {
        "engine": "openai-compatible",
        "logprobs": False,
        "json_schema": False,
    }
    assert result.filtered.empty and len(result.rejected) == 2
    assert result.rejected["reason"].str.startswith("judge_error: no valid verdict after 2 attempts").all()
    assert result.judge_attempts == 4  # each verdict asked twice (retries: 1) before giving up


def test_the_same_data_at_two_paths_gives_the_same_ids_and_dataset_and_a_moved_root_pays_nothing(
    tiny_model_dir: Path, tiny_tokenizer, tmp_path: Path
) -> None:
    """Issue 17.2: a sample's id hashes what the teacher is, not where its directory lies.

    Two checkouts at different paths, each with its own copy of the same teacher, generate independently: the
    same sample ids, and the packaged dataset has the same bytes. Moving a data root elsewhere keeps every stored
    answer usable (0 generated).
    """
    from nexa_dagster.core.llm.model_identity import model_fingerprint
    from nexa_dagster.core.packaging.sft_dataset import build_sft_dataset
    from nexa_dagster.resources.llm import LocalLLM

    docs = _documents(4)
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=7)

    def checkout(data_root: Path) -> tuple[pd.DataFrame, int, bytes]:
        with (
            LocalLLM(model=str(data_root / "models" / "tiny-teacher"), batch_size=4).get_client() as client,
            GenerationStore(data_root / "store") as store,
        ):
            prompts = build_prompts(docs, TEMPLATE, SYSTEM, client.identity, params, generations_per_prompt=1)
            frame, stats = generate_teacher_samples(client, prompts, params, store)
        dataset, _ = build_sft_dataset(
            frame,
            tiny_tokenizer,
            str(data_root / "models" / "tiny-teacher"),
            str(data_root / "sft"),
            pack_size=256,
            validation_fraction=0.25,
        )
        return (
            frame,
            stats.generated,
            (Path(dataset.train_path).read_bytes() + Path(dataset.validation_path).read_bytes()),
        )

    roots = [tmp_path / "alice" / "nexa" / "data", tmp_path / "bob" / "checkouts" / "nexa-2" / "data"]
    for root in roots:
        shutil.copytree(tiny_model_dir, root / "models" / "tiny-teacher")
    (a, generated_a, bytes_a), (b, generated_b, bytes_b) = checkout(roots[0]), checkout(roots[1])
    assert generated_a == generated_b == 4
    assert list(a["sample_id"]) == list(b["sample_id"])
    assert (a["model"] == model_fingerprint(tiny_model_dir)).all()  # answers name the model, not a path
    assert bytes_a == bytes_b and len(bytes_a) > 0

    moved = tmp_path / "mounted" / "elsewhere" / "data"
    shutil.move(roots[0], moved)
    again, generated, bytes_moved = checkout(moved)
    assert generated == 0  # every stored answer is reused: nothing paid for twice
    assert list(again["sample_id"]) == list(a["sample_id"]) and bytes_moved == bytes_a
