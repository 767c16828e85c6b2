"""Teacher generation stage: each document becomes a prompt, the teacher model answers it.

Answers are committed one by one to a durable per-partition store (``core.generation_store``) under
``<data_root>/generation_store/teacher_samples/``, so a run killed halfway is resumed by materializing again:
stored answers are reused, only the missing ones are paid for. The metadata says how many of each.
"""

import tempfile
from pathlib import Path

import dagster as dg
import pandas as pd

from nexa_dagster.assets.common import MODEL_CALL_RETRY, SINGLE_RUN_BACKFILL, preview, progress_logger
from nexa_dagster.assets.llm_failures import no_retry_on_permanent_llm_errors
from nexa_dagster.assets.partitions import daily_partitions
from nexa_dagster.assets.types import RawDocumentsType, TeacherSamplesType
from nexa_dagster.core.common.config import read_text
from nexa_dagster.core.distill.generation_store import GenerationStore
from nexa_dagster.core.distill.teacher import build_prompts, generate_teacher_samples
from nexa_dagster.core.llm.base import SamplingParams
from nexa_dagster.resources.llm import LLMResource
from nexa_dagster.resources.scale import ScaleResource
from nexa_dagster.resources.storage import StorageResource


def generation_store_dir(storage: StorageResource) -> Path:
    """A local directory (SQLite needs one): under the data root when it is local, else a local cache."""
    if "://" in storage.data_root:
        return Path(tempfile.gettempdir()) / "nexa-generation-store" / "teacher_samples"
    return Path(storage.root) / "generation_store" / "teacher_samples"


@dg.asset(
    group_name="distillation",
    partitions_def=daily_partitions,
    backfill_policy=SINGLE_RUN_BACKFILL,
    retry_policy=MODEL_CALL_RETRY,
    ins={"raw_documents": dg.AssetIn(dagster_type=RawDocumentsType)},
    dagster_type=TeacherSamplesType,
    kinds={"python", "parquet"},
    description="Prompts rendered from configs/prompts/teacher.jinja and the teacher model's answers (and "
                "reasoning traces when the teacher returns them), with model id, token counts and latency per "
                "sample. Resumable: answers already paid for are reused from the generation store.",
)
def teacher_samples(context: dg.AssetExecutionContext, raw_documents: pd.DataFrame, teacher_llm: LLMResource,
                    storage: StorageResource, scale_preset: ScaleResource) -> pd.DataFrame:
    scale = scale_preset.load()
    params = SamplingParams(max_tokens=scale.teacher.max_new_tokens, temperature=scale.teacher.temperature,
                            top_p=scale.teacher.top_p, seed=scale.teacher.seed)
    store_dir = generation_store_dir(storage)
    with (no_retry_on_permanent_llm_errors(f"teacher {teacher_llm.where()}"),
          teacher_llm.get_client(log=context.log) as teacher, GenerationStore(store_dir) as store):
        prompts = build_prompts(raw_documents, read_text("prompts/teacher.jinja"),
                                read_text("prompts/teacher_system.txt").strip(), teacher.identity, params,
                                scale.generations_per_prompt)
        context.log.info(f"{len(prompts)} teacher prompts for {teacher!r} (identity {teacher.identity}); "
                         f"store {store_dir}")
        with progress_logger(context, "teacher answers") as progress:
            samples, stats = generate_teacher_samples(teacher, prompts, params, store,
                                                      batch_size=teacher_llm.batch(), progress=progress)
    if len(samples) and stats.failed == len(samples):
        # nothing came back at all: the endpoint is down or misconfigured, not a few flaky requests
        raise dg.Failure(f"every teacher request failed; first error: {samples['error'].iloc[0]}")
    context.log.info(f"{stats.reused} answers reused from the store, {stats.generated} generated, "
                     f"{stats.failed} failed ({stats.tokens_per_s:.1f} generated tokens/s)")
    metadata: dict[str, object] = {
        "dagster/row_count": len(samples),
        "teacher": dg.MetadataValue.json(teacher_llm.describe()),
        "scale": scale.name,
        "reused": stats.reused,
        "generated": stats.generated,
        "failed_requests": stats.failed,
        "prompt_tokens": int(samples["prompt_tokens"].sum()),
        "completion_tokens": int(samples["completion_tokens"].sum()),
        "generated_prompt_tokens": stats.prompt_tokens,
        "generated_completion_tokens": stats.completion_tokens,
        "generation_wall_s": round(stats.wall_s, 3),
        "tokens_per_s": round(stats.tokens_per_s, 2),
        "mean_latency_s": round(float(samples["latency_s"].mean()), 4) if len(samples) else 0.0,
        "with_reasoning": int(samples["reasoning"].notna().sum()),
        "sampling": dg.MetadataValue.json(params.__dict__),
        "generation_store": dg.MetadataValue.path(str(store_dir)),
        "preview": preview(samples, ["sample_id", "prompt", "response", "completion_tokens"]),
    }
    if (prices := teacher_llm.price_per_1m_tokens()) is not None:
        metadata["estimated_cost_usd"] = round(stats.cost(*prices), 6)
    context.add_output_metadata(metadata)
    return samples
