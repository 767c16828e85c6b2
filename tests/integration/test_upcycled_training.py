"""Training that starts from a dense checkpoint: the worker (a real DeepSpeed process, as in production) upcycles
it into the MoE (``init_from`` a Llama directory) and fine-tunes; on the real SmolLM2-135M the upcycled MoE
computes the dense model's logits before any step."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from support.training_jobs import make_job
from support.worker_launch import run_worker_command

from nexa_dagster.core.training.job import TrainingJob, TrainingResult

WORKER = [sys.executable, "-m", "nexa_dagster.core.training.worker"]


def train(job: TrainingJob, tmp_path: Path) -> TrainingResult:
    job_file = tmp_path / "job.json"
    job_file.write_text(job.model_dump_json())
    proc = run_worker_command([*WORKER, "--job", str(job_file)], timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return TrainingResult.model_validate_json((Path(job.output_dir) / "training_summary.json").read_text())


def dense_llama_with_tokenizer(path: Path, tokenizer_dir: Path) -> Path:
    """A random dense Llama sized by the tiny tokenizer, saved with that tokenizer (the data's)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_sft_from_a_dense_llama_upcycles_it_and_the_loss_falls(tmp_path: Path, teacher_dir: Path) -> None:
    from transformers import AutoConfig

    dense = dense_llama_with_tokenizer(tmp_path / "dense", teacher_dir)
    job = make_job(tmp_path, dense, steps=10, rows=2, lr=1e-2, log_every=2)
    result = train(job.model_copy(update={"init_from": str(dense)}), tmp_path)
    losses = [loss for _, loss in result.loss_curve]
    assert all(math.isfinite(v) for v in losses) and result.final_loss < result.first_loss - 1.0, losses
    saved = AutoConfig.from_pretrained(job.output_dir)  # a Mixtral checkpoint with the tiny preset's experts
    assert saved.model_type == "mixtral" and (saved.num_local_experts, saved.num_experts_per_tok) == (4, 2)


@pytest.mark.slow
@pytest.mark.parametrize("top_k", [1, 2])
def test_upcycled_smollm2_computes_smollm2s_logits(smollm2_dir: Path, top_k: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nexa_dagster.core.training.upcycle import UpcyclingSpec, upcycle_dense_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tokenizer(
        ["A list in Python is a mutable sequence.", "def add(a, b):\n    return a + b"],
        return_tensors="pt",
        padding=True,
    )["input_ids"][:, :12]  # rows without padding: both prompts are longer than 12 tokens
    dense = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    with torch.no_grad():
        expected = dense(ids).logits
    del dense
    spec = UpcyclingSpec(num_local_experts=2 * top_k, num_experts_per_tok=top_k)
    moe = upcycle_dense_checkpoint(str(smollm2_dir), spec, attention="causal").eval()
    with torch.no_grad():
        got = moe(ids, return_logits=True).logits
    assert expected.abs().max() > 10  # real logits
    assert (expected - got).abs().max().item() < 1e-4


@pytest.mark.slow
def test_training_from_smollm2_needs_data_tokenized_with_smollm2s_tokenizer(
    smollm2_dir: Path, tiny_tokenizer: object
) -> None:
    """Before anything launches (``check_init_checkpoint``, as the training asset and the cluster resource call
    it): data packed with the tiny tokenizer is refused (its ids are not SmolLM2's words), SmolLM2's own is
    accepted and the training then uses the checkpoint's tokenizer.

    The training itself: on the tiny dense Llama above, and on SmolLM2 through ``training_job`` on a day of its
    own answers packaged with its tokenizer in ``tests/e2e/test_real_teacher_day.py`` (a step of the upcycled 214M
    MoE takes 8-50 s on the 2-core CPU, by load)."""
    from transformers import AutoTokenizer

    from nexa_dagster.core.training.init import check_init_checkpoint

    with pytest.raises(ValueError, match="is not the one the data was tokenized with"):
        check_init_checkpoint(str(smollm2_dir), tiny_tokenizer, "the data")
    own = AutoTokenizer.from_pretrained(smollm2_dir)
    assert check_init_checkpoint(str(smollm2_dir), own, "the data") == str(smollm2_dir)
