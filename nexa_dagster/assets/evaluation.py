"""Evaluation stage: every checkpoint (one partition each) gets held-out loss, perplexity and a judge score."""


from pathlib import Path

import dagster as dg

from nexa_dagster.assets.common import MODEL_CALL_RETRY
from nexa_dagster.assets.partitions import checkpoint_partitions
from nexa_dagster.core import storage as io
from nexa_dagster.core.artifacts import Checkpoint, EvalReport, SFTDataset
from nexa_dagster.core.config import load_scale, load_yaml, read_text
from nexa_dagster.core.evaluation import (
    EvalResult,
    heldout_loss,
    judge_answers,
    render_markdown,
    write_report,
)
from nexa_dagster.core.tiny_model import COMPLETION_MARKER
from nexa_dagster.resources.llm import LLMResource
from nexa_dagster.resources.storage import StorageResource
from nexa_dagster.resources.tracking import TrackingResource


def load_checkpoint_record(ckpt_dir: Path, checkpoint_id: str) -> Checkpoint:
    """The checkpoint's own record, or a minimal one for a checkpoint copied into the store by hand."""
    if not (ckpt_dir / COMPLETION_MARKER).exists():
        raise dg.Failure(f"checkpoint {ckpt_dir} is not complete (no {COMPLETION_MARKER} marker)", allow_retries=False)
    record = ckpt_dir / "checkpoint.json"
    if record.exists():
        return Checkpoint.model_validate(io.read_json(record))
    return Checkpoint(checkpoint_id=checkpoint_id, path=str(ckpt_dir), num_steps=0)


@dg.asset(
    group_name="evaluation",
    partitions_def=checkpoint_partitions,
    retry_policy=MODEL_CALL_RETRY,
    deps=["moe_checkpoint"],
    kinds={"pytorch", "markdown"},
    description="Held-out loss and perplexity on the validation split the checkpoint was trained with, and the "
                "judge's mean score of its answers to the fixed held-out prompts; JSON + Markdown report in "
                "results/evaluation/reports/<checkpoint_id>/.",
)
def eval_report(context: dg.AssetExecutionContext, sft_dataset: SFTDataset, judge_llm: LLMResource,
                storage: StorageResource, tracking: TrackingResource) -> EvalReport:
    checkpoint_id = context.partition_key
    ckpt = load_checkpoint_record(storage.checkpoint_dir(checkpoint_id), checkpoint_id)
    validation_path = ckpt.dataset_validation_path or sft_dataset.validation_path
    dataset_hash = ckpt.dataset_run_hash or sft_dataset.run_hash
    scale = load_scale()

    loss = heldout_loss(ckpt.path, validation_path)
    context.log.info(f"{checkpoint_id}: validation loss {loss.loss:.4f} (ppl {loss.perplexity:.1f}) "
                     f"over {loss.tokens} tokens")
    prompts = list(load_yaml("prompts/eval_prompts.yaml"))[: scale.evaluation.num_heldout_prompts]
    with LLMResource(backend="local", model=ckpt.path).get_client() as student, judge_llm.get_client() as judge:
        answers = judge_answers(student, judge, prompts, read_text("prompts/judge.jinja"),
                                scale.evaluation.max_new_tokens, log=context.log.info)
    result = EvalResult(checkpoint_id, loss, answers)
    lineage = {"checkpoint_path": ckpt.path, "dataset_run_hash": dataset_hash, "validation_path": validation_path,
               "model_preset": ckpt.model_preset, "training_steps": ckpt.num_steps, "dagster_run_id": context.run.run_id}
    json_path, md_path = write_report(result, lineage, storage.report_dir(checkpoint_id))

    with tracking.start_run(run_name=f"eval-{checkpoint_id}", tags={"stage": "evaluation",
                                                                     "checkpoint_id": checkpoint_id}) as run:
        run.log_params(lineage)
        run.log_metrics({"validation_loss": loss.loss, "perplexity": loss.perplexity,
                         "judge_score": result.judge_score})

    report = EvalReport(
        checkpoint_id=checkpoint_id, checkpoint_path=ckpt.path, validation_loss=loss.loss,
        perplexity=loss.perplexity, validation_tokens=loss.tokens, judge_score=result.judge_score,
        judge_method=answers[0].method if answers else None, num_heldout_prompts=len(answers),
        dataset_run_hash=dataset_hash, report_json=json_path, report_markdown=md_path,
    )
    context.add_output_metadata({
        "validation_loss": round(loss.loss, 4),
        "perplexity": round(loss.perplexity, 2),
        "validation_tokens": loss.tokens,
        "judge_score": round(result.judge_score, 3) if result.judge_score is not None else None,
        "judge_method": report.judge_method,
        "dataset_run_hash": dataset_hash,
        "report": dg.MetadataValue.md(render_markdown(result, lineage)),
        "report_json": dg.MetadataValue.path(json_path),
    })
    return report
