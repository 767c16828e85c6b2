"""Packaging shards off this machine: as a Slurm job array on a real (one-node, loopback) Slurm cluster, and the
Kubernetes indexed Job's spec (there is no Kubernetes cluster here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
from services import slurm_cluster
from test_packaging import _blend, _chat_records, _quiet, _settings, _write_jsonl

from nexa_dagster.core import shards as sh
from nexa_dagster.core.packaging_launch import k8s_indexed_job, sbatch_array_script
from nexa_dagster.core.packing import ChatTokenizer
from nexa_dagster.core.sft_dataset import package_sft, process_sft_shard
from nexa_dagster.core.shard_runners import KubernetesIndexedJobRunner, ShardTasksFailed, SlurmArrayRunner
from nexa_dagster.core.shard_task import read_task_file, write_task_file


@pytest.fixture(scope="module")
def slurm() -> Iterator[dict[str, str]]:
    with slurm_cluster() as env, mock.patch.dict(os.environ, env):
        yield env


def _tree(root: Path, skip: str = "") -> dict[str, bytes]:
    """Every file under ``root`` by relative path (what packaging wrote: snapshot, store, receipts, inputs)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not (skip and str(p.relative_to(root)).startswith(skip))}


def test_a_slurm_job_array_packs_the_same_bytes_and_receipts_as_local_processes(
        tiny_tokenizer, tmp_path: Path, slurm: dict[str, str]) -> None:
    path = _write_jsonl(tmp_path / "chat.jsonl", _chat_records(120))
    local = package_sft(_blend(path), tiny_tokenizer, str(tmp_path / "local"), _settings(workers=1), log=_quiet)
    logged: list[str] = []
    runner = SlurmArrayRunner(str(tmp_path / "work"), max_parallel=2, poll_interval_s=0.3)
    on_slurm = package_sft(_blend(path), tiny_tokenizer, str(tmp_path / "slurm"), _settings(runner=runner),
                           log=logged.append)
    assert on_slurm.report.processed == ["000000", "000001", "000002"], on_slurm.report
    submitted = [m for m in logged if m.startswith("submitted Slurm job array")]
    assert submitted and "3 shards, at most 2 at once" in submitted[0], logged
    job_id = submitted[0].split()[4].rstrip(":")
    # each element ran one shard through the task entry point, which found its index in SLURM_ARRAY_TASK_ID
    outputs = sorted((tmp_path / "work").rglob(f"slurm-{job_id}_*.out"))
    assert [p.name for p in outputs] == [f"slurm-{job_id}_{i}.out" for i in range(3)]
    assert all("done in" in p.read_text() for p in outputs), [p.read_text() for p in outputs]
    assert "#SBATCH --array=0-2%2" in next((tmp_path / "work").rglob("shards.sbatch")).read_text()
    # the same files, byte for byte: snapshot, store outputs, receipts (sizes, SHA-256, counts), inputs
    assert _tree(tmp_path / "slurm") == _tree(tmp_path / "local")
    assert on_slurm.run_hash == local.run_hash
    # a second run finds every receipt valid and submits nothing
    logged.clear()
    again = package_sft(_blend(path), tiny_tokenizer, str(tmp_path / "slurm"), _settings(runner=runner),
                        log=logged.append)
    assert not again.report.processed and not any("submitted" in m for m in logged)


def test_a_shard_that_fails_in_the_array_is_named_with_its_output_and_only_it_is_redone(
        tiny_tokenizer, tmp_path: Path, slurm: dict[str, str]) -> None:
    records: list = _chat_records(120)
    records[57] = '{"sample_id": "broken", "messages": '  # shard 000001 holds lines 41-80: line 58 is torn
    path = _write_jsonl(tmp_path / "chat.jsonl", records)
    runner = SlurmArrayRunner(str(tmp_path / "work"), poll_interval_s=0.3)
    with pytest.raises(ShardTasksFailed) as failed:
        package_sft(_blend(path), tiny_tokenizer, str(tmp_path / "out"), _settings(runner=runner), log=_quiet)
    message = str(failed.value)
    assert failed.value.shard_ids == ["000001"], message
    assert "1 of 3 shards did not finish on Slurm" in message
    assert "shard 000001 (chat.jsonl lines 41-80): no receipt" in message
    assert "ended FAILED" in message and "chat.jsonl:58" in message  # the element's own error, from its output
    out = message.split(", output ")[1].split(" ends with")[0]
    assert Path(out).name.endswith("_1.out") and "chat.jsonl:58" in Path(out).read_text()
    # the other shards finished and kept their receipts: the retry (input fixed) submits only shard 1
    records[57] = json.dumps(_chat_records(120)[57])
    _write_jsonl(tmp_path / "chat.jsonl", records)
    logged: list[str] = []
    fixed = package_sft(_blend(path), tiny_tokenizer, str(tmp_path / "out"), _settings(runner=runner),
                        log=logged.append)
    assert fixed.report.processed == ["000001"] and fixed.report.skipped == ["000000", "000002"]
    assert any("submitted Slurm job array" in m and ": 1 shards" in m for m in logged), logged


def test_the_task_file_gives_each_element_the_local_runners_task(tiny_tokenizer, tmp_path: Path) -> None:
    """Runtime values (the packer's ChatTokenizer, tuples included) come back equal; the entry point takes its index
    from JOB_COMPLETION_INDEX (a Kubernetes indexed Job) and writes the receipt the local runner writes."""
    chat = ChatTokenizer.from_hf(tiny_tokenizer, str(tmp_path / "tok.json"))
    path = _write_jsonl(tmp_path / "chat.jsonl", _chat_records(50))
    shards = sh.plan_shards([("chat", [path])], 40)
    local = package_sft(_blend(path), tiny_tokenizer, str(tmp_path / "local"), _settings(incremental=False),
                        log=_quiet)
    config = json.loads((Path(local.root) / "plan.json").read_text())["config"]
    tasks = [sh.ShardTask(s, str(tmp_path / "remote"), sh.shard_key(s, {**config, "side_overrides": {}}),
                          {**config, "side_overrides": {}}, {"chat_tokenizer": chat, "write_jsonl": True})
             for s in shards]
    write_task_file(tasks, process_sft_shard, str(tmp_path / "tasks.json"))
    work, back = read_task_file(str(tmp_path / "tasks.json"))
    assert work is process_sft_shard and back == tasks and back[0].runtime["chat_tokenizer"] == chat
    env = {**os.environ, "JOB_COMPLETION_INDEX": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("SLURM_ARRAY_TASK_ID", None)
    proc = subprocess.run([sys.executable, "-m", "nexa_dagster.core.shard_task", "--plan",
                           str(tmp_path / "tasks.json")], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "shard 000001 (chat.jsonl lines 41-50): done" in proc.stdout
    for name in ("receipts/000001.json", "shards/000001.train.parquet", "shards/000001.validation.jsonl"):
        assert (tmp_path / "remote" / name).read_bytes() == (Path(local.root) / name).read_bytes(), name
    assert not (tmp_path / "remote" / "receipts" / "000000.json").exists()
    with open(path) as handle, pytest.raises(TypeError, match=r"runtime\.handle: a TextIOWrapper cannot be sent"):
        write_task_file([sh.ShardTask(shards[0], "r", "k", {}, {"handle": handle})], process_sft_shard,
                        str(tmp_path / "bad.json"))


def test_sbatch_array_script_and_kubernetes_indexed_job_spec(tmp_path: Path) -> None:
    script = sbatch_array_script(name="nexa-shards-x", python="/opt/venv/bin/python", plan_file="/shared/t.json",
                                 log_dir="/shared/logs", count=12, max_parallel=4, env={"A": "b c"},
                                 partition="cpu", setup_commands=["module load python"])
    lines = script.splitlines()
    assert "#SBATCH --array=0-11%4" in lines and "#SBATCH --partition=cpu" in lines
    assert "#SBATCH --output=/shared/logs/slurm-%A_%a.out" in lines and "export A='b c'" in lines
    assert lines[-1] == "exec /opt/venv/bin/python -m nexa_dagster.core.shard_task --plan /shared/t.json"
    assert lines.index("module load python") < len(lines) - 1
    assert "%" not in sbatch_array_script(name="n", python="p", plan_file="t", log_dir="l", count=3,
                                          env={}).split("--array=")[1].splitlines()[0]
    with pytest.raises(ValueError, match="at least one element"):
        sbatch_array_script(name="n", python="p", plan_file="t", log_dir="l", count=0, env={})

    runner = KubernetesIndexedJobRunner(str(tmp_path), image="registry/nexa:1", namespace="data", parallelism=8,
                                        data_pvc="nexa-data", env={"NEXA_DATA_ROOT": "/data/nexa"}, cpu="2")
    job = runner.job_spec("/data/nexa/sft/cluster/abc/tasks.json", "nexa-shards-abc", 20)
    assert job["apiVersion"] == "batch/v1" and job["kind"] == "Job"
    assert job["metadata"] == {"name": "nexa-shards-abc", "namespace": "data",
                               "labels": {"app.kubernetes.io/name": "nexa-shards"}}
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 20, 8)
    assert spec["backoffLimitPerIndex"] == 1 and spec["maxFailedIndexes"] == 20
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["volumes"] == [{"name": "data", "persistentVolumeClaim": {"claimName": "nexa-data"}}]
    (container,) = pod["containers"]
    assert container["image"] == "registry/nexa:1"
    assert container["command"] == ["python", "-m", "nexa_dagster.core.shard_task", "--plan",
                                    "/data/nexa/sft/cluster/abc/tasks.json"]
    assert container["volumeMounts"] == [{"name": "data", "mountPath": "/data"}]
    assert {"name": "NEXA_DATA_ROOT", "value": "/data/nexa"} in container["env"]
    assert container["resources"]["limits"] == {"cpu": "2", "memory": "4Gi"}
    assert k8s_indexed_job(name="n", image="i", plan_file="p", count=3, parallelism=0)["spec"]["parallelism"] == 3
