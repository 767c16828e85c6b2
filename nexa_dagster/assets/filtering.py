"""Judge filtering stage (SampleGate): heuristics, then the LLM judge; accepted and rejected rows both kept."""


import dagster as dg
import pandas as pd

from nexa_dagster.assets.common import MODEL_CALL_RETRY, SINGLE_RUN_BACKFILL, preview, progress_logger
from nexa_dagster.assets.partitions import daily_partitions
from nexa_dagster.assets.types import FilteredSamplesType, RejectedSamplesType, TeacherSamplesType
from nexa_dagster.core.config import load_filters, load_scale, read_text
from nexa_dagster.core.sample_gate import apply_sample_gate
from nexa_dagster.resources.llm import LLMResource


@dg.multi_asset(
    group_name="filtering",
    partitions_def=daily_partitions,
    backfill_policy=SINGLE_RUN_BACKFILL,
    retry_policy=MODEL_CALL_RETRY,
    ins={"teacher_samples": dg.AssetIn(dagster_type=TeacherSamplesType)},
    outs={
        "filtered_samples": dg.AssetOut(dagster_type=FilteredSamplesType, kinds={"parquet"},
                                        description="Samples that passed SampleGate, with the judge's score."),
        "rejected_samples": dg.AssetOut(dagster_type=RejectedSamplesType, kinds={"parquet"},
                                        description="Samples SampleGate rejected, each with its reason."),
    },
)
def sample_gate(context: dg.AssetExecutionContext, teacher_samples: pd.DataFrame,
                judge_llm: LLMResource) -> tuple[pd.DataFrame, pd.DataFrame]:
    thresholds = load_filters()
    with judge_llm.get_client() as judge:
        method = "logprobs" if judge.capabilities().logprobs else "text"
        context.log.info(f"judging {len(teacher_samples)} samples with {judge.model_id} (score from {method})")
        filtered, rejected = apply_sample_gate(teacher_samples, thresholds, judge, read_text("prompts/judge.jinja"),
                                               load_scale().judge.max_new_tokens,
                                               progress=progress_logger(context, "judged"))
    total = len(teacher_samples)
    pass_rate = len(filtered) / total if total else 0.0
    reasons = rejected["reason"].str.split(":").str[0].value_counts().to_dict() if len(rejected) else {}
    common = {"judge": dg.MetadataValue.json(judge_llm.describe()), "judge_method": method,
              "pass_rate": round(pass_rate, 4), "thresholds": "configs/filters.yaml (the demo's thresholds)"}
    context.add_output_metadata(output_name="filtered_samples", metadata={
        **common, "dagster/row_count": len(filtered),
        "mean_judge_score": round(float(filtered["judge_score"].mean()), 3) if len(filtered) else None,
        "preview": preview(filtered, ["sample_id", "response", "judge_score"]),
    })
    context.add_output_metadata(output_name="rejected_samples", metadata={
        **common, "dagster/row_count": len(rejected), "reasons": dg.MetadataValue.json(reasons),
        "preview": preview(rejected, ["sample_id", "response", "reason"]),
    })
    context.log.info(f"SampleGate kept {len(filtered)}/{total} ({pass_rate:.0%}); rejections by reason: {reasons}")
    return filtered, rejected
