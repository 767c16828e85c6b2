"""Training with the real DeepSpeed engine (CPU, gloo) in its own process, and its launch through Dagster Pipes."""


import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest

from nexa_dagster.core.config import TrainingSettings, load_deepspeed_config
from nexa_dagster.core.packing import TokenizedConversation, conversation, pack, tokenize_conversation
from nexa_dagster.core.training.job import TrainingJob, TrainingResult
from nexa_dagster.resources.gpu_cluster import GPUClusterResource


def _packed(tokenizer, n: int, out: Path, pack_size: int = 128) -> str:
    convs = []
    for i in range(n):
        msgs = conversation("", f"What is item {i}?", f"Item {i} is a small example number {i}.")
        ids, mask = tokenize_conversation(tokenizer, msgs)
        convs.append(TokenizedConversation(str(i), ids, mask))
    frame, _ = pack(convs, pack_size, tokenizer.pad_token_id)
    frame.to_parquet(out)
    return str(out)


def _job(tmp_path: Path, model_dir: Path, tokenizer, steps: int, lr: float = 3e-3, n: int = 16) -> TrainingJob:
    train = _packed(tokenizer, n, tmp_path / "train.parquet")
    val = _packed(tokenizer, 4, tmp_path / "validation.parquet")
    settings = TrainingSettings(max_steps=steps, micro_batch_size=2, gradient_accumulation_steps=1, learning_rate=lr,
                                warmup_steps=1, weight_decay=0.0, grad_clip=1.0, log_every=2, seed=0, num_procs=1)
    return TrainingJob(run_id="test-run", train_path=train, validation_path=val, tokenizer_path=str(model_dir),
                       model_preset="tiny", deepspeed_config=load_deepspeed_config("zero1_cpu.json"),
                       settings=settings, output_dir=str(tmp_path / "checkpoints" / "test-run"),
                       dataset_run_hash="abc12345", accelerator="cpu")


def test_worker_trains_with_deepspeed_and_saves_a_loadable_hf_checkpoint(tmp_path, tiny_model_dir, tiny_tokenizer) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    job = _job(tmp_path, tiny_model_dir, tiny_tokenizer, steps=12, lr=1e-2, n=2)
    job_file = tmp_path / "job.json"
    job_file.write_text(job.model_dump_json())
    proc = subprocess.run([sys.executable, "-m", "nexa_dagster.core.training.worker", "--job", str(job_file)],
                          capture_output=True, text=True, timeout=600, env={**os.environ,
                                                                             "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = Path(job.output_dir)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "_COMPLETE", "training_summary.json"):
        assert (ckpt / name).exists(), name
    result = TrainingResult.model_validate(json.loads((ckpt / "training_summary.json").read_text()))
    assert result.steps == 12
    # two sequences seen over and over: the real engine must fit them
    assert result.final_loss < result.first_loss - 0.5
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    assert model.config.model_type == "mixtral" and not model.config.output_router_logits
    assert AutoTokenizer.from_pretrained(ckpt).chat_template
    assert result.parameters_active < result.parameters_total


def test_training_through_the_gpu_cluster_resource_streams_pipes_messages(tmp_path, tiny_model_dir,
                                                                        tiny_tokenizer) -> None:
    job = _job(tmp_path, tiny_model_dir, tiny_tokenizer, steps=4)

    @dg.asset
    def trained(context: dg.AssetExecutionContext, gpu_cluster: GPUClusterResource) -> dg.MaterializeResult:
        result, invocation = gpu_cluster.run_training(context, job, tmp_path / "work")
        report = invocation.get_custom_messages()[-1]
        return dg.MaterializeResult(metadata={"steps": result.steps, "reported_steps": report["steps"],
                                              "final_loss": result.final_loss})

    instance = dg.DagsterInstance.ephemeral()
    res = dg.materialize([trained], resources={"gpu_cluster": GPUClusterResource()}, instance=instance)
    assert res.success
    md = res.asset_materializations_for_node("trained")[0].metadata
    assert md["steps"].value == 4 and md["reported_steps"].value == 4
    logs = [e.message for e in instance.all_logs(res.run_id)]
    assert any("step 4/4 loss" in (m or "") for m in logs), "worker progress did not stream through Pipes"


def test_missing_training_input_fails_naming_the_path(tmp_path, tiny_model_dir, tiny_tokenizer) -> None:
    job = _job(tmp_path, tiny_model_dir, tiny_tokenizer, steps=2).model_copy(
        update={"train_path": str(tmp_path / "nope.parquet")})

    @dg.asset
    def trained(context: dg.AssetExecutionContext, gpu_cluster: GPUClusterResource) -> None:
        gpu_cluster.run_training(context, job, tmp_path / "work")

    res = dg.materialize([trained], resources={"gpu_cluster": GPUClusterResource()}, raise_on_error=False)
    assert not res.success
    failure = res.get_step_failure_events()[0].step_failure_data.user_failure_data
    assert failure is not None and "nope.parquet" in failure.description


def test_cluster_backends_not_yet_built_say_so() -> None:
    with pytest.raises(NotImplementedError, match="issue #5"):
        GPUClusterResource(backend="slurm").run_training(None, None, Path("."))  # type: ignore[arg-type]


def test_packed_frame_round_trips(tmp_path, tiny_tokenizer) -> None:
    path = _packed(tiny_tokenizer, 3, tmp_path / "p.parquet")
    frame = pd.read_parquet(path)
    assert len(frame) >= 1 and frame["num_loss_tokens"].sum() > 0
