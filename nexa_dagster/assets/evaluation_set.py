"""The frozen evaluation set: held-out samples (never in any training split), versioned under data/eval_sets/,
with the pretraining corpus's documents on the eval side (never in any base model's training) for base models.

Materialized with every training (``training_job``) so that the first version exists before the first evaluation;
a version, once frozen, never changes (``core.eval_set``), so the gate and the leaderboard compare like with like.
"""

import dagster as dg
import pandas as pd

from nexa_dagster.assets.common import IMPORTS_MODELS
from nexa_dagster.assets.packaging import load_student_tokenizer
from nexa_dagster.assets.types import FilteredSamplesType
from nexa_dagster.core.evaluation.eval_set import freeze_eval_set
from nexa_dagster.core.packaging.pretrain_corpus import PretrainCorpus
from nexa_dagster.resources.configs import EvalSetsResource
from nexa_dagster.resources.io_manager import read_stored_artifact
from nexa_dagster.resources.scale import ScaleResource
from nexa_dagster.resources.storage import StorageResource


@dg.asset(
    op_tags=IMPORTS_MODELS,  # step_executor.py: torch and transformers in its own process
    group_name="evaluation",
    ins={"filtered_samples": dg.AssetIn(dagster_type=FilteredSamplesType)},
    deps=[
        "pretrain_corpus"
    ],  # read if materialized (its eval-side documents); a version frozen without has none
    kinds={"parquet"},
    description="The frozen evaluation set of version eval_set.version (configs/pipeline.yaml): the filtered "
    "samples whose id hashes to the held-out side, which packaging keeps out of every split, "
    "tokenized once, in data/eval_sets/v<N>/, and the latest pretrain_corpus's documents on the eval "
    "side (eval_set.corpus_fraction; no base model trains on them) for base_model_eval. Frozen the "
    "first time; later runs return it unchanged.",
)
def eval_set(
    context: dg.AssetExecutionContext,
    filtered_samples: pd.DataFrame,
    storage: StorageResource,
    scale_preset: ScaleResource,
    eval_sets: EvalSetsResource,
) -> dg.MaterializeResult:
    cfg = eval_sets
    tokenizer, _ = load_student_tokenizer(storage)
    corpus = read_stored_artifact(storage.data_root, "pretrain_corpus", results_root=storage.results_root)
    if not isinstance(corpus, PretrainCorpus):
        context.log.warning(
            "no pretrain_corpus materialized yet: this eval-set version, if frozen now, has no "
            "corpus documents and base models cannot be evaluated on it"
        )
    manifest = freeze_eval_set(
        filtered_samples,
        tokenizer,
        storage.path("eval_sets"),
        cfg.version,
        cfg.fraction,
        scale_preset.load().pack_size,
        log=context.log.info,
        corpus=(corpus.root, corpus.run_hash) if isinstance(corpus, PretrainCorpus) else None,
        corpus_fraction=cfg.corpus_fraction,
    )
    frozen_corpus = manifest.get("corpus") or {}
    return dg.MaterializeResult(
        # frozen: the same content each night, so what reads it (base_model, eval reports) is not marked stale
        data_version=dg.DataVersion(manifest["content_sha256"]),
        metadata={
            "version": manifest["version"],
            "examples": manifest["examples"],
            "scored_tokens": manifest["tokens"],
            "scale": scale_preset.name,
            "corpus_documents": frozen_corpus.get("documents", 0),
            "corpus_tokens": frozen_corpus.get("tokens", 0),
            "corpus_run_hash": frozen_corpus.get("run_hash", ""),
            "days": dg.MetadataValue.json(manifest["days"]),
            "created_at": manifest["created_at"],
            "examples_sha256": manifest["files"]["examples.parquet"],
            "content_sha256": manifest[
                "content_sha256"
            ],  # the whole version: reports and the leaderboard carry it
            "path": dg.MetadataValue.path(storage.path("eval_sets", f"v{manifest['version']}")),
        },
    )
