"""Packaging shards off this machine: as a Slurm job array on a real (one-node, loopback) Slurm cluster, and the
Kubernetes indexed Job's spec (there is no Kubernetes cluster here)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
from support.packaging_inputs import chat_records, one_source_blend, packaging_settings, quiet, write_jsonl

from nexa_dagster.assets.packaging import shard_runner
from nexa_dagster.core.cluster.kubernetes import k8s_indexed_job
from nexa_dagster.core.cluster.shard_task import read_task_file, write_task_file
from nexa_dagster.core.cluster.slurm import sbatch_array_script
from nexa_dagster.core.packaging import shards as sh
from nexa_dagster.core.packaging.blend import BlendSource, DataBlend, PackagingConfig
from nexa_dagster.core.packaging.packing import ChatTokenizer
from nexa_dagster.core.packaging.pretrain_corpus import PretrainSettings, package_pretrain
from nexa_dagster.core.packaging.sft_dataset import package_sft, process_sft_shard
from nexa_dagster.definitions import config_resources
from nexa_dagster.resources.gpu_cluster import (
    GPUClusterResource,
    KubernetesGPUCluster,
    LocalGPUCluster,
    SlurmGPUCluster,
)
from nexa_dagster.resources.storage import StorageResource

# a Slurm cluster and packaging jobs on it: left out of make test-fast
pytestmark = pytest.mark.slow


def _tree(root: Path, skip: str = "") -> dict[str, bytes]:
    """Every file under ``root`` by relative path (what packaging wrote: snapshot, store, receipts, inputs), with
    ``root`` itself written ``<root>`` (Megatron's blend file lists its shards by absolute path)."""
    return {
        str(p.relative_to(root)): p.read_bytes().replace(str(root).encode(), b"<root>")
        for p in sorted(root.rglob("*"))
        if p.is_file() and not (skip and str(p.relative_to(root)).startswith(skip))
    }


def _docs_blend(path: str) -> DataBlend:
    return DataBlend(name="pt", sources=[BlendSource(name="docs", path=path, transform={"select": ["text"]})])


def _package_on(
    cluster: GPUClusterResource, path: str, data_root: Path, tokenizer, parallelism: int = 0, docs: str = ""
) -> tuple[dg.ExecuteInProcessResult, list[str]]:
    """Package ``path`` (and the documents ``docs`` as a pretraining corpus) in a Dagster step whose shards go where
    the packaging assets' go with ``runner: cluster``."""

    @dg.asset
    def packed(
        context: dg.AssetExecutionContext, gpu_cluster: GPUClusterResource, storage: StorageResource
    ) -> dg.MaterializeResult:
        cfg = PackagingConfig(runner="cluster", cluster_parallelism=parallelism)
        runner = shard_runner(context, cfg, gpu_cluster, storage)
        run = package_sft(
            one_source_blend(path),
            tokenizer,
            storage.path("sft"),
            packaging_settings(runner=runner),
            log=context.log.info,
        )
        if docs:
            package_pretrain(
                _docs_blend(docs),
                tokenizer,
                storage.path("pretrain"),
                PretrainSettings(
                    rows_per_shard=16, runner=shard_runner(context, cfg, gpu_cluster, storage, "pretrain")
                ),
                log=context.log.info,
            )
        return dg.MaterializeResult(
            metadata={
                "processed": run.report.processed,
                "skipped": run.report.skipped,
                "run_hash": run.run_hash,
            }
        )

    instance = dg.DagsterInstance.ephemeral()
    result = dg.materialize(
        [packed],
        resources={"gpu_cluster": cluster, "storage": StorageResource(data_root=str(data_root))},
        instance=instance,
        raise_on_error=False,
    )
    return result, [e.user_message for e in instance.all_logs(result.run_id)]


def test_a_slurm_job_array_packs_the_same_bytes_and_receipts_as_local_processes(
    tiny_tokenizer, tmp_path: Path, slurm: dict[str, str]
) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", chat_records(120))
    docs = write_jsonl(
        tmp_path / "docs.jsonl", [{"text": f"document number {i} " * (i + 1)} for i in range(40)]
    )
    local = package_sft(
        one_source_blend(path),
        tiny_tokenizer,
        str(tmp_path / "local" / "sft"),
        packaging_settings(workers=2),
        log=quiet,
    )
    assert local.report.processed == ["000000", "000001", "000002"]
    package_pretrain(
        _docs_blend(docs),
        tiny_tokenizer,
        str(tmp_path / "local" / "pretrain"),
        PretrainSettings(rows_per_shard=16, workers=2),
        log=quiet,
    )
    cluster = SlurmGPUCluster(poll_interval_s=0.3)
    result, logs = _package_on(cluster, path, tmp_path / "slurm", tiny_tokenizer, parallelism=2, docs=docs)
    assert result.success, logs
    metadata = result.asset_materializations_for_node("packed")[0].metadata
    assert metadata["processed"].value == ["000000", "000001", "000002"]
    submitted = [m for m in logs if m.startswith("submitted Slurm job")]
    assert submitted and any("a Slurm job array of 3 shards, at most 2 at once" in m for m in logs), logs
    job_id = submitted[0].split()[3]
    assert any(f"Slurm job {job_id}: COMPLETED" in m for m in logs), logs  # waited for every element
    # each element ran one shard through the task entry point, which found its index in SLURM_ARRAY_TASK_ID
    work = tmp_path / "slurm" / "sft" / "cluster"
    outputs = sorted(work.rglob(f"slurm-{job_id}_*.out"))
    assert [p.name for p in outputs] == [f"slurm-{job_id}_{i}.out" for i in range(3)]
    assert all("done in" in p.read_text() for p in outputs), [p.read_text() for p in outputs]
    assert "#SBATCH --array=0-2%2" in next(work.rglob("shards.sbatch")).read_text()
    # the same files, byte for byte: snapshot, store outputs, receipts (sizes, SHA-256, counts), inputs
    assert _tree(tmp_path / "slurm" / "sft", skip="cluster") == _tree(tmp_path / "local" / "sft")
    # the pretraining corpus too (Megatron bin/idx shards): a second array of 3 elements
    assert any("a Slurm job array of 3 shards" in m and "pretrain/cluster" in m for m in logs), logs
    assert _tree(tmp_path / "slurm" / "pretrain", skip="cluster") == _tree(tmp_path / "local" / "pretrain")
    assert metadata["run_hash"].value == local.run_hash
    # a second run finds every receipt valid and submits nothing
    again, logs = _package_on(cluster, path, tmp_path / "slurm", tiny_tokenizer)
    assert again.success and not any("submitted" in m for m in logs)
    assert again.asset_materializations_for_node("packed")[0].metadata["skipped"].value == [
        "000000",
        "000001",
        "000002",
    ]


def test_a_shard_that_fails_in_the_array_fails_the_step_naming_it_and_only_it_is_redone(
    tiny_tokenizer, tmp_path: Path, slurm: dict[str, str]
) -> None:
    records: list = chat_records(120)
    records[57] = '{"sample_id": "broken", "messages": '  # shard 000001 holds lines 41-80: line 58 is torn
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    cluster = SlurmGPUCluster(poll_interval_s=0.3)
    result, logs = _package_on(cluster, path, tmp_path, tiny_tokenizer)
    assert not result.success
    (failure,) = result.get_step_failure_events()
    message = failure.event_specific_data.user_failure_data.description
    assert failure.event_specific_data.user_failure_data.metadata["failed_shards"].value == ["000001"]
    assert "1 of 3 shards did not finish on Slurm" in message, message
    assert "shard 000001 (chat.jsonl lines 41-80): no receipt" in message
    assert (
        "_1 ended FAILED" in message and "chat.jsonl:58" in message
    )  # the element's own error, from its output
    out = message.split(", output ")[1].split(" ends with")[0]
    assert Path(out).name.endswith("_1.out") and "chat.jsonl:58" in Path(out).read_text()
    # the other shards finished and kept their receipts: the retry (input fixed) submits only shard 1
    records[57] = json.dumps(chat_records(120)[57])
    write_jsonl(tmp_path / "chat.jsonl", records)
    fixed, logs = _package_on(cluster, path, tmp_path, tiny_tokenizer)
    assert fixed.success, logs
    metadata = fixed.asset_materializations_for_node("packed")[0].metadata
    assert metadata["processed"].value == ["000001"] and metadata["skipped"].value == ["000000", "000002"]
    assert any("a Slurm job array of 1 shards" in m for m in logs), logs


def test_the_task_file_gives_each_element_the_local_runners_task(tiny_tokenizer, tmp_path: Path) -> None:
    """Runtime values (the packer's ChatTokenizer, tuples included) come back equal; the entry point takes its index
    from JOB_COMPLETION_INDEX (a Kubernetes indexed Job) and writes the receipt the local runner writes."""
    chat = ChatTokenizer.from_hf(tiny_tokenizer, str(tmp_path / "tok.json"))
    path = write_jsonl(tmp_path / "chat.jsonl", chat_records(50))
    shards = sh.plan_shards([("chat", [path])], 40)
    local = package_sft(
        one_source_blend(path),
        tiny_tokenizer,
        str(tmp_path / "local"),
        packaging_settings(incremental=False),
        log=quiet,
    )
    config = json.loads((Path(local.root) / "plan.json").read_text())["config"]
    tasks = [
        sh.ShardTask(
            s,
            str(tmp_path / "remote"),
            sh.shard_key(s, {**config, "side_overrides": {}}),
            {**config, "side_overrides": {}},
            {"chat_tokenizer": chat, "write_jsonl": True},
        )
        for s in shards
    ]
    write_task_file(tasks, process_sft_shard, str(tmp_path / "tasks.json"))
    work, back = read_task_file(str(tmp_path / "tasks.json"))
    assert work is process_sft_shard and back == tasks and back[0].runtime["chat_tokenizer"] == chat
    env = {**os.environ, "JOB_COMPLETION_INDEX": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("SLURM_ARRAY_TASK_ID", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "nexa_dagster.core.cluster.shard_task",
            "--plan",
            str(tmp_path / "tasks.json"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "shard 000001 (chat.jsonl lines 41-50): done" in proc.stdout
    for name in ("receipts/000001.json", "shards/000001.train.parquet", "shards/000001.validation.jsonl"):
        assert (tmp_path / "remote" / name).read_bytes() == (Path(local.root) / name).read_bytes(), name
    assert not (tmp_path / "remote" / "receipts" / "000000.json").exists()
    with (
        open(path) as handle,
        pytest.raises(TypeError, match=r"runtime\.handle: a TextIOWrapper cannot be sent"),
    ):
        write_task_file(
            [sh.ShardTask(shards[0], "r", "k", {}, {"handle": handle})],
            process_sft_shard,
            str(tmp_path / "bad.json"),
        )


def test_sbatch_array_script_and_kubernetes_indexed_job_spec(tmp_path: Path) -> None:
    script = sbatch_array_script(
        name="nexa-shards-x",
        python="/opt/venv/bin/python",
        plan_file="/shared/t.json",
        log_dir="/shared/logs",
        count=12,
        max_parallel=4,
        env={"A": "b c"},
        partition="cpu",
        setup_commands=["module load python"],
    )
    lines = script.splitlines()
    assert "#SBATCH --array=0-11%4" in lines and "#SBATCH --partition=cpu" in lines
    assert "#SBATCH --output=/shared/logs/slurm-%A_%a.out" in lines and "export A='b c'" in lines
    assert (
        lines[-1] == "exec /opt/venv/bin/python -m nexa_dagster.core.cluster.shard_task --plan /shared/t.json"
    )
    assert lines.index("module load python") < len(lines) - 1
    assert (
        "%"
        not in sbatch_array_script(name="n", python="p", plan_file="t", log_dir="l", count=3, env={})
        .split("--array=")[1]
        .splitlines()[0]
    )
    with pytest.raises(ValueError, match="at least one element"):
        sbatch_array_script(name="n", python="p", plan_file="t", log_dir="l", count=0, env={})

    # the local backend keeps this machine's processes, whatever packaging.yaml says
    assert LocalGPUCluster().shard_runner(None, str(tmp_path), 4) is None  # type: ignore[arg-type]
    cluster = KubernetesGPUCluster(
        k8s_image="registry/nexa:1",
        k8s_namespace="data",
        k8s_data_pvc="nexa-data",
        env={"NEXA_DATA_ROOT": "/data/nexa"},
    )
    runner = cluster.shard_runner(None, str(tmp_path), 8)  # type: ignore[arg-type]
    job = runner.job_spec("/data/nexa/sft/cluster/abc/tasks.json", "nexa-shards-abc", 20)
    assert job["apiVersion"] == "batch/v1" and job["kind"] == "Job"
    assert job["metadata"] == {
        "name": "nexa-shards-abc",
        "namespace": "data",
        "labels": {"app.kubernetes.io/name": "nexa-shards"},
    }
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 20, 8)
    assert spec["backoffLimitPerIndex"] == 1 and spec["maxFailedIndexes"] == 20
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["volumes"] == [{"name": "data", "persistentVolumeClaim": {"claimName": "nexa-data"}}]
    (container,) = pod["containers"]
    assert container["image"] == "registry/nexa:1"
    assert container["command"] == [
        "python",
        "-m",
        "nexa_dagster.core.cluster.shard_task",
        "--plan",
        "/data/nexa/sft/cluster/abc/tasks.json",
    ]
    assert container["volumeMounts"] == [{"name": "data", "mountPath": "/data"}]
    assert {"name": "NEXA_DATA_ROOT", "value": "/data/nexa"} in container["env"]
    assert container["resources"]["limits"] == {"cpu": "1", "memory": "4Gi"}  # CPU work: no GPU asked
    assert (
        k8s_indexed_job(name="n", image="i", plan_file="p", count=3, parallelism=0)["spec"]["parallelism"]
        == 3
    )


def _filtered_day(day: str, n: int) -> pd.DataFrame:
    """A day's ``filtered_samples`` partition as the judge stage stores it (schema-valid)."""
    records = chat_records(n, seed=int(day[-2:]))
    return pd.DataFrame(
        {
            "sample_id": [f"{day}-{i:04d}" for i in range(n)],
            "doc_id": [f"doc-{day}-{i}" for i in range(n)],
            "day": day,
            "generation_index": 0,
            "system_prompt": "You are a helpful Python tutor.",
            "prompt": [r["messages"][0]["content"] for r in records],
            "response": [r["messages"][1]["content"] for r in records],
            "reasoning": None,
            "model": "teacher",
            "prompt_tokens": 20,
            "completion_tokens": 120,
            "latency_s": 0.5,
            "finish_reason": "stop",
            "error": None,
            "judge_score": 4.0,
            "judge_method": "logprobs",
            "judge_rationale": None,
            "judge_confidence": 0.9,
        }
    )


def test_sft_dataset_sends_its_shards_to_the_slurm_backend_when_packaging_says_cluster(
    tiny_model_dir: Path, tmp_path: Path, slurm: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real asset, with ``runner: cluster`` in packaging.yaml and the Slurm backend: the shards run as a job
    array and the snapshot is the one the local processes make (same run hash, same packed files)."""
    from nexa_dagster.assets.packaging import sft_dataset
    from nexa_dagster.assets.partitions import daily_partitions
    from nexa_dagster.core.common import storage as io
    from nexa_dagster.core.common.config import REPO_ROOT
    from nexa_dagster.resources.scale import ScaleResource

    @dg.asset(key="filtered_samples", partitions_def=daily_partitions)
    def filtered_samples() -> None:  # stored below, where the judge stage stores it
        raise AssertionError("not materialized here")

    def materialize(runner: str, root: Path, cluster: GPUClusterResource) -> tuple[dict, list[str]]:
        configs = tmp_path / f"configs-{runner}"
        shutil.copytree(REPO_ROOT / "configs", configs)
        packaging = (configs / "packaging.yaml").read_text()
        (configs / "packaging.yaml").write_text(
            packaging.replace("runner: local", f"runner: {runner}").replace(
                "rows_per_shard: 5000", "rows_per_shard: 25"
            )
        )
        # the judged samples alone: this test is about where the shards run, not the checkable tasks (whose
        # documents it does not land)
        (configs / "blends" / "sft.yaml").write_text(
            "name: sft-judged-samples\nsources:\n  - {name: filtered_samples, path: 'asset:filtered_samples', "
            "transform: openai_chat}\n"
        )
        monkeypatch.setenv("NEXA_CONFIG_DIR", str(configs))
        shutil.copytree(tiny_model_dir, root / "models" / "tiny-teacher")
        for day, n in (("2026-11-02", 30), ("2026-11-03", 20)):
            io.write_parquet(
                _filtered_day(day, n), str(root / "assets" / "filtered_samples" / f"{day}.parquet")
            )
        instance = dg.DagsterInstance.ephemeral()
        result = dg.materialize(
            [filtered_samples, sft_dataset],
            selection=[sft_dataset],
            instance=instance,
            resources={
                "storage": StorageResource(data_root=str(root)),
                "gpu_cluster": cluster,
                **config_resources(),
                "scale_preset": ScaleResource(name="tiny"),
            },
        )
        logs = [e.user_message for e in instance.all_logs(result.run_id)]
        assert result.success, logs
        return result.asset_materializations_for_node("sft_dataset")[0].metadata, logs

    on_slurm, logs = materialize("cluster", tmp_path / "slurm", SlurmGPUCluster(poll_interval_s=0.3))
    assert any("a Slurm job array of 3 shards" in m for m in logs), (
        logs
    )  # 30 + 20 rows, <= 25 per shard, per day
    assert any(m.startswith("submitted Slurm job") for m in logs)
    local, logs = materialize("local", tmp_path / "local", SlurmGPUCluster(poll_interval_s=0.3))
    assert not any("Slurm" in m for m in logs), (
        logs
    )  # runner: local keeps the processes, whatever the backend
    assert on_slurm["run_hash"].value == local["run_hash"].value and on_slurm["num_shards"].value == 3
    # the snapshots' manifests: every shard's receipt (outputs with size and SHA-256), in order, byte for byte
    manifests = [Path(m["train_path"].value).parent / "snapshot.json" for m in (on_slurm, local)]
    assert manifests[0].read_bytes() == manifests[1].read_bytes()
