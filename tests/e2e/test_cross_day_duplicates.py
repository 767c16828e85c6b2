"""The same documents landed on two days, both days processed at once: neither day's dedup sees the other's ids
(a day is compared with the days that finished before it), so both keep the same samples. Packaging then keeps
each repeated sample (and document) once, from the earlier day, counts what it left out, and the training's
dataset (and the pretraining corpus) builds instead of failing.

Two `dagster asset materialize` processes run the two days concurrently in one sandbox, as a backfill's run
workers would; the later day (a few of the earlier day's documents) starts first, so it is judged before the
earlier day has finished and nothing upstream can have dropped the repeats. The sample gate's judge threshold is
lowered in a configuration copy so that the repeated samples are kept on both days (what the gate keeps is not
what this test is about).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import dagster as dg
import pandas as pd
from support.pipeline_runs import configs_with
from support.sandbox import make_sandbox, materialize_command, sandbox_env

from nexa_dagster.core.common.config import REPO_ROOT
from nexa_dagster.core.data.splits import is_held_out
from nexa_dagster.core.packaging.formats.packed_split import split_lines
from nexa_dagster.resources.io_manager import read_stored_artifact

EARLIER, LATER = "2026-11-20", "2026-11-21"
DAILY = "raw_documents,teacher_samples,filtered_samples,rejected_samples"


def _materialize(
    root: Path, select: str, partition: str | None, env: dict[str, str]
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        materialize_command(select, partition),
        env=sandbox_env(root, **env),
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finished(proc: subprocess.Popen[str], timeout_s: float = 900) -> str:
    out, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, out[-5000:]
    return out


def _storage_made(root: Path) -> None:
    """Open the sandbox's instance once and read from each of its storages, which creates their databases."""
    instance = dg.DagsterInstance.from_config(str(root / "home"))
    try:
        instance.get_runs(limit=1)
        instance.all_instigator_state()  # the schedule storage: the database the two processes raced to create
    finally:
        instance.dispose()


def _metadata(root: Path, asset: str) -> dict:
    instance = dg.DagsterInstance.from_config(str(root / "home"))
    try:
        event = instance.get_latest_materialization_event(dg.AssetKey(asset))
        assert event is not None, f"{asset} was not materialized"
        return {k: v.value for k, v in event.asset_materialization.metadata.items()}
    finally:
        instance.dispose()


def test_a_document_on_two_days_processed_at_once_is_packaged_once_from_the_earlier_day(
    tmp_path: Path,
) -> None:
    configs = configs_with(tmp_path / "configs", {"filters.yaml": {"judge.min_score": 1.0}})
    env = {"NEXA_CONFIG_DIR": str(configs)}
    world = make_sandbox(tmp_path / "world", [EARLIER])
    landed = (world / "landing" / EARLIER / "python_reference.jsonl").read_text().splitlines(keepends=True)
    (world / "landing" / LATER).mkdir()
    # four documents landed again, and one new one: a day that holds only documents ingested before is a
    # re-delivered day, which raw_documents' blocking check refuses (tests/unit/assets/test_checks.py)
    new = {
        "title": "zipapp (part 1)",
        "text": "The zipapp module provides tools to manage the creation of zip files containing Python code, "
        "which can be executed directly by the Python interpreter. The module provides both a command-line "
        "interface and a Python API. An archive is created from a directory holding a __main__.py file, and the "
        "interpreter line, the compression and the target name can each be chosen when the archive is built.",
        "url": "https://docs.python.org/3/library/zipapp",
    }
    (world / "landing" / LATER / "python_reference.jsonl").write_text(
        "".join(landed[:4]) + json.dumps(new) + "\n"
    )

    # the instance's SQLite databases made (and migrated) once, before the two processes open them: two processes
    # creating a fresh schedule database at once race in alembic's revision check (seen under load in CI)
    _storage_made(world)
    later = _materialize(world, DAILY, LATER, env)
    time.sleep(2)
    earlier = _materialize(world, DAILY, EARLIER, env)
    _finished(later), _finished(earlier)

    assets = world / "data" / "assets"
    docs = {
        d: set(pd.read_parquet(assets / "raw_documents" / f"{d}.parquet")["doc_id"]) for d in (EARLIER, LATER)
    }
    kept = {d: pd.read_parquet(assets / "filtered_samples" / f"{d}.parquet") for d in (EARLIER, LATER)}
    repeated_docs = docs[EARLIER] & docs[LATER]
    repeated = set(kept[EARLIER]["sample_id"]) & set(kept[LATER]["sample_id"])
    assert len(repeated_docs) == 4, docs  # the same documents, ingested on both days
    assert repeated, "no repeated sample was kept on both days: the test needs one to prove anything"

    _finished(_materialize(world, "sft_dataset,pretrain_corpus", None, env))

    sft, corpus = _metadata(world, "sft_dataset"), _metadata(world, "pretrain_corpus")
    assert sft["cross_day_duplicates_dropped"] == len(repeated), sft
    assert corpus["cross_day_duplicates_dropped"] == len(repeated_docs), corpus
    assert corpus["documents"] == len(docs[EARLIER] | docs[LATER]), corpus  # each document once
    dataset = read_stored_artifact(str(world / "data"), "sft_dataset", results_root=str(world / "results"))
    trained_on = [
        json.loads(line)["sample_id"].split("#")[0]
        for split in (dataset.train_jsonl_path, dataset.validation_jsonl_path)
        for line in split_lines(split)
    ]
    for sample_id in repeated:
        expected = (
            0 if is_held_out(sample_id, 0.3) else 1
        )  # eval_set.fraction: on the eval set's side, in none
        assert trained_on.count(sample_id) == expected, sample_id
    # kept from the earlier day: the day files the snapshot packed give each repeated id on that day only
    plan = json.loads(Path(dataset.root, "plan.json").read_text())
    packed_from = {}
    for path in {s["path"] for s in plan["shards"] if s["source"] == "filtered_samples"}:
        for line in Path(path).read_text().splitlines():
            row = json.loads(line)
            packed_from.setdefault(row["sample_id"], []).append(row["day"])
    assert {s: packed_from[s] for s in repeated} == {s: [EARLIER] for s in repeated}
    assert dataset.num_samples + dataset.held_out_samples == len(packed_from)
