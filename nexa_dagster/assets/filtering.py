"""Judge filtering stage (SampleGate): heuristics, dedup, then the LLM judge; accepted and rejected rows both kept.

An asset check comes with every materialization: the pass rate against the band in ``configs/filters.yaml`` (a
warning: a sudden drop usually means a broken teacher or judge, not bad data). The schema of both tables has one
place, their pandera Dagster types: a frame that breaks it fails the step with the column and rows named before
anything is stored (a separate schema check could never fail, since the type check runs first).
"""

import dagster as dg
import pandas as pd

from nexa_dagster.assets.common import MODEL_CALL_RETRY, SINGLE_RUN_BACKFILL, preview, progress_logger
from nexa_dagster.assets.llm_failures import no_retry_on_permanent_llm_errors
from nexa_dagster.assets.partitions import daily_partitions
from nexa_dagster.assets.types import FilteredSamplesType, RejectedSamplesType, TeacherSamplesType
from nexa_dagster.core.common.config import read_text
from nexa_dagster.core.distill.sample_gate import apply_sample_gate, load_gate_config
from nexa_dagster.resources.llm import LLMResource
from nexa_dagster.resources.storage import StorageResource

FILTERS_FILE = "filters.yaml"


@dg.multi_asset(
    group_name="filtering",
    partitions_def=daily_partitions,
    backfill_policy=SINGLE_RUN_BACKFILL,
    retry_policy=MODEL_CALL_RETRY,
    ins={"teacher_samples": dg.AssetIn(dagster_type=TeacherSamplesType)},
    outs={
        "filtered_samples": dg.AssetOut(dagster_type=FilteredSamplesType, kinds={"parquet"},
                                        description="Samples that passed SampleGate, with the judge's verdict."),
        "rejected_samples": dg.AssetOut(dagster_type=RejectedSamplesType, kinds={"parquet"},
                                        description="Samples SampleGate rejected, each with its reason code and "
                                                    "the judge's score and rationale when it saw them."),
    },
    check_specs=[
        dg.AssetCheckSpec("pass_rate_in_band", asset="filtered_samples",
                          description="Warns when the share of samples that pass leaves configs/filters.yaml's "
                                      "pass_rate_band."),
    ],
)
def sample_gate(context: dg.AssetExecutionContext, teacher_samples: pd.DataFrame, judge_llm: LLMResource,
                storage: StorageResource):
    config = load_gate_config(FILTERS_FILE)
    dedup_root = storage.path("dedup", "filtered_samples")
    with (no_retry_on_permanent_llm_errors(f"judge {judge_llm.where()}"),
          judge_llm.get_client(log=context.log) as judge, progress_logger(context, "gated") as progress):
        result = apply_sample_gate(teacher_samples, config, judge, read_text("prompts/judge.jinja"),
                                   read_text("prompts/judge_verdict.jinja"), dedup_root, progress=progress)
    context.log.info(f"judged {result.judged} samples with {judge_llm.describe()['model']} (method "
                     f"{result.judge_method}; engine offers {result.judge_capabilities})")
    filtered, rejected, reasons = result.filtered, result.rejected, result.reason_counts()
    common = {"judge": dg.MetadataValue.json(judge_llm.describe()), "judge_method": result.judge_method,
              "judge_capabilities": dg.MetadataValue.json(result.judge_capabilities),
              "pass_rate": round(result.pass_rate, 4), "thresholds": f"configs/{FILTERS_FILE}"}
    yield dg.Output(filtered, output_name="filtered_samples", metadata={
        **common, "dagster/row_count": len(filtered),
        "mean_judge_score": round(float(filtered["judge_score"].mean()), 3) if len(filtered) else None,
        "dedup_history_partitions": len(result.history_partitions),
        "preview": preview(filtered, ["sample_id", "response", "judge_score"]),
    })
    yield dg.Output(rejected, output_name="rejected_samples", metadata={
        **common, "dagster/row_count": len(rejected), "reasons": dg.MetadataValue.json(reasons),
        "judge_errors": reasons.get("judge_error", 0),
        "duplicates": reasons.get("exact_duplicate", 0) + reasons.get("near_duplicate", 0),
        "judged": result.judged, "judge_attempts": result.judge_attempts,
        "preview": preview(rejected, ["sample_id", "response", "reason"]),
    })
    lo, hi = config.pass_rate_band
    yield dg.AssetCheckResult(
        asset_key="filtered_samples", check_name="pass_rate_in_band",
        passed=bool(result.total == 0 or lo <= result.pass_rate <= hi), severity=dg.AssetCheckSeverity.WARN,
        metadata={"pass_rate": round(result.pass_rate, 4), "band": dg.MetadataValue.json([lo, hi]),
                  "samples": result.total, "reasons": dg.MetadataValue.json(reasons)})
    context.log.info(f"SampleGate kept {len(filtered)}/{result.total} ({result.pass_rate:.0%}); rejections by "
                     f"reason: {reasons}")
