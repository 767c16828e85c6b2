"""Training with the real DeepSpeed engine (CPU, gloo) in its own process, and its launch through Dagster Pipes.

Every test trains or launches for real: the worker is a subprocess exactly as in production, the data is packed
Parquet in the packaging stage's format (written here with random token ids), the model is the tiny preset.
"""

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import dagster as dg
import pandas as pd
import psutil
import pytest
from support.checkpoint_files import assert_portable_checkpoint
from support.planted_secrets import PLANTED, environ_of, leaked
from support.services import descendants_matching
from support.training_jobs import end_process_group, launch_training_in_dagster, make_job
from support.worker_launch import run_worker_command

from nexa_dagster.core.common.artifacts import COMPLETION_MARKER
from nexa_dagster.core.common.config import load_deepspeed_config
from nexa_dagster.core.evaluation.worker import EvaluationJob
from nexa_dagster.core.training.job import TrainingJob, TrainingResult
from nexa_dagster.resources.gpu_cluster import (
    GPUClusterResource,
    KubernetesGPUCluster,
    LocalGPUCluster,
    SlurmGPUCluster,
)

WORKER = [sys.executable, "-m", "nexa_dagster.core.training.worker"]


# -- helpers ----------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def host_reads_by_the_loop() -> Iterator[list[str]]:
    """Record each read of a tensor's value to the host (``item``, ``bool``, ``float``, ``int``, ``tolist``, ``cpu``,
    ``numpy``) made by the training loop's own code, except the token counts the data loader keeps on the host."""
    import torch

    from nexa_dagster.core.training import lm_objective, loop, nonfinite, objective

    ours = {loop.__file__, nonfinite.__file__, lm_objective.__file__, objective.__file__}
    reads: list[str] = []

    def recording(name: str) -> Callable[..., Any]:
        original = getattr(torch.Tensor, name)

        def read(self: Any, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            if caller.f_code.co_filename in ours and not getattr(self, "_host_count", False):
                reads.append(f"{name} at {Path(caller.f_code.co_filename).name}:{caller.f_lineno}")
            return original(self, *args, **kwargs)

        return read

    names = ("item", "__bool__", "__float__", "__int__", "__index__", "tolist", "cpu", "numpy")
    with contextlib.ExitStack() as patches:
        for name in names:
            patches.enter_context(mock.patch.object(torch.Tensor, name, recording(name)))
        yield reads


def host_counts_marked(batches: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The batches, their host-side token counts marked as such (reading them waits for nothing)."""
    from nexa_dagster.core.training.data import HOST_KEYS

    for batch in batches:
        for key in HOST_KEYS:
            batch[key]._host_count = True
        yield batch


def run_worker(
    job: TrainingJob, tmp_path: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The worker on ``job``, forked from this pytest process's warm Python where it can be (``support.
    worker_launch``): its stdout and stderr together in ``stdout``."""
    job_file = tmp_path / "job.json"
    job_file.write_text(job.model_dump_json())
    return run_worker_command([*WORKER, "--job", str(job_file)], env=env, timeout=300)


def summary_of(job: TrainingJob) -> TrainingResult:
    return TrainingResult.model_validate_json((Path(job.output_dir) / "training_summary.json").read_text())


# -- the worker -------------------------------------------------------------------------------------------------
def test_worker_trains_with_deepspeed_and_saves_a_loadable_hf_checkpoint(
    tmp_path: Path, teacher_dir: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    job = make_job(tmp_path, teacher_dir, steps=6)
    proc = run_worker(job, tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "step 6/6 loss" in proc.stdout and "ZeRO stage 1" in proc.stdout

    ckpt = Path(job.output_dir)
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "training_summary.json",
        "metrics.jsonl",
        COMPLETION_MARKER,
    ):
        assert (ckpt / name).exists(), name
    assert [p.name for p in ckpt.parent.iterdir()] == [ckpt.name], "a temporary directory was left behind"
    assert_portable_checkpoint(ckpt)  # what transformers 4.x (and vLLM builds pinned to it) read the same way
    result = summary_of(job)
    assert result.steps == 6 and [s for s, _ in result.loss_curve] == [1, 2, 4, 6]
    assert all(math.isfinite(v) for v in (result.first_loss, result.final_loss, result.validation_loss))
    assert result.tokens_seen > 0 and result.tokens_per_s > 0
    assert 0 < result.parameters_active < result.parameters_total
    metrics = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 4, 6] and all(m["grad_norm"] > 0 for m in metrics)

    model = AutoModelForCausalLM.from_pretrained(ckpt)
    assert model.config.model_type == "mixtral" and not model.config.output_router_logits
    ids = AutoTokenizer.from_pretrained(ckpt)("def f(x): return x", return_tensors="pt")
    with torch.no_grad():
        assert torch.isfinite(model(**ids).logits).all()


def test_training_fits_a_tiny_batch_seen_over_and_over(tmp_path: Path, teacher_dir: Path) -> None:
    """Two sequences, twelve steps, a high learning rate: the real engine must drive the loss well down."""
    job = make_job(tmp_path, teacher_dir, steps=12, rows=2, lr=1e-2, log_every=4)
    proc = run_worker(job, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = summary_of(job)
    assert result.steps == 12
    assert result.final_loss < result.first_loss - 1.0, result.loss_curve


def test_progress_reaches_the_log_on_the_clock_between_metric_lines(
    tmp_path: Path, teacher_dir: Path
) -> None:
    """Metrics only at steps 1 and 20 (log_every 1000), progress every 50 ms: the log still shows the steps in
    between, so a stage with slow steps or a sparse log_every is never silent for longer than progress_every_s."""
    job = make_job(tmp_path, teacher_dir, steps=20, rows=4, log_every=1000, progress_every_s=0.05)
    proc = run_worker(job, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [
        line.split(" loss")[0]
        for line in proc.stdout.splitlines()
        if " loss " in line and line.startswith("step ")
    ] == ["step 1/20", "step 20/20"]
    done = [int(m) for m in re.findall(r"^training steps: (\d+)/20 ", proc.stdout, flags=re.M)]
    assert done and done[-1] == 20 and done == sorted(done), proc.stdout[-2000:]
    assert any(1 < n < 20 for n in done), f"no progress line between the metric lines: {done}"


def test_worker_refuses_an_unusable_job_file(tmp_path: Path) -> None:
    (tmp_path / "job.json").write_text('{"run_id": "x"}')
    proc = run_worker_command([*WORKER, "--job", str(tmp_path / "job.json")], timeout=120)
    assert proc.returncode == 2 and "invalid training job" in proc.stdout


# -- the loss of a step: weighted by tokens, checked before the update ------------------------------------------
def test_a_step_weighs_rows_by_their_tokens_and_a_nan_never_reaches_the_weights(
    tmp_path: Path, teacher_dir: Path
) -> None:
    """The real DeepSpeed engine in this process (one gloo rank), two micro-batches of one packed row each, one row
    with 3 learned tokens and one with ~40: the step's gradient is that of the token mean over the whole batch
    (torchtitan style), not the mean of the two rows' means, which gives a clearly different gradient. Then a NaN
    loss: the step raises, no weight moves, and neither step read a tensor back to the host from the loop (on a GPU
    each such read waits for the GPU): the check is an on-device flag plus the host flag DeepSpeed leaves."""
    import torch
    from transformers import AutoTokenizer

    from nexa_dagster.core.training.data import Prefetcher, labels_for, load_packed, micro_batches
    from nexa_dagster.core.training.lm_objective import LanguageModelLoss
    from nexa_dagster.core.training.loop import Control, build_engine, build_model, optimizer_step
    from nexa_dagster.core.training.nonfinite import NonFiniteGuard
    from nexa_dagster.core.training.worker import configure_environment

    job = make_job(tmp_path, teacher_dir, steps=2, rows=2)
    job = job.model_copy(
        update={
            "settings": job.settings.model_copy(
                update={"micro_batch_size": 1, "gradient_accumulation_steps": 2}
            )
        }
    )
    data = load_packed(job.train_path)
    del data["labels"]  # labels_for derives them from the loss mask edited here
    data["loss_mask"][0] = 0
    data["loss_mask"][0, 5:8] = 1  # row 0: three learned tokens (positions 5-7 are inside its first document)
    assert (
        0
        < int(labels_for(data)[0, 1:].ne(-100).sum())
        <= 3
        < 20
        < int(labels_for(data)[1, 1:].ne(-100).sum())
    )
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)

    def reference_grad_norm(token_weighted: bool) -> float:
        model = build_model(job, len(tokenizer), tokenizer)
        outs = [
            model(
                input_ids=data["input_ids"][i : i + 1],
                position_ids=data["position_ids"][i : i + 1],
                labels=labels_for({k: v[i : i + 1] for k, v in data.items()}),
            )
            for i in range(2)
        ]
        aux = sum(o.aux_loss for o in outs) / 2 * model.config.router_aux_loss_coef
        if token_weighted:
            tokens = sum(int(labels_for(data)[i, 1:].ne(-100).sum()) for i in range(2))
            lm = sum(o.lm_loss_sum for o in outs) / tokens
        else:
            lm = sum(o.lm_loss for o in outs) / 2
        (lm + aux).backward()
        return float(
            torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
        )

    weighted, per_row = reference_grad_norm(True), reference_grad_norm(False)
    assert abs(weighted - per_row) > 0.05 * weighted, "the data does not tell the two weightings apart"

    with mock.patch.dict(os.environ):  # MASTER_PORT & co. must not leak into later tests' worker processes
        configure_environment(job)
        try:
            engine = build_engine(build_model(job, len(tokenizer), tokenizer), job, world_size=1)
            batches = Prefetcher(
                host_counts_marked(micro_batches(data, 1, job.settings.seed, 0, 1)),
                torch.device("cpu"),
                depth=0,
            )
            control, guard = Control(1), NonFiniteGuard(engine, torch.device("cpu"))
            objective = LanguageModelLoss(data, data, micro_batch=1)
            with host_reads_by_the_loop() as reads:
                optimizer_step(engine, batches, 2, control, guard, 1, objective)
            assert engine.get_global_grad_norm() == pytest.approx(weighted, rel=1e-4), (weighted, per_row)
            assert reads == [], "the loop read a tensor back to the host during a step that logs nothing"

            before = [p.detach().clone() for p in engine.module.parameters()]
            with (
                host_reads_by_the_loop() as reads,
                pytest.raises(
                    FloatingPointError, match="non-finite loss at step 2 .caught before its update"
                ),
            ):
                optimizer_step(engine, batches, 2, control, guard, 2, objective, poison=True)
            # reported from the flag DeepSpeed's own overflow check left on the host (fp32 ZeRO used to skip the
            # update silently), without a host read of the loop's own
            assert reads == [], reads
            assert engine.skipped_steps == 1 and not engine.was_step_applied()
            assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True))
            # the on-device flag kept the first bad step; a later log step reads it (fp16, where a skipped step is
            # the loss scaler's, relies on this) and names that step
            with pytest.raises(FloatingPointError, match="non-finite loss at step 2 .seen at step 4"):
                guard.check(4)
        finally:
            end_process_group()  # and DeepSpeed's cached groups: the next in-process engine starts clean


# -- through Dagster ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_dagster_asset_trains_through_the_gpu_cluster_resource_with_pipes(
    tmp_path: Path, teacher_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Also: each worker line reaches the console once (the run log's console logger), not a second time through
    the worker's stdout, which a local worker shares with the Dagster process."""
    job = make_job(tmp_path, teacher_dir, steps=3, log_every=1)

    @dg.asset
    def trained(context: dg.AssetExecutionContext, gpu_cluster: GPUClusterResource) -> dg.MaterializeResult:
        result, invocation = gpu_cluster.run_training(context, job, tmp_path / "work")
        assert invocation.get_custom_messages()[-1]["run_id"] == result.run_id
        return invocation.get_materialize_result()

    instance = dg.DagsterInstance.ephemeral()
    res = dg.materialize([trained], resources={"gpu_cluster": LocalGPUCluster()}, instance=instance)
    assert res.success
    metadata = res.asset_materializations_for_node("trained")[0].metadata
    result = summary_of(job)
    assert metadata["steps"].value == 3
    assert metadata["final_loss"].value == pytest.approx(result.final_loss, abs=1e-4)
    assert math.isfinite(metadata["validation_loss"].value)
    assert metadata["checkpoint_dir"] == dg.MetadataValue.path(job.output_dir)
    logs = [e.user_message for e in instance.all_logs(res.run_id)]
    assert any("step 3/3 loss" in m for m in logs), (
        "worker progress did not stream into the run through Pipes"
    )
    console = "".join(capfd.readouterr())
    assert console.count("step 3/3 loss") == 1, [line for line in console.splitlines() if "step 3/3" in line]


@pytest.mark.slow
def test_two_ranks_under_torchrun_train_one_model_and_zero3_trains_like_it(
    tmp_path: Path, teacher_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """num_procs=2 launches torchrun: two gloo ranks share each global batch, only rank 0 reports and saves. On a
    machine where nothing was compiled yet (an empty torch extensions folder), DeepSpeed compiles nothing: its CPU
    shared-memory op serves only its inference kernels, and building it cost the first CPU run minutes.

    That run (ZeRO-1, through Dagster) is also the reference of ZeRO-3 (parameters partitioned over the 2 ranks,
    each MoE block gathered as one leaf module): the same losses on the same rows, and the exported checkpoint holds
    the full, gathered weights. One ZeRO-1 run for both (issue 49: the suite ran a second, by torchrun, for ZeRO-3's
    comparison alone)."""
    from transformers import AutoModelForCausalLM

    extensions = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))  # the workers inherit it
    job = make_job(tmp_path, teacher_dir, steps=4, log_every=1, num_procs=2)

    @dg.asset
    def trained(context: dg.AssetExecutionContext, gpu_cluster: GPUClusterResource) -> dg.MaterializeResult:
        return gpu_cluster.run_training(context, job, tmp_path / "work")[1].get_materialize_result()

    res = dg.materialize(
        [trained],
        resources={"gpu_cluster": LocalGPUCluster(num_procs=2)},
        instance=dg.DagsterInstance.ephemeral(),
    )
    assert res.success
    metadata = res.asset_materializations_for_node("trained")[0].metadata
    assert metadata["world_size"].value == 2 and metadata["steps"].value == 4
    assert summary_of(job).world_size == 2 and (Path(job.output_dir) / COMPLETION_MARKER).exists()
    assert sorted(p.name for p in (tmp_path / "work").glob("*.stderr.log")) == [
        "worker.rank0.stderr.log",
        "worker.rank1.stderr.log",
    ]
    # torchrun's own files beside the worker's logs, not in a torchelastic_* folder of the machine's /tmp
    assert list((tmp_path / "work" / "torchrun").glob("*/attempt_0")), list((tmp_path / "work").iterdir())

    (tmp_path / "zero3").mkdir()
    zero3 = make_job(tmp_path / "zero3", teacher_dir, steps=4, log_every=1, num_procs=2, run_id="zero3")
    zero3 = zero3.model_copy(update={"deepspeed_config": load_deepspeed_config("zero3_bf16.json")})
    assert pd.read_parquet(zero3.train_path).equals(pd.read_parquet(job.train_path))  # the same rows
    proc = _torchrun(zero3, tmp_path)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    zero1_losses, zero3_losses = _losses(job), _losses(zero3)
    assert [s for s, _ in zero3_losses] == [1, 2, 3, 4]
    assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(zero1_losses, zero3_losses, strict=True)), (
        zero1_losses,
        zero3_losses,
    )
    model = AutoModelForCausalLM.from_pretrained(zero3.output_dir)
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (4, 256, 64)
    assert model.lm_head.weight.abs().sum() > 0
    assert list(extensions.rglob("*.so")) == [], list(extensions.rglob("*"))


def _failure_description(job: TrainingJob, tmp_path: Path) -> str:
    @dg.asset
    def trained(context: dg.AssetExecutionContext, gpu_cluster: GPUClusterResource) -> dg.MaterializeResult:
        return gpu_cluster.run_training(context, job, tmp_path / "work")[1].get_materialize_result()

    res = dg.materialize(
        [trained],
        resources={"gpu_cluster": LocalGPUCluster()},
        raise_on_error=False,
        instance=dg.DagsterInstance.ephemeral(),
    )
    assert not res.success
    failure = res.get_step_failure_events()[0].step_failure_data.user_failure_data
    assert failure is not None, res.get_step_failure_events()[0].step_failure_data.error
    return failure.description or ""


def test_missing_training_input_fails_naming_the_path(tmp_path: Path, teacher_dir: Path) -> None:
    job = make_job(tmp_path, teacher_dir, steps=2)
    job = job.model_copy(update={"train_path": str(tmp_path / "nope" / "train.parquet")})
    assert str(tmp_path / "nope" / "train.parquet") in _failure_description(job, tmp_path)


def test_worker_failure_is_a_dagster_failure_quoting_its_stderr(tmp_path: Path, teacher_dir: Path) -> None:
    job = make_job(tmp_path, teacher_dir, steps=2)
    pd.DataFrame({"input_ids": [[1, 2, 3]]}).to_parquet(job.train_path)  # not packed: columns missing
    description = _failure_description(job, tmp_path)
    assert "lacks columns ['loss_mask', 'position_ids', 'attention_mask']" in description
    assert "training test-run failed on rank 0: ValueError" in description


@pytest.mark.slow
def test_a_lost_worker_is_retried_and_a_non_finite_loss_is_not(tmp_path: Path, teacher_dir: Path) -> None:
    """moe_checkpoint's retry policy (MODEL_CALL_RETRY) through the real resource: a worker killed with SIGKILL (a
    lost node) is run again and the step succeeds; a non-finite loss fails the step at once, without the three
    relaunches that would each fail the same way."""
    import threading

    from nexa_dagster.assets.common import MODEL_CALL_RETRY

    def materialize(job: TrainingJob, cluster: GPUClusterResource, kill_first: bool) -> tuple[Any, int]:
        @dg.asset(retry_policy=MODEL_CALL_RETRY)
        def trained(
            context: dg.AssetExecutionContext, gpu_cluster: GPUClusterResource
        ) -> dg.MaterializeResult:
            return gpu_cluster.run_training(context, job, Path(job.output_dir).parent / "work")[
                1
            ].get_materialize_result()

        def kill_the_first_worker() -> None:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                for p in psutil.process_iter(["cmdline"]):
                    cmdline = " ".join(p.info["cmdline"] or [])
                    if "nexa_dagster.core.training.worker" in cmdline and job.run_id in cmdline:
                        time.sleep(2)
                        p.kill()
                        return
                time.sleep(0.2)

        killer = threading.Thread(target=kill_the_first_worker, daemon=True)
        if kill_first:
            killer.start()
        res = dg.materialize(
            [trained],
            resources={"gpu_cluster": cluster},
            raise_on_error=False,
            instance=dg.DagsterInstance.ephemeral(),
        )
        retries = [e for e in res.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]
        return res, len(retries)

    (tmp_path / "lost").mkdir()
    lost = make_job(tmp_path / "lost", teacher_dir, steps=3, run_id="lost")
    res, retries = materialize(lost, LocalGPUCluster(), kill_first=True)
    assert res.success and retries == 1, retries
    assert summary_of(lost).steps == 3

    (tmp_path / "nan").mkdir()
    nan = make_job(tmp_path / "nan", teacher_dir, steps=3, run_id="nan")
    res, retries = materialize(nan, LocalGPUCluster(env={"NEXA_FAULT_NAN_AT_STEP": "2"}), kill_first=False)
    assert not res.success and retries == 0, retries
    failure = res.get_step_failure_events()[0].step_failure_data.user_failure_data
    assert "not retried, it would fail again" in failure.description
    assert "non-finite loss at step 2 (caught before its update" in failure.description


def test_a_worker_whose_python_cannot_import_the_project_is_not_retried(
    tmp_path: Path, teacher_dir: Path
) -> None:
    """A checkout moved with its .venv: the interpreter runs, but nexa_dagster is not importable from it (the
    editable install points at the old place), so the worker dies before its first line, writing nothing. A
    relaunch fails the same way: the step fails at once (no retry of MODEL_CALL_RETRY), saying what is wrong.
    Here the interpreter is a real virtual environment without the project installed."""
    from nexa_dagster.assets.common import MODEL_CALL_RETRY

    venv = tmp_path / "venv-elsewhere"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    job = make_job(tmp_path, teacher_dir, steps=2, run_id="moved")

    @dg.asset(retry_policy=MODEL_CALL_RETRY)
    def trained(context: dg.AssetExecutionContext, gpu_cluster: GPUClusterResource) -> dg.MaterializeResult:
        return gpu_cluster.run_training(context, job, tmp_path / "work")[1].get_materialize_result()

    res = dg.materialize(
        [trained],
        resources={"gpu_cluster": LocalGPUCluster(python_executable=str(venv / "bin" / "python"))},
        raise_on_error=False,
        instance=dg.DagsterInstance.ephemeral(),
    )
    retries = [e for e in res.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]
    assert not res.success and retries == [], len(retries)
    failure = res.get_step_failure_events()[0].step_failure_data.user_failure_data
    assert "not retried, it would fail again" in failure.description, failure.description
    assert "No module named 'nexa_dagster'" in failure.description, failure.description
    assert "make install" in failure.description, failure.description


def test_a_wrong_config_fails_before_anything_launches(tmp_path: Path, teacher_dir: Path) -> None:
    """A DeepSpeed value that contradicts the scale preset, or a typo in a model preset: a clear error from the
    launching step, no worker started."""
    job = make_job(tmp_path, teacher_dir, steps=2)
    bad_ds = job.model_copy(
        update={"deepspeed_config": {**job.deepspeed_config, "gradient_accumulation_steps": 7}}
    )
    assert "gradient_accumulation_steps=7 but the scale preset implies 1" in _failure_description(
        bad_ds, tmp_path
    )
    assert not (tmp_path / "work" / "worker.rank0.stderr.log").exists(), "a worker was launched"
    (tmp_path / "configs" / "models").mkdir(parents=True)
    (tmp_path / "configs" / "models" / "typo.yaml").write_text(
        "architecture: MixtralForCausalLM\nhiden_size: 64\n"
    )
    os.environ["NEXA_CONFIG_DIR"] = str(tmp_path / "configs")
    try:
        description = _failure_description(job.model_copy(update={"model_preset": "typo"}), tmp_path)
    finally:
        del os.environ["NEXA_CONFIG_DIR"]
    assert "models/typo.yaml: hiden_size: unknown key" in description


# -- exact resume and the stall watchdog ------------------------------------------------------------------------
def _torchrun(job: TrainingJob, tmp_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    job_file = tmp_path / f"{job.run_id}.json"
    job_file.write_text(job.model_dump_json())
    command = LocalGPUCluster(num_procs=2).worker_command(job_file, tmp_path / f"{job.run_id}-logs")
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )


def as_split_manifest(path: str, root: Path, sizes: list[int]) -> str:
    """The packed file's rows cut into shard files of ``sizes`` rows under ``root/store``, listed in order by a
    split manifest ``root/<run>/train.shards.json`` (what packaging writes for a snapshot)."""
    import pyarrow.parquet as pq

    from nexa_dagster.core.common import storage
    from nexa_dagster.core.packaging.formats.packed_split import split_manifest_path, write_split_manifest

    table, files, start = pq.read_table(path), [], 0
    assert sum(sizes) == table.num_rows
    for k, rows in enumerate(sizes):
        shard = root / "store" / "shards" / f"k{k}.train.parquet"
        shard.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table.slice(start, rows), shard)
        files.append(
            (f"store/shards/{shard.name}", shard.stat().st_size, storage.sha256_file(str(shard)), rows)
        )
        start += rows
    manifest = split_manifest_path(str(root / "run"), "train")
    write_split_manifest(manifest, "train", "run", str(root), files)
    return manifest


def _losses(job: TrainingJob) -> list[tuple[int, float]]:
    lines = (Path(job.output_dir) / "metrics.jsonl").read_text().splitlines()
    return [(m["step"], m["loss"]) for m in map(json.loads, lines)]


def test_a_run_resumed_from_a_state_saved_between_metrics_lines_counts_every_steps_tokens(
    tmp_path: Path, teacher_dir: Path
) -> None:
    """A metrics line every 2 steps, the state every 3: the state of step 3 lies between the lines of steps 2 and
    4. A run that fails at step 4 (its loss made NaN, caught before the update) and is launched again resumes from
    step 3 and counts the tokens of all 6 steps, as the same run uninterrupted does (the summary's tokens_seen, and
    the resumed run's tokens/s that is computed from it); step 3's tokens were lost when the state held only the
    metrics lines' total."""
    base = make_job(tmp_path, teacher_dir, steps=6, log_every=2, checkpoint_every=3)
    straight, resumed = (
        base.model_copy(update={"run_id": name, "output_dir": str(tmp_path / "ckpt" / name)})
        for name in ("straight", "resumed")
    )
    proc = run_worker(straight, tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]

    proc = run_worker(resumed, tmp_path, env={"NEXA_FAULT_NAN_AT_STEP": "4"})
    assert proc.returncode != 0 and "non-finite loss at step 4" in proc.stdout + proc.stderr
    assert (tmp_path / "ckpt" / "resumed.state" / "latest").read_text().strip() == "step00000003"
    proc = run_worker(resumed, tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "resumed from step 3" in proc.stdout
    assert summary_of(resumed).resumed_from_step == 3
    assert summary_of(resumed).tokens_seen == summary_of(straight).tokens_seen > 0


@pytest.mark.slow
def test_a_killed_two_rank_run_resumes_with_the_same_loss_at_every_step(
    tmp_path: Path, teacher_dir: Path
) -> None:
    """2 gloo ranks, state every 3 steps; SIGKILL after the state of step 6 is saved; relaunch: steps 7-9 give
    exactly the losses of an uninterrupted run (model, optimizer, schedule, RNG and data position restored)."""
    base = make_job(tmp_path, teacher_dir, steps=9, rows=12, log_every=1, num_procs=2)
    base = base.model_copy(update={"settings": base.settings.model_copy(update={"checkpoint_every": 3})})
    straight = base.model_copy(
        update={"run_id": "straight", "output_dir": str(tmp_path / "ckpt" / "straight")}
    )
    proc = _torchrun(straight, tmp_path)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]

    # the killed run reads the same rows as a packaging snapshot does: shard files listed by a split manifest
    killed = base.model_copy(
        update={
            "run_id": "killed",
            "output_dir": str(tmp_path / "ckpt" / "killed"),
            "train_path": as_split_manifest(base.train_path, tmp_path / "sft", [5, 4, 3]),
        }
    )
    proc = _torchrun(
        killed, tmp_path, env={"NEXA_FAULT_STALL_AT_STEP": "7"}
    )  # hangs after step 7, state at 6
    latest = tmp_path / "ckpt" / "killed.state" / "latest"
    deadline = time.monotonic() + 240
    while not (latest.exists() and latest.read_text().strip() == "step00000006"):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    time.sleep(1.0)  # the ranks are now in step 7
    ranks = descendants_matching(proc.pid, "nexa_dagster.core.training.worker")
    assert len(ranks) == 2, [p.cmdline() for p in ranks]
    assert {os.getpgid(p.pid) for p in ranks}.isdisjoint({proc.pid}), (
        "ranks share torchrun's group: test is moot"
    )
    os.killpg(proc.pid, signal.SIGKILL)  # torchrun's group only: the ranks are in sessions of their own
    proc.wait(timeout=30)
    _, alive = psutil.wait_procs(ranks, timeout=15)
    assert not alive, f"ranks {[p.pid for p in alive]} outlived their killed launcher"
    assert not (Path(killed.output_dir) / COMPLETION_MARKER).exists()

    proc = _torchrun(killed, tmp_path)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "resumed from step 6" in out
    assert summary_of(killed).resumed_from_step == 6
    assert [s for s, _ in _losses(killed)] == list(range(1, 10))
    assert _losses(killed) == _losses(straight)
    assert not (tmp_path / "ckpt" / "killed.state").exists(), "a finished run's resume state is deleted"


@pytest.mark.slow
def test_sigterm_to_torchrun_reaches_both_ranks_which_save_their_state_and_stop(
    tmp_path: Path, teacher_dir: Path
) -> None:
    """What Slurm sends before the time limit (and Kubernetes on a pod's deletion) to the step's task, here
    ``torchrun``: it forwards SIGTERM to its ranks, which agree on the stop, save the resumable state together and exit
    75 (the 1-rank path through sbatch is tested in test_slurm.py)."""
    job = make_job(tmp_path, teacher_dir, steps=100_000, rows=12, log_every=1, num_procs=2)
    proc = _torchrun(job, tmp_path)
    assert proc.stdout is not None
    seen = ""
    deadline = time.monotonic() + 240
    while "step 2/" not in seen:
        assert proc.poll() is None and time.monotonic() < deadline, seen[-3000:]
        seen += proc.stdout.readline()
    proc.send_signal(signal.SIGTERM)
    out = seen + proc.communicate(timeout=120)[0]
    assert proc.returncode != 0
    saved = re.search(r"saved resumable state at step (\d+); stopping as asked", out)
    assert saved, out[-3000:]
    logs = tmp_path / f"{job.run_id}-logs"
    for rank in (0, 1):
        assert "SIGTERM: saving the resumable state" in (logs / f"worker.rank{rank}.stderr.log").read_text()
        assert json.loads((logs / f"worker.rank{rank}.failure.json").read_text())["retryable"] is True
    state = Path(job.output_dir).with_name(f"{job.run_id}.state")
    assert (state / "latest").read_text().strip() == f"step{int(saved.group(1)):08d}"


@pytest.mark.slow
def test_a_stalled_step_fails_the_run_with_diagnostics(tmp_path: Path, teacher_dir: Path) -> None:
    job = make_job(tmp_path, teacher_dir, steps=5, log_every=1)
    job = job.model_copy(update={"settings": job.settings.model_copy(update={"stall_timeout_s": 3.0})})
    job_file = tmp_path / "job.json"
    job_file.write_text(job.model_dump_json())
    proc = run_worker_command([*WORKER, "--job", str(job_file)], env={"NEXA_FAULT_STALL_AT_STEP": "2"})
    assert proc.returncode == 3, proc.stdout[-3000:]
    assert "STALL: no training step completed" in proc.stdout and "last completed step 2" in proc.stdout
    assert 'File "' in proc.stdout.split("STALL:")[1], "the stacks of the threads are in the diagnostics"


# -- what the cluster backends submit ---------------------------------------------------------------------------
def test_slurm_backend_submits_this_sbatch_script(tmp_path: Path, teacher_dir: Path) -> None:
    job = make_job(tmp_path, teacher_dir, steps=2)
    cluster = SlurmGPUCluster(
        accelerator="cuda",
        num_procs=8,
        nodes=2,
        slurm_partition="gpu",
        slurm_account="nexa",
        slurm_time_limit="12:00:00",
        python_executable="/opt/venv/bin/python",
        slurm_setup_commands=["module load cuda/12.4"],
    )
    env = {"DAGSTER_PIPES_CONTEXT": "abc", "HF_HOME": "/shared/hf home"}
    script = cluster.sbatch_script(cluster.training_launch(job, tmp_path / "work", env))
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for directive in (
        "--job-name=nexa-test-run",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--gpus-per-node=8",
        "--partition=gpu",
        "--account=nexa",
        "--time=12:00:00",
        f"--output={tmp_path}/work/slurm-%j.out",
        "--signal=TERM@120",
    ):
        assert f"#SBATCH {directive}" in lines, directive
    assert "export DAGSTER_PIPES_CONTEXT=abc" in lines and "export HF_HOME='/shared/hf home'" in lines
    assert lines.index("module load cuda/12.4") < lines.index("export HEAD_NODE")
    srun = lines[-1]
    assert srun == (
        "srun --kill-on-bad-exit=1 /opt/venv/bin/python -m torch.distributed.run "
        f"--nproc_per_node=8 --log-dir={tmp_path}/work/torchrun --nnodes=2 --rdzv_backend=c10d "
        "--rdzv_endpoint=$HEAD_NODE:29500 "
        f"--rdzv_id=$SLURM_JOB_ID -m nexa_dagster.core.training.worker --job {tmp_path}/work/job.json "
        f"--log-dir {tmp_path}/work"
    )
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0, "not valid bash"
    cpu = SlurmGPUCluster().sbatch_script(SlurmGPUCluster().training_launch(job, tmp_path))
    assert "--gpus-per-node" not in cpu and "torch.distributed.run" not in cpu

    # evaluation: the same script builder, one process on one GPU of one node, whatever a training uses
    evaluation = cluster.sbatch_script(
        cluster.evaluation_launch(EvaluationJob.model_construct(run_id="test-run"), tmp_path / "eval", env)
    )
    lines = evaluation.splitlines()
    for directive in (
        "--job-name=nexa-eval-test-run",
        "--nodes=1",
        "--gpus-per-node=1",
        "--partition=gpu",
        f"--output={tmp_path}/eval/slurm-%j.out",
    ):
        assert f"#SBATCH {directive}" in lines, directive
    assert "export DAGSTER_PIPES_CONTEXT=abc" in lines
    assert lines[-1] == (
        f"srun --kill-on-bad-exit=1 /opt/venv/bin/python -m nexa_dagster.core.evaluation.worker "
        f"--job {tmp_path}/eval/eval_job.json"
    )
    assert subprocess.run(["bash", "-n"], input=evaluation, text=True).returncode == 0, "not valid bash"


def test_slurm_backend_without_sbatch_fails_clearly(
    tmp_path: Path, teacher_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = make_job(tmp_path, teacher_dir, steps=2)

    @dg.asset
    def trained(context: dg.AssetExecutionContext, gpu_cluster: GPUClusterResource) -> dg.MaterializeResult:
        return gpu_cluster.run_training(context, job, tmp_path / "work")[1].get_materialize_result()

    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    res = dg.materialize(
        [trained],
        resources={"gpu_cluster": SlurmGPUCluster()},
        raise_on_error=False,
        instance=dg.DagsterInstance.ephemeral(),
    )
    description = res.get_step_failure_events()[0].step_failure_data.user_failure_data.description
    assert "sbatch is not on PATH" in description


def test_an_evaluation_with_a_missing_input_fails_before_anything_is_submitted(
    tmp_path: Path, teacher_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No sbatch here: a "not found" error (and not "sbatch is not on PATH") shows the check runs first."""
    job = EvaluationJob(
        run_id="ckpt",
        models={"candidate": str(teacher_dir), "production": str(tmp_path / "gone")},
        examples_path=str(tmp_path / "eval.parquet"),
        eval_set_version=1,
        prompts=[],
        max_new_tokens=4,
        output_path=str(tmp_path / "scores.json"),
    )

    @dg.asset(retry_policy=dg.RetryPolicy(max_retries=2))
    def scored(context: dg.AssetExecutionContext, gpu_cluster: GPUClusterResource) -> None:
        gpu_cluster.run_evaluation(context, job, tmp_path / "work")

    monkeypatch.setenv("PATH", str(tmp_path))
    res = dg.materialize(
        [scored],
        resources={"gpu_cluster": SlurmGPUCluster()},
        raise_on_error=False,
        instance=dg.DagsterInstance.ephemeral(),
    )
    assert not [e for e in res.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]
    description = res.get_step_failure_events()[0].step_failure_data.user_failure_data.description
    assert description == f"evaluation ckpt: model 'production' not found: {tmp_path / 'gone'}"
    assert not (tmp_path / "work").exists(), "nothing is written or submitted"


def test_kubernetes_backend_pod_spec(tmp_path: Path, teacher_dir: Path) -> None:
    job = make_job(tmp_path, teacher_dir, steps=2)
    cluster = KubernetesGPUCluster(
        accelerator="cuda",
        num_procs=4,
        k8s_image="nexa:latest",
        k8s_data_pvc="nexa-data",
        k8s_node_selector={"gpu": "h100"},
        k8s_tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    )
    launch = cluster.training_launch(job, Path("/data/work"), {"A": "1"})
    spec = cluster.pod_spec(launch)
    container = spec["containers"][0]
    assert spec["restartPolicy"] == "Never" and container["image"] == "nexa:latest"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert container["command"] == [
        "python",
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=4",
        "--log-dir=/data/work/torchrun",
        "--standalone",
        "-m",
        "nexa_dagster.core.training.worker",
        "--job",
        "/data/work/job.json",
        "--log-dir",
        "/data/work",
    ]
    assert {"name": "data", "persistentVolumeClaim": {"claimName": "nexa-data"}} in spec["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert spec["nodeSelector"] == {"gpu": "h100"} and spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    # PipesK8sClient.run's own pod_wait_timeout default (86,400 s) would end a longer training: always passed,
    # 0 (no limit) unless configured
    arguments = cluster.k8s_run_arguments(launch)
    assert arguments["pod_wait_timeout"] == 0 and arguments["base_pod_spec"] == spec
    assert arguments["command"] == container["command"] and arguments["env"]["A"] == "1"
    week = cluster.model_copy(update={"k8s_pod_wait_timeout_s": 7 * 86400.0})
    assert week.k8s_run_arguments(launch)["pod_wait_timeout"] == 7 * 86400.0

    # evaluation: one pod with one GPU on the same volume and nodes, the evaluation worker as one process
    evaluation = cluster.k8s_run_arguments(
        cluster.evaluation_launch(EvaluationJob.model_construct(run_id="e"), Path("/data/eval"), {"A": "1"})
    )
    pod = evaluation["base_pod_spec"]
    (container,) = pod["containers"]
    assert (
        container["command"]
        == evaluation["command"]
        == ["python", "-m", "nexa_dagster.core.evaluation.worker", "--job", "/data/eval/eval_job.json"]
    )
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1" and container["name"] == "evaluator"
    assert {"name": "data", "persistentVolumeClaim": {"claimName": "nexa-data"}} in pod["volumes"]
    assert pod["nodeSelector"] == {"gpu": "h100"} and evaluation["env"]["A"] == "1"
    assert evaluation["pod_wait_timeout"] == 0 and evaluation["namespace"] == "default"


# -- stopping ---------------------------------------------------------------------------------------------------
def _launch_long_training(
    tmp_path: Path, teacher_dir: Path, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], psutil.Process, Path]:
    """Materialize a training asset in a separate Dagster process; return it and its worker once training runs."""
    launcher, log = launch_training_in_dagster(tmp_path, teacher_dir, env=env)
    workers = descendants_matching(launcher.pid, "nexa_dagster.core.training.worker")
    assert len(workers) == 1
    return launcher, workers[0], log


@pytest.mark.slow
def test_cancelling_the_dagster_run_stops_the_worker(tmp_path: Path, teacher_dir: Path) -> None:
    """A cancelled run gets SIGINT (what Dagster's run worker receives on cancel): the worker must go with it.

    Also, while it trains: the worker's /proc/<pid>/environ holds none of the secrets planted in the Dagster
    process's environment (the project's secret variables, the database URL, and names the project never heard
    of), which the Dagster process does hold; and it has what it runs with (Dagster Pipes' bootstrap, PATH)."""
    launcher, worker, log = _launch_long_training(tmp_path, teacher_dir, env=PLANTED)
    assert leaked(environ_of(launcher.pid)) == sorted(PLANTED)  # the check can fail
    worker_env = environ_of(worker.pid)
    assert leaked(worker_env) == [], worker.cmdline()
    assert {"DAGSTER_PIPES_CONTEXT", "DAGSTER_PIPES_MESSAGES", "PATH", "HOME"} <= set(worker_env)
    launcher.send_signal(signal.SIGINT)
    worker.wait(timeout=30)  # psutil.TimeoutExpired here means an orphaned training process
    assert launcher.wait(timeout=60) is not None
    text = log.read_text(errors="replace")
    assert "sending SIGINT to subprocess" in text and "RUN FAILED" in text, text[-3000:]
    assert not (tmp_path / "checkpoints" / "test-run" / COMPLETION_MARKER).exists()


@pytest.mark.slow
def test_killing_the_dagster_process_stops_the_worker(tmp_path: Path, teacher_dir: Path) -> None:
    """SIGKILL gives Dagster no chance to forward anything: the worker notices its launcher is gone."""
    launcher, worker, _ = _launch_long_training(tmp_path, teacher_dir)
    launcher.kill()  # not reaped before the check: a zombie launcher must count as gone too
    worker.wait(timeout=30)
    launcher.wait(timeout=10)
