"""Distillation: each day's documents become prompts the teacher answers, and SampleGate keeps the good answers.

* ``teacher_samples``: answers are committed one by one to a durable per-partition store
  (``core/distill/generation_store.py``) under ``<data_root>/generation_store/teacher_samples/``, so a run killed
  halfway is resumed by materializing again: stored answers are reused, only the missing ones are paid for.
* ``filtered_samples`` / ``rejected_samples`` (SampleGate): heuristics, dedup, then the LLM judge; accepted and
  rejected rows both kept, every rejection with its reason. An asset check comes with every materialization: the
  pass rate against the band in the SampleGate file (a warning: a sudden drop usually means a broken teacher or
  judge, not bad data), and the judge's validity: does it rank answers above their own words shuffled
  (``core/distill/judge_validity.py``)? The schema of both tables has one place, their pandera Dagster types: a frame that breaks
  it fails the step with the column and rows named before anything is stored.
"""

import tempfile
from pathlib import Path

import dagster as dg
import pandas as pd

from nexa_dagster.assets.common import (
    MODEL_CALL_RETRY,
    SINGLE_RUN_BACKFILL,
    no_retry_on_permanent_llm_errors,
    preview,
    progress_logger,
)
from nexa_dagster.assets.partitions import daily_partitions
from nexa_dagster.assets.types import (
    FilteredSamplesType,
    RawDocumentsType,
    RejectedSamplesType,
    TeacherSamplesType,
)
from nexa_dagster.core.common.spans import span
from nexa_dagster.core.distill.generation_store import GenerationStore
from nexa_dagster.core.distill.judge_validity import JudgeValidity, judge_validity
from nexa_dagster.core.distill.sample_gate import GateResult, apply_sample_gate, configured_judge
from nexa_dagster.core.distill.teacher import GenerationStats, build_prompts, generate_teacher_samples
from nexa_dagster.core.llm.base import SamplingParams
from nexa_dagster.resources.configs import PromptsResource, SampleGateResource
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
def teacher_samples(
    context: dg.AssetExecutionContext,
    raw_documents: pd.DataFrame,
    teacher_llm: LLMResource,
    storage: StorageResource,
    scale_preset: ScaleResource,
    prompts: PromptsResource,
) -> pd.DataFrame:
    scale = scale_preset.load()
    params = SamplingParams(
        max_tokens=scale.teacher.max_new_tokens,
        temperature=scale.teacher.temperature,
        top_p=scale.teacher.top_p,
        seed=scale.teacher.seed,
    )
    store_dir = generation_store_dir(storage)
    with (
        no_retry_on_permanent_llm_errors(f"teacher {teacher_llm.where()}"),
        teacher_llm.get_client(log=context.log) as teacher,
        GenerationStore(store_dir) as store,
    ):
        requests = build_prompts(
            raw_documents,
            prompts.text("teacher"),
            prompts.text("teacher_system"),
            teacher.identity,
            params,
            scale.generations_per_prompt,
        )
        context.log.info(
            f"{len(requests)} teacher prompts for {teacher!r} (identity {teacher.identity}); "
            f"store {store_dir}"
        )
        with progress_logger(context, "teacher answers") as progress:
            samples, stats = generate_teacher_samples(
                teacher, requests, params, store, batch_size=teacher_llm.batch(), progress=progress
            )
    if len(samples) and stats.failed == len(samples):
        # nothing came back at all: the endpoint is down or misconfigured, not a few flaky requests
        raise dg.Failure(f"every teacher request failed; first error: {samples['error'].iloc[0]}")
    context.log.info(
        f"{stats.reused} answers reused from the store, {stats.generated} generated, "
        f"{stats.failed} failed ({stats.tokens_per_s:.1f} generated tokens/s)"
    )
    context.add_output_metadata(teacher_metadata(samples, stats, teacher_llm, scale.name, params, store_dir))
    return samples


def teacher_metadata(
    samples: pd.DataFrame,
    stats: GenerationStats,
    teacher_llm: LLMResource,
    scale: str,
    params: SamplingParams,
    store_dir: Path,
) -> dict[str, object]:
    """What a person reads on the day's teacher samples: the teacher, what was reused, generated or failed, tokens,
    speed and latency, the sampling, an estimated cost when the teacher has a price, a preview."""
    metadata: dict[str, object] = {
        "dagster/row_count": len(samples),
        "teacher": dg.MetadataValue.json(teacher_llm.describe()),
        "scale": scale,
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
    return metadata


@dg.multi_asset(
    group_name="filtering",
    partitions_def=daily_partitions,
    backfill_policy=SINGLE_RUN_BACKFILL,
    retry_policy=MODEL_CALL_RETRY,
    ins={"teacher_samples": dg.AssetIn(dagster_type=TeacherSamplesType)},
    outs={
        "filtered_samples": dg.AssetOut(
            dagster_type=FilteredSamplesType,
            kinds={"parquet"},
            description="Samples that passed SampleGate, with the judge's verdict.",
        ),
        "rejected_samples": dg.AssetOut(
            dagster_type=RejectedSamplesType,
            kinds={"parquet"},
            description="Samples SampleGate rejected, each with its reason code and "
            "the judge's score and rationale when it saw them.",
        ),
    },
    check_specs=[
        dg.AssetCheckSpec(
            "pass_rate_in_band",
            asset="filtered_samples",
            description="Warns when the share of samples that pass leaves the SampleGate file's "
            "pass_rate_band (configs/filters.yaml by default).",
        ),
        dg.AssetCheckSpec(
            "judge_prefers_real_answers",
            asset="filtered_samples",
            description="Warns when the judge does not score the day's answers above the same answers' words "
            "shuffled (one-sided sign test, p <= 0.05 over judge.validity_pairs pairs): its scores would "
            "not be reading the answers.",
        ),
    ],
)
def sample_gate(
    context: dg.AssetExecutionContext,
    teacher_samples: pd.DataFrame,
    judge_llm: LLMResource,
    storage: StorageResource,
    sample_gate_config: SampleGateResource,
    prompts: PromptsResource,
):
    config = sample_gate_config.config()
    dedup_root = storage.path("dedup", "filtered_samples")
    with (
        no_retry_on_permanent_llm_errors(f"judge {judge_llm.where()}"),
        judge_llm.get_client(log=context.log) as judge,
        progress_logger(context, "gated") as progress,
        span(context.log.info, "work", "judging"),  # the gate's verdicts and the judge's validity check
    ):
        result = apply_sample_gate(
            teacher_samples,
            config,
            judge,
            prompts.text("judge"),
            prompts.text("judge_verdict"),
            dedup_root,
            progress=progress,
        )
        judged = pd.concat([result.filtered, result.rejected])
        validity = judge_validity(  # the same judge on the day's answers with their words shuffled
            configured_judge(judge, config, prompts.text("judge"), prompts.text("judge_verdict")),
            judged,
            config.judge.validity_pairs,
        )
    context.log.info(
        f"judged {result.judged} samples with {judge_llm.describe()['model']} (method "
        f"{result.judge_method}; engine offers {result.judge_capabilities})"
    )
    common = {
        "judge": dg.MetadataValue.json(judge_llm.describe()),
        "judge_method": result.judge_method,
        "judge_capabilities": dg.MetadataValue.json(result.judge_capabilities),
        "pass_rate": round(result.pass_rate, 4),
        "thresholds": f"configs/{sample_gate_config.file}",
    }
    yield from gate_outputs(result, common)
    yield pass_rate_check(result, config.pass_rate_band)
    yield judge_validity_check(validity, judged)
    context.log.info(
        f"SampleGate kept {len(result.filtered)}/{result.total} ({result.pass_rate:.0%}); rejections by "
        f"reason: {result.reason_counts()}"
    )


def gate_outputs(result: GateResult, common: dict[str, object]) -> tuple[dg.Output, dg.Output]:
    """The kept and the rejected samples, each with what a person reads first (scores, reasons, previews)."""
    filtered, rejected, reasons = result.filtered, result.rejected, result.reason_counts()
    kept = dg.Output(
        filtered,
        output_name="filtered_samples",
        metadata={
            **common,
            "dagster/row_count": len(filtered),
            "mean_judge_score": round(float(filtered["judge_score"].mean()), 3) if len(filtered) else None,
            "dedup_history_partitions": len(result.history_partitions),
            "preview": preview(filtered, ["sample_id", "response", "judge_score"]),
        },
    )
    set_aside = dg.Output(
        rejected,
        output_name="rejected_samples",
        metadata={
            **common,
            "dagster/row_count": len(rejected),
            "reasons": dg.MetadataValue.json(reasons),
            "judge_errors": reasons.get("judge_error", 0),
            "duplicates": reasons.get("exact_duplicate", 0) + reasons.get("near_duplicate", 0),
            "judged": result.judged,
            "judge_attempts": result.judge_attempts,
            "preview": preview(rejected, ["sample_id", "response", "reason"]),
        },
    )
    return kept, set_aside


def pass_rate_check(result: GateResult, band: tuple[float, float]) -> dg.AssetCheckResult:
    """Warns when the share of samples kept leaves the SampleGate file's band."""
    lo, hi = band
    return dg.AssetCheckResult(
        asset_key="filtered_samples",
        check_name="pass_rate_in_band",
        passed=bool(result.total == 0 or lo <= result.pass_rate <= hi),
        severity=dg.AssetCheckSeverity.WARN,
        metadata={
            "pass_rate": round(result.pass_rate, 4),
            "band": dg.MetadataValue.json([lo, hi]),
            "samples": result.total,
            "reasons": dg.MetadataValue.json(result.reason_counts()),
        },
    )


def judge_validity_check(validity: JudgeValidity, judged: pd.DataFrame) -> dg.AssetCheckResult:
    """The judge's ranking of real answers above their shuffled words, and its scores' spread on the day."""
    scores = judged["judge_score"].dropna()
    return dg.AssetCheckResult(
        asset_key="filtered_samples",
        check_name="judge_prefers_real_answers",
        passed=validity.valid,
        severity=dg.AssetCheckSeverity.WARN,
        description=None
        if validity.decided
        else f"undecided: {validity.pairs} rankable pairs, fewer than {validity.min_pairs}",
        metadata={
            "pairs": validity.pairs,
            "wins": validity.wins,
            "ties": validity.ties,
            "losses": validity.losses,
            "win_rate": round(validity.win_rate, 3),
            "p_value": round(validity.p_value, 4),
            "method": "one-sided exact sign test vs a judge that cannot tell them apart (ties: not a win)",
            "decided": validity.decided,
            "shuffled_without_verdict": validity.shuffled_errors,
            "judge_score_mean": round(float(scores.mean()), 3) if len(scores) else None,
            "judge_score_std": round(float(scores.std()), 3) if len(scores) > 1 else None,
            "examples": dg.MetadataValue.json(validity.examples),
        },
    )
