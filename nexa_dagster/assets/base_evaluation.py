"""Base models' evaluation: every base model (one partition each) scored on the frozen eval set's corpus documents.

The documents are frozen with the eval-set version (``eval_set``) from the pretraining corpus, on a side no base
model trains on, so base models trained on different corpora (a later, bigger one) are measured on the same
documents and their leaderboard rows compare. The model runs in the evaluation worker on the GPU cluster, as SFT
checkpoints do (``eval_report``); the bootstrap interval is computed here.
"""

import dagster as dg

from nexa_dagster.assets.common import MODEL_CALL_RETRY
from nexa_dagster.assets.evaluation import frozen_eval_set
from nexa_dagster.assets.partitions import base_model_partitions
from nexa_dagster.core.common import roots
from nexa_dagster.core.common import storage as io
from nexa_dagster.core.common.artifacts import BaseModelEval, Checkpoint
from nexa_dagster.core.evaluation.base_model import CorpusScores, corpus_scores
from nexa_dagster.core.evaluation.worker import EvaluationJob
from nexa_dagster.resources.configs import EvalSetsResource, PromotionResource
from nexa_dagster.resources.gpu_cluster import GPUClusterResource
from nexa_dagster.resources.storage import StorageResource
from nexa_dagster.resources.tracking import TrackingResource


def base_checkpoint(storage: StorageResource, base_id: str) -> Checkpoint:
    """The base model's own record (``checkpoint.json``), read from the folder it lies in; its id is the folder's
    (the partition), as for SFT checkpoints (``load_checkpoint_record``), so a copy never reports as its original."""
    directory = storage.path("base_models", base_id)
    record = io.join(directory, "checkpoint.json")
    if not io.exists(record):
        raise dg.Failure(
            f"base model {base_id}: no {record} (not a completed base_model)", allow_retries=False
        )
    fields = io.read_json(record)
    stored = fields.get("dataset_validation_path")
    return Checkpoint.model_validate(
        {
            **fields,
            "path": directory,
            "checkpoint_id": base_id,
            "dataset_validation_path": roots.resolve_under(stored, storage.root) if stored else None,
        }
    )


@dg.asset(
    group_name="evaluation",
    partitions_def=base_model_partitions,
    pool="gpu",
    retry_policy=MODEL_CALL_RETRY,
    deps=["base_model", "eval_set"],
    kinds={"pytorch"},
    # each new base model once, when it and an eval set exist (the default automation sensor requests it); an
    # eager condition would re-evaluate every old base model whenever base_model materializes again; never while
    # the eval set's blocking check (its files match their manifest) fails
    automation_condition=dg.AutomationCondition.on_missing()
    & dg.AutomationCondition.all_deps_blocking_checks_passed(),
    description="A base model scored on the corpus documents frozen with eval set eval_set.version (never in any "
    "base model's training) in the evaluation worker on the GPU cluster: per-document loss, loss and "
    "perplexity with a bootstrap interval; results/evaluation/reports/<base id>/base_eval.json, MLflow "
    "and the leaderboard (rows of one eval-set version are measured on the same documents).",
)
def base_model_eval(
    context: dg.AssetExecutionContext,
    gpu_cluster: GPUClusterResource,
    storage: StorageResource,
    tracking: TrackingResource,
    eval_sets: EvalSetsResource,
    promotion_policy: PromotionResource,
) -> dg.Output[BaseModelEval]:
    base_id = context.partition_key
    base = base_checkpoint(storage, base_id)
    version, policy = eval_sets.version, promotion_policy.policy()
    eval_set = corpus_eval_set(storage, version, base_id)
    scores = score_on_corpus(context, gpu_cluster, storage, base, eval_set)
    measured = corpus_scores(
        eval_set["corpus_path"],
        [float(v) for v in scores["nll"]],
        [int(v) for v in scores["tokens"]],
        policy.confidence,
        policy.bootstrap_resamples,
        policy.interval_method,
    )
    loss, ppl = measured.loss, measured.perplexity
    context.log.info(
        f"{base_id}: loss {loss.estimate:.4f} [{loss.low:.4f}, {loss.high:.4f}] (perplexity "
        f"{ppl.estimate:.1f}) on the {len(measured.nll)} corpus documents of eval set v{version}"
    )
    lineage = {
        "eval_set_version": version,
        "documents_sha256": eval_set["files"]["corpus.parquet"],
        "eval_corpus_run_hash": eval_set["corpus"]["run_hash"],
        "corpus_run_hash": base.dataset_run_hash,
        "checkpoint_path": base.path,
        "dagster_run_id": context.run.run_id,
    }
    report_json = io.join(storage.report_dir(base_id), "base_eval.json")
    io.write_json({"checkpoint_id": base_id, **measured.to_json(), "lineage": lineage}, report_json)
    mlflow_run_id = log_base_eval(tracking, base_id, lineage, measured, report_json)
    report = base_eval_record(base, eval_set, lineage, measured, report_json, mlflow_run_id)
    return dg.Output(report, metadata=base_eval_metadata(report))


def corpus_eval_set(storage: StorageResource, version: int, base_id: str) -> dict:
    """The manifest of eval set ``version``, which must hold frozen corpus documents: a base model is measured on
    those; a version frozen without them is a failure naming what to do."""
    eval_set = frozen_eval_set(storage, version, base_id)
    if not eval_set.get("corpus_path"):
        raise dg.Failure(
            f"eval set v{version} was frozen without pretraining-corpus documents (no pretrain_corpus "
            "was materialized then), so base models cannot be measured on it: set eval_set.version in "
            "configs/pipeline.yaml to a new number and materialize eval_set after pretrain_corpus",
            allow_retries=False,
        )
    return eval_set


def score_on_corpus(
    context: dg.AssetExecutionContext,
    gpu_cluster: GPUClusterResource,
    storage: StorageResource,
    base: Checkpoint,
    eval_set: dict,
) -> dict:
    """The base model's per-document loss and token counts on the eval set's corpus documents, from the evaluation
    worker on the GPU cluster (no prompts to answer: one new token at most)."""
    work_dir = io.local_dir(storage.path("runs", f"eval-{base.checkpoint_id}"))
    job = EvaluationJob(
        run_id=base.checkpoint_id,
        models={"base": base.path},
        examples_path=eval_set["corpus_path"],
        eval_set_version=eval_set["version"],
        prompts=[],
        max_new_tokens=1,
        accelerator=gpu_cluster.accelerator,
        output_path=str(work_dir / "scores.json"),
    )
    return gpu_cluster.run_evaluation(context, job, work_dir)["scores"]["base"]


def log_base_eval(
    tracking: TrackingResource, base_id: str, lineage: dict, measured: CorpusScores, report_json: str
) -> str:
    """The evaluation as an MLflow run (its lineage, the loss with its interval, the perplexity, the report);
    returns the run's id."""
    loss = measured.loss
    with tracking.start_run(
        run_name=f"eval-{base_id}", tags={"stage": "base_evaluation", "checkpoint_id": base_id}
    ) as run:
        run.log_params(lineage)
        run.log_metrics(
            {
                "corpus_eval_loss": loss.estimate,
                "corpus_eval_loss_low": loss.low,
                "corpus_eval_loss_high": loss.high,
                "corpus_eval_perplexity": measured.perplexity.estimate,
            }
        )
        run.log_stored_file(report_json, "base_eval.json")
        return run.run_id


def base_eval_record(
    base: Checkpoint,
    eval_set: dict,
    lineage: dict,
    measured: CorpusScores,
    report_json: str,
    mlflow_run_id: str,
) -> BaseModelEval:
    """What the leaderboard reads of the evaluation: the figures with their intervals, and on what they were
    measured."""
    loss, ppl = measured.loss, measured.perplexity
    return BaseModelEval(
        checkpoint_id=base.checkpoint_id,
        checkpoint_path=base.path,
        eval_set_version=lineage["eval_set_version"],
        eval_set_sha256=eval_set.get("content_sha256"),
        corpus_run_hash=base.dataset_run_hash,
        eval_corpus_run_hash=lineage["eval_corpus_run_hash"],
        documents=len(measured.nll),
        tokens=sum(measured.tokens),
        loss=loss.estimate,
        loss_interval=(loss.low, loss.high),
        perplexity=ppl.estimate,
        perplexity_interval=(ppl.low, ppl.high),
        documents_sha256=lineage["documents_sha256"],
        report_json=report_json,
        mlflow_run_id=mlflow_run_id,
    )


def base_eval_metadata(report: BaseModelEval) -> dict[str, object]:
    """What a person reads on the materialization: the loss with its interval, the perplexity, on what."""
    return {
        "eval_set_version": report.eval_set_version,
        "eval_loss": round(report.loss, 4),
        "eval_loss_interval": dg.MetadataValue.json(list(report.loss_interval)),
        "perplexity": round(report.perplexity, 2),
        "documents": report.documents,
        "tokens": report.tokens,
        "documents_sha256": report.documents_sha256,
        "corpus_run_hash": report.corpus_run_hash or "",
        "eval_corpus_run_hash": report.eval_corpus_run_hash or "",
        "report_json": dg.MetadataValue.path(report.report_json),
        "mlflow_run_id": report.mlflow_run_id,
    }
