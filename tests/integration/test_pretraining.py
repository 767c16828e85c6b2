"""Pretraining on a Megatron bin/idx corpus and where a training starts (``init_from``).

The corpus is written with the project's bin/idx writer, the model is the real training MoE, training runs in the
real worker process with DeepSpeed (CPU, gloo), and the checkpoints loaded are saved by ``transformers`` itself.
"""

import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import dagster as dg
import numpy as np
import pytest
import torch
from support.corpus_files import random_documents, write_corpus
from support.worker_launch import LaunchedWorker, start_worker_process
from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM

from nexa_dagster.core.common.artifacts import COMPLETION_MARKER
from nexa_dagster.core.common.config import TrainingSettings, load_deepspeed_config
from nexa_dagster.core.training.corpus import document_id, load_corpus
from nexa_dagster.core.training.data import IGNORE_INDEX, labels_for
from nexa_dagster.core.training.init import check_init_checkpoint, load_mixtral_checkpoint, resolve
from nexa_dagster.core.training.job import TrainingJob, TrainingResult
from nexa_dagster.core.training.model.moe import NexaMoEForCausalLM
from nexa_dagster.resources.gpu_cluster import LocalGPUCluster

WORKER = [sys.executable, "-m", "nexa_dagster.core.training.worker"]


def small_config(vocab: int = 300) -> MixtralConfig:
    return MixtralConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_theta=10000.0,
    )


# -- the corpus as training rows ---------------------------------------------------------------------------------
def test_corpus_rows_keep_documents_apart_and_never_train_on_heldout_documents(tmp_path: Path) -> None:
    documents = random_documents(40, vocab=300, eos=2)
    train, heldout, split = load_corpus(
        write_corpus(tmp_path, documents), pack_size=32, heldout_fraction=0.2, pad_id=0
    )
    assert train["input_ids"].shape[1] == heldout["input_ids"].shape[1] == 32
    assert len(split.train) + len(split.heldout) == 40 and 0 < len(split.heldout) < 40

    # the rows, read back in order, are the training documents back to back; each document starts at position 0
    real = train["attention_mask"].reshape(-1).bool()
    stream = train["input_ids"].reshape(-1)[real]
    positions = train["position_ids"].reshape(-1)[real]
    expected = np.concatenate(split.train)
    assert torch.equal(stream, torch.from_numpy(expected))
    starts = np.cumsum([0] + [len(d) for d in split.train[:-1]])
    assert (positions[starts] == 0).all()
    row_starts = torch.zeros(len(positions), dtype=torch.bool)
    row_starts[::32] = True
    doc_starts = torch.zeros(len(positions), dtype=torch.bool)
    doc_starts[starts] = True
    assert torch.equal(positions == 0, row_starts | doc_starts), (
        "a position restarts only at a document or row"
    )
    # loss on every real token except a document's first (never predicted from another document)
    labels = labels_for(train).reshape(-1)[real]
    assert torch.equal(labels.ne(IGNORE_INDEX), ~(row_starts | doc_starts))
    assert (labels_for(train).reshape(-1)[~real] == IGNORE_INDEX).all()

    # held out: by document id, never in a training row, and the same side for the same document every time
    assert {document_id(d) for d in split.train}.isdisjoint(split.heldout_ids)
    assert split.heldout_ids == {
        document_id(np.asarray(d)) for d in documents if document_id(np.asarray(d)) in split.heldout_ids
    }
    _, _, again = load_corpus(
        write_corpus(tmp_path / "reshuffled", documents[::-1], shards=3),
        pack_size=16,
        heldout_fraction=0.2,
        pad_id=0,
    )
    assert again.heldout_ids == split.heldout_ids

    # the model attends within documents: a document's logits in a packed row equal its logits alone
    row = int(torch.nonzero((train["position_ids"][:, 1:] == 0).any(1))[0])
    pos = train["position_ids"][row]
    second = int(torch.nonzero(pos[1:] == 0)[0]) + 1
    end = int(torch.nonzero(pos[second + 1 :] == 0)[0]) + second + 1 if (pos[second + 1 :] == 0).any() else 32
    torch.manual_seed(0)
    model = NexaMoEForCausalLM(small_config()).eval()
    with torch.no_grad():
        packed = model(train["input_ids"][row : row + 1], position_ids=pos[None], return_logits=True).logits
        alone = model(train["input_ids"][row : row + 1, second:end], return_logits=True).logits
    torch.testing.assert_close(packed[0, second:end], alone[0], rtol=1e-4, atol=1e-5)


def test_a_corpus_that_cannot_be_split_fails_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has 1 document"):
        load_corpus(write_corpus(tmp_path / "one", [[5, 6, 2]], shards=1), 16, 0.1, 0)
    with pytest.raises(FileNotFoundError, match="pretraining corpus not found"):
        load_corpus(str(tmp_path / "nothing"), 16, 0.1, 0)


# -- pretraining in the worker, resumed exactly ------------------------------------------------------------------
def pretrain_job(
    tmp_path: Path, tokenizer_dir: Path, run_id: str, steps: int = 6, **settings: object
) -> TrainingJob:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    corpus = tmp_path / "corpus"
    if not corpus.exists():
        write_corpus(corpus, random_documents(60, len(tokenizer), tokenizer.eos_token_id, seed=3))
    training = TrainingSettings(
        max_steps=steps,
        micro_batch_size=2,
        gradient_accumulation_steps=1,
        learning_rate=3e-3,
        warmup_steps=1,
        weight_decay=0.0,
        grad_clip=1.0,
        log_every=1,
        seed=0,
        num_procs=1,
        **settings,
    )
    return TrainingJob(
        run_id=run_id,
        train_path=str(corpus),
        validation_path=str(corpus),
        tokenizer_path=str(tokenizer_dir),
        model_preset="tiny",
        deepspeed_config=load_deepspeed_config("zero1_cpu.json"),
        settings=training,
        output_dir=str(tmp_path / "ckpt" / run_id),
        dataset_run_hash="corpus1234",
        data_kind="pretrain_corpus",
        pack_size=64,
        heldout_fraction=0.15,
    )


def _worker(job: TrainingJob, tmp_path: Path, env: dict[str, str] | None = None) -> LaunchedWorker:
    """The worker in a session of its own (the test kills its group), forked from the warm Python where it can be."""
    job_file = tmp_path / f"{job.run_id}.json"
    job_file.write_text(job.model_dump_json())
    return start_worker_process([*WORKER, "--job", str(job_file)], env=env, own_session=True)


def _losses(job: TrainingJob) -> list[tuple[int, float]]:
    lines = (Path(job.output_dir) / "metrics.jsonl").read_text().splitlines()
    return [(m["step"], m["loss"]) for m in map(json.loads, lines)]


@pytest.mark.slow
def test_pretraining_on_bin_idx_resumes_with_the_same_loss_at_every_step(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The pretraining job trains in the SFT worker; killed after the state of step 3 is saved and relaunched,
    steps 4-6 give exactly the losses of an uninterrupted run; the held-out documents are its validation set."""
    straight = pretrain_job(tmp_path, tiny_model_dir, "straight", checkpoint_every=3)
    proc = _worker(straight, tmp_path)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    result = TrainingResult.model_validate_json(
        (Path(straight.output_dir) / "training_summary.json").read_text()
    )
    assert (
        result.data_kind == "pretrain_corpus"
        and result.parent == "scratch"
        and result.validation_documents > 0
    )
    assert math.isfinite(result.validation_loss) and result.steps == 6
    assert MixtralForCausalLM.from_pretrained(straight.output_dir).config.model_type == "mixtral"

    killed = pretrain_job(tmp_path, tiny_model_dir, "killed", checkpoint_every=3)
    proc = _worker(killed, tmp_path, env={"NEXA_FAULT_STALL_AT_STEP": "4"})  # hangs after step 4, state at 3
    latest = tmp_path / "ckpt" / "killed.state" / "latest"
    deadline = time.monotonic() + 240
    while not (latest.exists() and latest.read_text().strip() == "step00000003"):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert not (Path(killed.output_dir) / COMPLETION_MARKER).exists()

    proc = _worker(killed, tmp_path)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "resumed from step 3" in out
    assert _losses(killed) == _losses(straight)


# -- init_from ---------------------------------------------------------------------------------------------------
def test_a_transformers_saved_mixtral_loads_into_the_training_model_with_the_same_logits(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    hf = MixtralForCausalLM(small_config()).eval()
    hf.save_pretrained(tmp_path / "mixtral")
    ours = load_mixtral_checkpoint(str(tmp_path / "mixtral")).eval()
    ids = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(
            ours(ids, return_logits=True).logits, hf(input_ids=ids).logits, rtol=1e-5, atol=1e-5
        )


def test_the_training_loop_starts_from_the_init_checkpoint(tmp_path: Path, tiny_model_dir: Path) -> None:
    """``build_model`` of a job with init_from holds the checkpoint's weights, not the preset's random ones."""
    from nexa_dagster.core.training.loop import build_model

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    job = pretrain_job(tmp_path, tiny_model_dir, "init")
    scratch = build_model(job, len(tokenizer), tokenizer)
    started = build_model(
        job.model_copy(update={"init_from": str(tiny_model_dir)}), len(tokenizer), tokenizer
    )
    saved = MixtralForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    for name, tensor in started.state_dict().items():
        torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0)
    assert not torch.equal(
        scratch.state_dict()["model.embed_tokens.weight"], saved["model.embed_tokens.weight"]
    )


def test_a_wrong_architecture_or_vocabulary_fails_before_launch(tmp_path: Path, tiny_model_dir: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # a dense Llama is upcycled (tests/unit/core/training/test_upcycle.py); a GPT-2 is neither
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=4)).save_pretrained(
        tmp_path / "gpt2"
    )
    with pytest.raises(ValueError, match="a GPT2LMHeadModel checkpoint; training starts only from a Mixtral"):
        check_init_checkpoint(str(tmp_path / "gpt2"), tokenizer, "the data")
    MixtralForCausalLM(small_config(vocab=len(tokenizer) - 10)).save_pretrained(tmp_path / "small-vocab")
    with pytest.raises(
        ValueError, match=f"vocab_size {len(tokenizer) - 10} is smaller than the {len(tokenizer)}"
    ):
        check_init_checkpoint(str(tmp_path / "small-vocab"), tokenizer, "the data")
    assert check_init_checkpoint(str(tiny_model_dir), tokenizer, "the data") == str(tiny_model_dir)

    # another tokenizer shipped with the checkpoint: refused at the cluster, before any process starts
    from nexa_dagster.core.tiny.model import build_tiny_causal_lm

    other = build_tiny_causal_lm(
        tmp_path / "other-tokenizer", corpus=["a different corpus entirely " * 50], vocab_size=300
    )
    job = pretrain_job(tmp_path, tiny_model_dir, "refused").model_copy(update={"init_from": str(other)})
    with pytest.raises(dg.Failure, match="is not the one .* was tokenized with"):
        LocalGPUCluster()._check_job(job)
    assert not Path(job.output_dir).exists()


def test_init_from_resolves_each_name() -> None:
    base, production = ("base-1", "/ckpt/base-1"), ("ckpt-7", "/ckpt/ckpt-7")
    assert resolve("base", base, production).path == "/ckpt/base-1"
    assert resolve("base", base, production).parent == "base:base-1"
    assert resolve("production", base, production).parent == "production:ckpt-7"
    assert (
        resolve("scratch", base, production).path == "" and resolve("scratch", None, None).parent == "scratch"
    )
    assert resolve("/models/m", None, None).parent == "path:/models/m"
    fallback = resolve("base", None, production, preset_default=True)
    assert fallback.parent == "scratch" and "no base_model" in fallback.note
    with pytest.raises(ValueError, match="no base_model has been materialized"):
        resolve("base", None, production)
    with pytest.raises(ValueError, match="no model is in production"):
        resolve("production", base, None)
    # the preset's continual fine-tuning: the first night has no production model, and starts from the base
    first_night = resolve("production", base, None, preset_default=True)
    assert first_night.path == "/ckpt/base-1" and first_night.parent == "base:base-1"
    assert "no model is in production yet" in first_night.note
    fresh_root = resolve("production", None, None, preset_default=True)
    assert fresh_root.parent == "scratch" and "no base_model" in fresh_root.note


def test_the_loader_records_the_documents_it_serves_and_a_reader_proves_them(tmp_path: Path) -> None:
    """What the worker's loader served, beside the checkpoint: the ids re-pack to the served rows' hash, and a
    corpus loaded without its exclusion list (a trainer that ignored it) shows the excluded document as served."""
    from nexa_dagster.core.training.corpus import pack_stream, record_served, rows_sha256, served_path

    documents = [np.asarray(d) for d in random_documents(30, vocab=300, eos=2)]
    corpus = write_corpus(tmp_path, documents)
    by_id = {document_id(d): d for d in documents}

    def served(exclude: frozenset[str], name: str) -> dict:
        train, _, split = load_corpus(corpus, pack_size=32, heldout_fraction=0.2, pad_id=0, exclude=exclude)
        record_served(str(tmp_path / name), split, train)
        return json.loads(Path(served_path(str(tmp_path / name))).read_text())

    ignoring = served(frozenset(), "ckpt-ignoring")  # a trainer that ignored its exclusion list
    excluded = ignoring["document_ids"][0]  # a document on the training side
    honest = served(frozenset({excluded}), "ckpt-honest")
    repacked = pack_stream([by_id[i] for i in honest["document_ids"]], 32, 0)
    assert rows_sha256(repacked) == honest["rows_sha256"]  # the ids are exactly the rows served
    assert excluded not in honest["document_ids"] and excluded in ignoring["document_ids"]
