"""Packaging stage: all filtered samples so far become the packed SFT dataset (Parquet + JSONL)."""


import dagster as dg
import pandas as pd

from nexa_dagster.assets.types import FilteredSamplesType
from nexa_dagster.core.artifacts import SFTDataset
from nexa_dagster.core.config import load_pipeline_config, load_scale
from nexa_dagster.core.sft_dataset import build_sft_dataset
from nexa_dagster.core.tiny_model import ensure_model
from nexa_dagster.resources.storage import StorageResource


def load_student_tokenizer(storage: StorageResource) -> tuple[object, str]:
    from transformers import AutoTokenizer

    path = ensure_model(storage.model_path(load_pipeline_config()["models"]["student_tokenizer"]))
    return AutoTokenizer.from_pretrained(str(path)), str(path)


@dg.asset(
    group_name="packaging",
    ins={"filtered_samples": dg.AssetIn(dagster_type=FilteredSamplesType)},
    kinds={"python", "parquet"},
    description="Every filtered sample up to now, rendered with the student's chat template, tokenized, packed "
                "best-fit-decreasing into fixed-length sequences with an assistant-only loss mask, split into "
                "train/validation and written as Parquet and JSONL under data/sft/<run_hash>/.",
)
def sft_dataset(context: dg.AssetExecutionContext, filtered_samples: pd.DataFrame,
                storage: StorageResource) -> SFTDataset:
    scale = load_scale()
    tokenizer, tokenizer_path = load_student_tokenizer(storage)
    dataset, stats = build_sft_dataset(filtered_samples, tokenizer, tokenizer_path, storage.path("sft"),
                                       scale.pack_size, scale.validation_fraction, seed=scale.training.seed,
                                       log=context.log.info)
    context.add_output_metadata({
        "run_hash": dataset.run_hash,
        "num_samples": dataset.num_samples,
        "days": dg.MetadataValue.json(dataset.days),
        "train_sequences": dataset.num_train_sequences,
        "validation_sequences": dataset.num_validation_sequences,
        "pack_size": dataset.pack_size,
        "real_tokens": dataset.num_real_tokens,
        "loss_tokens": dataset.num_loss_tokens,
        "packing_efficiency": round(dataset.packing_efficiency, 4),
        "truncated_conversations": sum(s.truncated_documents for s in stats.values()),
        "dropped_conversations": sum(s.dropped_documents for s in stats.values()),
        "train_path": dg.MetadataValue.path(dataset.train_path),
        "validation_path": dg.MetadataValue.path(dataset.validation_path),
    })
    return dataset


@dg.asset_check(asset=sft_dataset, description="Both splits re-read from storage are well-formed packed sequences "
                                               "with assistant tokens to learn.")
def packed_splits_are_well_formed(sft_dataset: SFTDataset) -> dg.AssetCheckResult:
    from nexa_dagster.core import storage as io
    from nexa_dagster.core.schemas import PackedSequences

    problems = []
    for split, path in (("train", sft_dataset.train_path), ("validation", sft_dataset.validation_path)):
        frame = io.read_parquet(path)
        PackedSequences.validate(frame)
        if not frame["input_ids"].map(len).eq(sft_dataset.pack_size).all():
            problems.append(f"{split}: a row is not {sft_dataset.pack_size} tokens long")
        if int(frame["num_loss_tokens"].sum()) == 0:
            problems.append(f"{split}: no loss-masked (assistant) tokens")
    return dg.AssetCheckResult(passed=not problems, metadata={"problems": dg.MetadataValue.json(problems)})
