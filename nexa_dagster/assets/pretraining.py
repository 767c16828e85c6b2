"""Pretraining stage: the MoE preset trained on ``pretrain_corpus`` into a base model that SFT starts from.

Same machinery as SFT (``moe_checkpoint``): a ``TrainingJob`` launched off-process by the GPU-cluster resource
through Dagster Pipes, the same worker, DeepSpeed engine, monitors and exact resume; only its data kind differs
(``pretrain_corpus``: the bin/idx documents packed into ``pack_size`` rows, every token learned). Its validation
loss is the perplexity of the corpus documents held out by a hash of their tokens, which no training row ever holds;
the documents on the frozen eval set's side are kept out of both, and every base model is evaluated on those an
eval-set version froze (``base_model_eval``), so base models trained on different corpora compare.
"""

import dagster as dg

from nexa_dagster.assets.checkpoint_launch import (
    Publish,
    StageFigures,
    StageRecord,
    launch_and_record,
    preset_on_cluster,
)
from nexa_dagster.assets.common import IMPORTS_MODELS, MODEL_CALL_RETRY
from nexa_dagster.assets.packaging import contamination_index, load_student_tokenizer
from nexa_dagster.assets.partitions import base_model_partitions
from nexa_dagster.assets.training import checkpoint_id_for
from nexa_dagster.core.common.artifacts import Checkpoint
from nexa_dagster.core.common.config import ScalePreset, TrainingSettings
from nexa_dagster.core.data.contamination import ContaminationIndex
from nexa_dagster.core.evaluation.scoring import perplexity_of
from nexa_dagster.core.packaging.decontaminate import decontaminate, document_texts, recorded_inputs
from nexa_dagster.core.packaging.pretrain_corpus import PretrainCorpus, documents_holding_protected_text
from nexa_dagster.core.training.job import TrainingJob, TrainingResult
from nexa_dagster.resources.configs import EvalSetsResource, PackagingResource, PromptsResource
from nexa_dagster.resources.gpu_cluster import GPUClusterResource
from nexa_dagster.resources.scale import ScaleResource
from nexa_dagster.resources.storage import StorageResource
from nexa_dagster.resources.tracking import TrackingResource


def contaminated_documents(
    context: dg.AssetExecutionContext,
    storage: StorageResource,
    corpus: PretrainCorpus,
    index: ContaminationIndex,
    tokenizer: object,
) -> tuple[list[str], int, dict[str, int]]:
    """(the corpus ids of its documents that hold protected text, how many were found, how many per protected
    source: ``eval_set v<N>``, ``rl_eval_set v<N>``, ``benchmark:<task>``) from the corpus's recorded day inputs, each
    checked once per index (the receipts of ``core/packaging/decontaminate.py``)."""
    out_root = storage.path("pretrain")
    files = recorded_inputs(corpus.root, out_root)
    if files is None:  # a corpus packed before its inputs were recorded: nothing to go on
        context.log.warning(
            f"corpus {corpus.run_hash} records no inputs: not checked for contamination again"
        )
        return [], 0, {}
    # report mode: the corpus stays as packed; the training leaves these documents out by their id
    _, report = decontaminate(files, index, out_root, "report", document_texts, "doc_id", lambda _: None)
    if report.contaminated_rows:
        context.log.info(
            f"contamination check (index {index.key}): {report.contaminated_rows} of {report.rows_checked} "
            f"corpus documents hold protected text (by source {report.rows_by_source}); first: "
            f"{report.examples[0]}"
        )
    else:
        context.log.info(
            f"contamination check (index {index.key}): none of {report.rows_checked} corpus documents holds "
            "eval-set, RL eval-set or benchmark text"
        )
    found = sorted(documents_holding_protected_text(report, tokenizer, out_root))
    return found, report.contaminated_rows, report.rows_by_source


@dg.asset(
    op_tags=IMPORTS_MODELS,  # step_executor.py: torch and transformers in its own process
    group_name="training",
    pool="gpu",
    retry_policy=MODEL_CALL_RETRY,
    # frozen first: the base never trains on a document the eval set or the held-out RL prompts quote
    deps=["eval_set", "rl_eval_set"],
    kinds={"deepspeed", "pytorch"},
    description="The MoE preset pretrained with the DeepSpeed engine on pretrain_corpus (documents concatenated "
    "into pack_size rows, attention within documents, loss on every token), saved as a Hugging Face "
    "Mixtral checkpoint in data/base_models/<id>/; evaluated by the perplexity of held-out corpus "
    "documents. moe_checkpoint starts from the latest one (init_from: base).",
)
def base_model(
    context: dg.AssetExecutionContext,
    pretrain_corpus: PretrainCorpus,
    gpu_cluster: GPUClusterResource,
    storage: StorageResource,
    tracking: TrackingResource,
    scale_preset: ScaleResource,
    eval_sets: EvalSetsResource,
    packaging_config: PackagingResource,
    prompts: PromptsResource,
) -> dg.Output[Checkpoint]:
    scale = scale_preset.load()
    if scale.pretraining is None:
        raise dg.Failure(
            f"scale preset {scale.name!r} has no pretraining section (max_steps, ...)", allow_retries=False
        )
    settings = scale.pretraining.settings(scale.training)
    base_id = checkpoint_id_for(context, storage, prefix="base", store=storage.path("base_models"))
    tokenizer, tokenizer_path = load_student_tokenizer(storage)
    # the corpus was checked when it was packed; the eval set and the RL eval set may have been frozen since: check
    # again, and leave out what holds their text or a benchmark's (with on_overlap: remove)
    contamination = packaging_config.config().contamination
    index, _ = contamination_index(storage, eval_sets, scale, prompts, contamination)
    excluded, found, by_source = contaminated_documents(context, storage, pretrain_corpus, index, tokenizer)
    if contamination.on_overlap == "report":
        excluded = []
    context.log.info(
        f"{len(excluded)} of them left out of this training (on_overlap: {contamination.on_overlap}), with the "
        f"corpus documents on the frozen eval set's side (eval_set.corpus_fraction {eval_sets.corpus_fraction})"
    )
    job = TrainingJob(
        run_id=base_id,
        train_path=pretrain_corpus.root,
        validation_path=pretrain_corpus.root,
        tokenizer_path=tokenizer_path,
        settings=settings,
        output_dir=storage.path("base_models", base_id),
        dataset_run_hash=pretrain_corpus.run_hash,
        **preset_on_cluster(scale, scale_preset, gpu_cluster),
        data_kind="pretrain_corpus",
        pack_size=scale.pack_size,
        heldout_fraction=scale.pretraining.heldout_fraction,
        parent="scratch",
        eval_fraction=eval_sets.corpus_fraction,  # the eval set's documents: never trained on
        exclude_documents=excluded,
    )
    stage = pretraining_record(
        base_id, scale, settings, pretrain_corpus, excluded, (found, by_source), eval_sets.corpus_fraction
    )
    return launch_and_record(context, job, stage, gpu_cluster, storage, tracking, as_base_model(context))


def as_base_model(context: dg.AssetExecutionContext) -> Publish:
    """Publishing a base model: its ``base_models`` partition, which base_model_eval evaluates."""

    def publish(checkpoint: Checkpoint) -> dict[str, object]:
        context.instance.add_dynamic_partitions(base_model_partitions.name, [checkpoint.checkpoint_id])
        return {}

    return publish


def pretraining_record(
    base_id: str,
    scale: ScalePreset,
    settings: TrainingSettings,
    corpus: PretrainCorpus,
    excluded: list[str],
    found: tuple[int, dict[str, int]],
    eval_side_fraction: float,
) -> StageRecord:
    """What is pretraining's own in the launch-and-record path: its parameters, record fields (the documents it
    never saw, so that its descendants' evaluation counts only the corpus it learned from) and held-out figures."""

    def figures(result: TrainingResult) -> StageFigures:
        perplexity = perplexity_of(result.validation_loss)
        return StageFigures(
            final_metrics={"heldout_loss": result.validation_loss, "heldout_perplexity": perplexity},
            metadata={
                "scale": scale.name,
                "corpus_run_hash": corpus.run_hash,
                "heldout_loss": result.validation_loss,
                "heldout_perplexity": perplexity,
                "heldout_documents": result.validation_documents,
                "contaminated_documents_found": found[0],
                # which protected items they hold: a document holding two sources' items counts in both
                "contaminated_documents_by_source": dg.MetadataValue.json(found[1]),
                "contaminated_documents_excluded": len(excluded),
            },
        )

    return StageRecord(
        stage="pretraining",
        title=f"{base_id} (pretraining)",
        curve_label="pretraining loss",
        launch_message=f"launching pretraining of {base_id} ({scale.model_preset}, {settings.max_steps} steps) on "
        f"corpus {corpus.run_hash} ({corpus.num_documents} documents, {corpus.num_tokens} tokens)",
        params={
            "model_preset": scale.model_preset,
            "scale": scale.name,
            "corpus_run_hash": corpus.run_hash,
            **settings.model_dump(),
        },
        record={
            "dataset_validation_path": corpus.root,
            "model_preset": scale.model_preset,
            "scale": scale.name,
            "stage": "pretrain",
            "parent": "scratch",
            "excluded_documents": excluded,
            "eval_side_fraction": eval_side_fraction,
        },
        figures=figures,
    )
