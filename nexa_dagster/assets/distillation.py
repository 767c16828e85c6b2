"""Teacher generation stage: each document becomes a prompt, the teacher model answers it."""


import dagster as dg
import pandas as pd

from nexa_dagster.assets.common import MODEL_CALL_RETRY, SINGLE_RUN_BACKFILL, preview, progress_logger
from nexa_dagster.assets.partitions import daily_partitions
from nexa_dagster.assets.types import RawDocumentsType, TeacherSamplesType
from nexa_dagster.core.config import load_scale, read_text
from nexa_dagster.core.distillation import build_prompts, generate_teacher_samples
from nexa_dagster.core.llm.base import SamplingParams
from nexa_dagster.resources.llm import LLMResource


@dg.asset(
    group_name="distillation",
    partitions_def=daily_partitions,
    backfill_policy=SINGLE_RUN_BACKFILL,
    retry_policy=MODEL_CALL_RETRY,
    ins={"raw_documents": dg.AssetIn(dagster_type=RawDocumentsType)},
    dagster_type=TeacherSamplesType,
    kinds={"python", "parquet"},
    description="Prompts rendered from configs/prompts/teacher.jinja and the teacher model's answers, with "
                "model id, token counts and latency per sample.",
)
def teacher_samples(context: dg.AssetExecutionContext, raw_documents: pd.DataFrame,
                    teacher_llm: LLMResource) -> pd.DataFrame:
    scale = load_scale()
    params = SamplingParams(max_tokens=scale.teacher.max_new_tokens, temperature=scale.teacher.temperature,
                            top_p=scale.teacher.top_p, seed=scale.teacher.seed)
    with teacher_llm.get_client() as teacher:
        prompts = build_prompts(raw_documents, read_text("prompts/teacher.jinja"),
                                read_text("prompts/teacher_system.txt").strip(), teacher.model_id, params,
                                scale.generations_per_prompt)
        context.log.info(f"asking {teacher.model_id} for {len(prompts)} answers")
        samples = generate_teacher_samples(teacher, prompts, params, batch_size=teacher_llm.batch_size,
                                           progress=progress_logger(context, "teacher answers"))
    failed = int(samples["error"].notna().sum())
    if len(samples) and failed == len(samples):
        # nothing came back at all: the endpoint is down or misconfigured, not a few flaky requests
        raise dg.Failure(f"every teacher request failed; first error: {samples['error'].iloc[0]}")
    context.add_output_metadata({
        "dagster/row_count": len(samples),
        "teacher": dg.MetadataValue.json(teacher_llm.describe()),
        "failed_requests": failed,
        "prompt_tokens": int(samples["prompt_tokens"].sum()),
        "completion_tokens": int(samples["completion_tokens"].sum()),
        "mean_latency_s": round(float(samples["latency_s"].mean()), 4),
        "sampling": dg.MetadataValue.json(params.__dict__),
        "preview": preview(samples, ["sample_id", "prompt", "response", "completion_tokens"]),
    })
    return samples
