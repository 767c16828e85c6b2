"""The packed SFT Parquet trains with a plain Hugging Face ``Trainer``, padding-free, attention within documents."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from support.packaging_inputs import chat_records, one_source_blend, packaging_settings, quiet, write_jsonl

from nexa_dagster.core.packaging.formats.packed_split import read_packed_frame, split_files
from nexa_dagster.core.packaging.packed_collator import PackedRowsCollator
from nexa_dagster.core.packaging.sft_dataset import package_sft


@pytest.fixture(scope="module")
def packed(tiny_tokenizer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("packed")
    path = write_jsonl(tmp / "in.jsonl", chat_records(120, seed=3))
    return package_sft(
        one_source_blend(path), tiny_tokenizer, str(tmp / "out"), packaging_settings(pack_size=256), log=quiet
    ).paths


def _model(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, attn_implementation="sdpa", dtype=torch.float32
    )


@torch.no_grad()
def test_attention_stays_within_each_packed_document(packed, tiny_model_dir: Path) -> None:
    """The collator's batch gives every document of a packed row the logits it has alone.

    ``transformers`` builds the per-document mask from ``position_ids`` only without a KV cache (``Trainer`` turns
    it off: ``TrainingArguments.use_cache`` is False); with one it would be a plain causal mask.
    """
    model = _model(tiny_model_dir).eval()
    model.config.use_cache = False
    frame = read_packed_frame(packed["train"])
    row = frame[frame.num_documents >= 3].iloc[0]
    batch = PackedRowsCollator()([row.to_dict()])
    packed_logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
    plain_logits = model(input_ids=batch["input_ids"]).logits[
        0
    ]  # one causal sequence: documents see each other
    cu = list(row.cu_seqlens)
    for start, end in zip(cu[1:-1], cu[2:], strict=True):  # every document but the first
        alone = model(input_ids=batch["input_ids"][:, start:end]).logits[0]
        torch.testing.assert_close(packed_logits[start:end], alone, atol=1e-4, rtol=1e-4)
        assert (
            plain_logits[start:end] - alone
        ).abs().max() > 1e-2  # the check can fail: leaking attention shows
    assert batch["labels"].shape == batch["input_ids"].shape and (batch["labels"][0, cu[:-1]] == -100).all()


def test_hf_trainer_learns_from_the_split_files(packed, tiny_model_dir: Path, tmp_path: Path) -> None:
    """A few steps of ``transformers.Trainer`` on the packed Parquet as ``datasets`` reads it: the loss on the
    learned (assistant) tokens goes down."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    train = Dataset.from_parquet(split_files(packed["train"]))  # the snapshot's shard files, in order
    model = _model(tiny_model_dir)
    collate = PackedRowsCollator()
    probe = collate([train[i] for i in range(min(8, len(train)))])

    def loss() -> float:
        with torch.no_grad():
            return float(model(**probe).loss)

    before = loss()
    args = TrainingArguments(
        output_dir=str(tmp_path / "trainer"),
        max_steps=15,
        per_device_train_batch_size=2,
        learning_rate=3e-3,
        warmup_steps=0,
        logging_steps=5,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        remove_unused_columns=False,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collate)
    result = trainer.train()
    model.eval()
    after = loss()
    logged = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    print(
        f"loss on 8 packed rows: {before:.3f} -> {after:.3f}; trainer's logged losses {logged}; "
        f"{result.metrics['train_runtime']:.1f} s for 15 steps"
    )
    assert np.isfinite(logged).all() and after < 0.8 * before, (before, after, logged)
