"""Preference stage: pairs judged every night from the production model, packed, then DPO from it.

* ``preference_pairs`` (daily): the day's training prompts (never the eval set's side) answered K times by the
  model in production (on-policy), every answer judged as SampleGate judges the teacher's; the best answer that
  passes the heuristics against the worst one is a pair when their scores differ enough.
* ``preference_dataset``: every day's pairs so far, checked for contamination, tokenized as TRL's DPOTrainer
  tokenizes them, stored day by day (a night tokenizes only its day) and split by pair id.
* ``preference_checkpoint``: DPO in the project's own training worker and DeepSpeed engine, from the production
  SFT checkpoint, with reference log-probabilities computed once per pair set and reference (never a second model
  in memory). It is evaluated like any checkpoint; the gate decides on the judge's win rate against production.
"""

import contextlib
import math
from collections.abc import Iterator
from dataclasses import replace

import dagster as dg
import pandas as pd
from pydantic import Field

from nexa_dagster.assets.checkpoint_launch import (
    StageFigures,
    StageRecord,
    launch_and_record,
    origin,
    preset_on_cluster,
    registered,
)
from nexa_dagster.assets.common import (
    IMPORTS_MODELS,
    MODEL_CALL_RETRY,
    no_retry_on_permanent_llm_errors,
    preview,
    progress_logger,
)
from nexa_dagster.assets.packaging import (
    contamination_index,
    contamination_metadata,
    load_student_tokenizer,
    read_documents,
    task_settings,
)
from nexa_dagster.assets.partitions import daily_partitions
from nexa_dagster.assets.production import (  # noqa: F401 (production_model_asset: loaded with this module)
    PRODUCTION_MODEL,
    production_metadata,
    production_model_asset,
)
from nexa_dagster.assets.training import checkpoint_id_for, loads_with_transformers, training_summary
from nexa_dagster.assets.types import FilteredSamplesType, PreferencePairsType
from nexa_dagster.core.common import storage as io
from nexa_dagster.core.common.artifacts import Checkpoint, PreferenceDataset
from nexa_dagster.core.common.config import PreferenceSettings, ScalePreset, TrainingSettings
from nexa_dagster.core.data import schemas
from nexa_dagster.core.distill.generation_store import GenerationStore
from nexa_dagster.core.distill.judge import Judge
from nexa_dagster.core.distill.pairs import (
    AnswerScorer,
    JudgeScorer,
    PairStats,
    RewardScorer,
    gap_histogram,
    make_pairs,
    pair_problems,
)
from nexa_dagster.core.distill.sample_gate import GateConfig
from nexa_dagster.core.evaluation.promotion import ProductionEntry, ProductionRegistry
from nexa_dagster.core.llm.base import SamplingParams
from nexa_dagster.core.llm.model_identity import model_fingerprint
from nexa_dagster.core.packaging.decontaminate import decontaminate, record_inputs, template_segments
from nexa_dagster.core.packaging.preference_dataset import (
    ModelLimits,
    build_preference_dataset,
    pair_texts,
    pairs_to_jsonl,
    snapshot_problems,
)
from nexa_dagster.core.packaging.sft_dataset import DayInput, day_inputs_from_partitions
from nexa_dagster.core.rl.rewards import reward_function
from nexa_dagster.core.rl.tasks import build_tasks
from nexa_dagster.core.training.init import read_config
from nexa_dagster.core.training.job import DPOObjective, TrainingJob, TrainingResult
from nexa_dagster.resources.configs import (
    EvalSetsResource,
    PackagingResource,
    PromotionResource,
    PromptsResource,
    SampleGateResource,
)
from nexa_dagster.resources.gpu_cluster import GPUClusterResource
from nexa_dagster.resources.io_manager import stored_partitions
from nexa_dagster.resources.llm import LLMResource
from nexa_dagster.resources.scale import ScaleResource
from nexa_dagster.resources.storage import StorageResource
from nexa_dagster.resources.tracking import TrackingResource

# The model in production, as the stage reads it: the production pointer, and the asset whose events say
# which checkpoint it names (assets/production.py: every promotion and rollback records one).


PAIRS = dg.AssetKey("preference_pairs")
PAIRS_PASSED = "pairs_are_trainable"  # the materialization's metadata: whether its blocking check passed


def refused_days(instance: dg.DagsterInstance, days: list[str]) -> list[str]:
    """The days among ``days`` whose latest ``preference_pairs`` materialization failed its blocking check (its
    metadata says so): their file is on disk, and no DPO run, automated or launched by hand, trains on it. A day
    whose materialization does not say (recorded by a version before this one) is not refused."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=PAIRS, asset_partitions=days), limit=max(len(days), 1) * 50
    ).records  # newest first: the first of each day is its latest
    verdicts: dict[str, bool] = {}
    for record in records:
        value = (
            record.asset_materialization.metadata.get(PAIRS_PASSED) if record.asset_materialization else None
        )
        if record.partition_key not in verdicts and value is not None:
            verdicts[str(record.partition_key)] = bool(value.value)
        verdicts.setdefault(str(record.partition_key), True)
    return sorted(day for day, passed in verdicts.items() if not passed)


def preference_settings(scale: ScalePreset) -> PreferenceSettings:
    if scale.preference is None:
        raise dg.Failure(f"scale preset {scale.name!r} has no preference section", allow_retries=False)
    return scale.preference


def require_production(storage: StorageResource) -> ProductionEntry:
    """The production pointer's entry, which the preference and RL stages answer with and train from; none yet is
    a failure that says why. (Not the ``production_model`` asset: that is the pointer's history of events.)"""
    production = ProductionRegistry(storage.production_pointer()).current()
    if production is None:
        raise dg.Failure(
            "no production model yet: the preference stage answers with, and trains from, the model in production; "
            "promote an SFT checkpoint first (training_job, then evaluation_job)",
            allow_retries=False,
        )
    return production


def model_limits(production: ProductionEntry) -> ModelLimits:
    """The token ids and sequence length the production model (DPO's starting point) can take."""
    config = read_config(production.checkpoint_path)
    return ModelLimits(int(config["vocab_size"]), int(config["max_position_embeddings"]))


@dg.asset(
    group_name="preference",
    partitions_def=daily_partitions,
    retry_policy=MODEL_CALL_RETRY,
    ins={
        "filtered_samples": dg.AssetIn(dagster_type=FilteredSamplesType),
        "raw_documents": dg.AssetIn(
            dagster_type=dg.Nothing
        ),  # preference.rank_by reward: the checkable tasks
    },
    deps=[PRODUCTION_MODEL],  # on-policy: the model in production answers
    check_specs=[
        dg.AssetCheckSpec(
            "pairs_are_trainable",
            asset="preference_pairs",
            blocking=True,  # a failing day fails its run; the DPO sensor does not train on it (sensors/preference)
            description="Every policy answer asked for arrived (a failed request leaves its prompt fewer "
            "candidates: making the day again asks again), and every pair of the day: its pair_id the hash of "
            "sample and answers and not repeated, chosen and rejected different texts, the score gap at least "
            "min_score_gap and equal to chosen minus rejected, no prompt on the eval set's held-out side.",
        )
    ],
    dagster_type=PreferencePairsType,
    kinds={"python", "parquet"},
    description="The day's training prompts answered K times by the production model (on-policy) and scored "
    "(preference.rank_by: judge, as SampleGate judges the teacher, on the day's judged samples; reward, a "
    "verifiable reward on the checkable tasks of the day's documents, core/rl/tasks.py, train side only); per "
    "prompt, the best answer against the worst, when their scores differ by min_score_gap: TRL's "
    "prompt/chosen/rejected with both scores, models, lengths, day.",
)
def preference_pairs(
    context: dg.AssetExecutionContext,
    filtered_samples: pd.DataFrame,
    policy_llm: LLMResource,
    judge_llm: LLMResource,
    storage: StorageResource,
    scale_preset: ScaleResource,
    eval_sets: EvalSetsResource,
    sample_gate_config: SampleGateResource,
    prompts: PromptsResource,
    packaging_config: PackagingResource,
) -> Iterator[dg.Output[pd.DataFrame] | dg.AssetCheckResult]:
    scale = scale_preset.load()
    settings = preference_settings(scale)
    production = require_production(storage)
    policy = policy_llm.for_model(production.checkpoint_path)
    sampling = settings.sampling
    params = SamplingParams(sampling.max_new_tokens, sampling.temperature, sampling.top_p, sampling.seed)
    gate = sample_gate_config.config()
    store_dir = io.local_dir(storage.path("generation_store", "preference_pairs"))
    by_reward = settings.rank_by == "reward"
    day = (
        checkable_prompts(context, storage, scale, eval_sets, prompts, packaging_config)
        if by_reward
        else filtered_samples
    )
    with (
        no_retry_on_permanent_llm_errors(f"policy {policy.where()} / judge {judge_llm.where()}"),
        policy.get_client(log=context.log) as answering,
        contextlib.nullcontext() if by_reward else judge_llm.get_client(log=context.log) as judging,
        GenerationStore(store_dir) as store,
        progress_logger(context, "policy answers") as progress,
    ):
        scorer = answer_scorer(settings, judging, prompts, gate)
        pairs, stats = make_pairs(
            day,
            answering,
            scorer,
            gate,
            store,
            params,
            settings.completions_per_prompt,
            settings.min_score_gap,
            eval_sets.fraction,
            batch_size=policy.batch(),
            progress=progress,
        )
    context.log.info(
        f"{stats.pairs} pairs from {stats.prompts} prompts with production {production.checkpoint_id} "
        f"({stats.generated} answers generated, {stats.reused} reused); no pair: {stats.no_pair}"
    )
    check = pairs_check(pairs, settings.min_score_gap, eval_sets.fraction, stats)
    yield from pairs_outputs(pairs, pairs_metadata(pairs, stats, production, scorer.model_id), check)


def pairs_outputs(
    pairs: pd.DataFrame, metadata: dict, check: dg.AssetCheckResult
) -> Iterator[dg.Output[pd.DataFrame] | dg.AssetCheckResult]:
    """The day's pairs with the check's verdict in their metadata, then the check: the file is written before the
    blocking check fails the run, and preference_dataset, which reads every stored day (a DPO run launched by
    hand included), refuses a day whose latest pairs say they failed (``refused_days``)."""
    yield dg.Output(pairs, metadata={**metadata, PAIRS_PASSED: check.passed})
    yield check


def pairs_check(
    pairs: pd.DataFrame, min_score_gap: float, eval_fraction: float, stats: PairStats | None = None
) -> dg.AssetCheckResult:
    """``pairs_are_trainable`` on a day's pairs (blocking: a failure fails the run, and DPO does not train on it).

    Beside the rules ``make_pairs`` keeps (re-checked here: a bug there must not reach DPO), the one it cannot:
    every policy answer it asked for arrived. A request that failed after its retries leaves its prompt with fewer
    candidates, so that day's pairs are not the ones the production model's answers make; failed answers are not
    stored, so making the day again asks for them again, and passes once the endpoint answers."""
    problems = pair_problems(pairs, min_score_gap, eval_fraction)
    if stats is not None and stats.failed:
        asked = stats.generated + stats.reused + stats.failed
        problems.insert(
            0,
            f"{stats.failed} of {asked} policy answers failed (first error: {stats.first_error}): their prompts "
            "had fewer candidates; make the day's pairs again once the policy endpoint answers",
        )
    return dg.AssetCheckResult(
        check_name="pairs_are_trainable",
        passed=not problems,
        description="; ".join(problems[:3]) or None,
        metadata={
            "pairs": len(pairs),
            "failed_requests": stats.failed if stats is not None else None,
            "problems": dg.MetadataValue.json(problems[:20]),
        },
    )


def pairs_metadata(
    pairs: pd.DataFrame, stats: PairStats, production: ProductionEntry, ranked_by: str
) -> dict:
    """What a person reads on the day's pairs: counts, why prompts gave no pair, the score gaps, a preview."""
    return {
        "dagster/row_count": len(pairs),
        **production_metadata(production),  # the model that answered (also its input data version)
        "policy_checkpoint": production.checkpoint_id,
        "ranked_by": ranked_by,
        "policy_model": answering_id(pairs, production),
        "prompts": stats.prompts,
        "held_out_prompts_skipped": stats.held_out_prompts,
        "answers_generated": stats.generated,
        "answers_reused": stats.reused,
        "failed_requests": stats.failed,
        "no_pair_share": round(stats.no_pair_share, 4),
        "no_pair_reasons": dg.MetadataValue.json(stats.no_pair),
        "score_gap_histogram": dg.MetadataValue.json(gap_histogram(pairs)),
        "mean_score_gap": round(float(pairs["score_gap"].mean()), 3) if len(pairs) else None,
        "chosen_from_teacher": int((pairs["chosen_source"] == "teacher").sum()),
        "preview": preview(
            pairs.assign(
                chosen_text=pairs["chosen"].map(lambda m: m[0]["content"]),
                rejected_text=pairs["rejected"].map(lambda m: m[0]["content"]),
            ),
            ["pair_id", "chosen_text", "rejected_text", "score_gap"],
        ),
    }


def answer_scorer(
    settings: PreferenceSettings, judging: object, prompts: PromptsResource, gate: GateConfig
) -> AnswerScorer:
    """What ranks the policy's answers (``preference.rank_by``): a verifiable reward, or the judge's pointwise
    score as SampleGate judges the teacher."""
    if settings.rank_by == "reward":
        return RewardScorer(reward_function(settings.reward), settings.reward)
    judge = Judge(
        judging,
        prompts.text("judge"),
        prompts.text("judge_verdict"),
        gate.judge.max_tokens,
        gate.judge.method,
        gate.judge.retries,
    )
    return JudgeScorer(judge)


def checkable_prompts(
    context: dg.AssetExecutionContext,
    storage: StorageResource,
    scale: ScalePreset,
    eval_sets: EvalSetsResource,
    prompts: PromptsResource,
    packaging_config: PackagingResource,
) -> pd.DataFrame:
    """The day's checkable task items (train side, decontaminated: the rows rl_prompts trains GRPO on) as the rows
    make_pairs answers: the item id as sample id, the right answer as the reference answer."""
    documents = stored_partitions(storage.data_root, "raw_documents", [context.partition_key])
    index, _ = contamination_index(
        storage, eval_sets, scale, prompts, packaging_config.config().contamination
    )
    build = build_tasks(read_documents(documents), task_settings(scale), index)
    items = pd.DataFrame(build.train, columns=["item_id", "task", "prompt", "answer", "choices", "reference"])
    return items.assign(
        sample_id=items["item_id"],
        day=context.partition_key,
        system_prompt="",
        response=items["answer"],
        completion_tokens=items["answer"].str.split().str.len(),
    )


def answering_id(pairs: pd.DataFrame, production: ProductionEntry) -> str:
    return str(pairs["policy_model"].iloc[0]) if len(pairs) else production.checkpoint_id


def _valid_pairs(frame: pd.DataFrame, path: str) -> None:
    try:
        schemas.PreferencePairs.validate(frame)
    except Exception as e:  # pandera's errors name the column and rows; add the file
        raise ValueError(f"preference_pairs partition {path} does not match its schema: {e}") from e


def pairs_to_pack(
    context: dg.AssetExecutionContext, storage: StorageResource, out_root: str
) -> tuple[list[DayInput], list[str]]:
    """Every stored day of pairs but those whose latest pairs failed their blocking check (``refused_days``, named
    in the log and the failure), as the days to pack; and the refused days."""
    keys = list(context.asset_partition_keys_for_input("preference_pairs"))
    refused = refused_days(context.instance, keys)
    if refused:
        context.log.warning(
            f"preference_dataset: not packing the pairs of {', '.join(refused)}: their latest pairs failed the "
            "blocking check pairs_are_trainable (make those days' pairs again)"
        )
    partitions = stored_partitions(
        storage.data_root, "preference_pairs", [k for k in keys if k not in refused]
    )
    days = day_inputs_from_partitions(partitions, out_root, validate=_valid_pairs, to_jsonl=pairs_to_jsonl)
    if not days:
        raise dg.Failure(
            "preference_dataset: no pairs yet (materialize preference_pairs first)"
            + (f"; refused (failed pairs_are_trainable): {', '.join(refused)}" if refused else ""),
            allow_retries=False,
        )
    return days, refused


def dataset_metadata(dataset: PreferenceDataset, refused: list[str], repeated: int) -> dict[str, object]:
    """What a person reads on a ``preference_dataset`` materialization: sizes, the days packed, reused and refused,
    the pairs another day also held (``repeated``)."""
    return {
        "run_hash": dataset.run_hash,
        "train_pairs": dataset.train_pairs,
        "validation_pairs": dataset.validation_pairs,
        "days": dg.MetadataValue.json(dataset.days),
        "days_reused": dataset.shards_reused,
        "days_refused": dg.MetadataValue.json(refused),
        "cross_day_duplicates_dropped": repeated,
        "train_path": dg.MetadataValue.path(dataset.train_path),
    }


@dg.asset(
    op_tags=IMPORTS_MODELS,  # step_executor.py: torch and transformers in its own process
    group_name="preference",
    # streamed from the partitions' files a day at a time, like sft_dataset (bounded memory)
    ins={"preference_pairs": dg.AssetIn(dagster_type=dg.Nothing)},
    # the eval set and the held-out RL prompts frozen first (no pair holding their text is packed); the production
    # model's limits
    deps=["eval_set", "rl_eval_set", PRODUCTION_MODEL],
    kinds={"python", "parquet"},
    description="Every day's pairs so far, checked for contamination, tokenized with the student's chat template "
    "as TRL's DPOTrainer tokenizes them (loss on the answer tokens only), split by pair id, stored day by day under "
    "data/preference/ (a night tokenizes only its day); loads in TRL's DPOTrainer as it is.",
)
def preference_dataset(
    context: dg.AssetExecutionContext,
    storage: StorageResource,
    scale_preset: ScaleResource,
    eval_sets: EvalSetsResource,
    packaging_config: PackagingResource,
    prompts: PromptsResource,
) -> PreferenceDataset:
    scale, cfg = scale_preset.load(), packaging_config.config()
    settings = preference_settings(scale)
    tokenizer, tokenizer_path = load_student_tokenizer(storage)
    out_root = storage.path("preference")
    days, refused = pairs_to_pack(context, storage, out_root)
    index, _ = contamination_index(storage, eval_sets, scale, prompts, cfg.contamination)
    days, contamination = decontaminate(
        days,
        index,
        out_root,
        cfg.contamination.on_overlap,
        pair_texts(template_segments(prompts.text("teacher"))),
        "pair_id",
        context.log.info,
    )
    snapshot = build_preference_dataset(
        days,
        tokenizer,
        tokenizer_path,
        out_root,
        settings.validation_fraction,
        eval_sets.fraction,
        seed=scale.training.seed,
        log=context.log.info,
        limits=model_limits(production := require_production(storage)),  # the model DPO will train
        keep_snapshots=cfg.keep_snapshots,  # as sft_dataset: the store does not grow with every night
    )
    dataset = PreferenceDataset(
        run_hash=snapshot.run_hash,
        root=snapshot.root,
        train_path=snapshot.train_path,
        validation_path=snapshot.validation_path,
        train_pairs=snapshot.pairs["train"],
        validation_pairs=snapshot.pairs["validation"],
        days=sorted({d for day in days for d in day.days}),
        tokenizer_path=tokenizer_path,
        shards_reused=snapshot.shards_reused,
    )
    context.add_output_metadata(
        {
            **dataset_metadata(dataset, refused, snapshot.cross_day_duplicates_dropped),
            **production_metadata(production),
            **contamination_metadata(contamination, index),
        }
    )
    # the pair files it was packed from: the evaluation of a checkpoint trained on it says what they hold
    record_inputs(dataset.root, out_root, days, contamination, index)
    return dataset


@dg.asset_check(
    asset=preference_dataset,
    description="Both splits re-read from storage: the recorded pair counts, every pair_id once over both "
    "splits, no empty prompt or completion, chosen and rejected different tokens.",
)
def preference_splits_are_well_formed(preference_dataset: PreferenceDataset) -> dg.AssetCheckResult:
    expected = {"train": preference_dataset.train_pairs, "validation": preference_dataset.validation_pairs}
    problems = snapshot_problems(preference_dataset.train_path, preference_dataset.validation_path, expected)
    return dg.AssetCheckResult(
        passed=not problems, metadata={"problems": dg.MetadataValue.json(problems[:20])}
    )


class PreferenceRunConfig(dg.Config):
    """Run configuration of ``preference_checkpoint`` (the Launchpad's ``ops: preference_checkpoint: config``):
    what a person changes for one DPO training without editing the scale preset; unset, the preset's values hold."""

    max_steps: int | None = Field(
        default=None, gt=0, description="optimizer steps; empty: preference.max_steps"
    )
    learning_rate: float | None = Field(
        default=None, gt=0, description="peak learning rate; empty: preference.learning_rate (or SFT's / 10)"
    )
    beta: float | None = Field(default=None, gt=0, description="DPO's beta; empty: preference.beta")
    loss: str | None = Field(default=None, description="sigmoid or sigmoid_norm; empty: preference.loss")
    sft_weight: float | None = Field(
        default=None,
        ge=0,
        description="weight of the chosen answers' NLL (TRL's sft loss); empty: the preset's",
    )

    def settings(self, preset: PreferenceSettings) -> PreferenceSettings:
        """The preset's preference settings with this run's overrides, validated as the preset is (a loss that is
        not sigmoid or sigmoid_norm fails the run before anything launches, naming the field)."""
        overrides = {
            "max_steps": self.max_steps,
            "learning_rate": self.learning_rate,
            "beta": self.beta,
            "loss": self.loss,
            "sft_weight": self.sft_weight,
        }
        try:
            return PreferenceSettings.model_validate(
                {**preset.model_dump(), **{k: v for k, v in overrides.items() if v is not None}}
            )
        except ValueError as e:
            raise dg.Failure(f"preference_checkpoint run config: {e}", allow_retries=False) from e


@dg.asset(
    op_tags=IMPORTS_MODELS,  # step_executor.py: torch and transformers in its own process
    group_name="preference",
    pool="gpu",
    retry_policy=MODEL_CALL_RETRY,
    deps=[PRODUCTION_MODEL],  # it trains from the model in production (an SFT or an earlier DPO checkpoint)
    kinds={"deepspeed", "pytorch"},
    description="The production SFT checkpoint trained with DPO (sigmoid or length-normalised, beta) on "
    "preference_dataset by the project's own worker and DeepSpeed engine (the same Pipes launch, gpu pool, monitors "
    "and exact resume as SFT); reference log-probabilities computed once per pair set and reference, stored beside "
    "the pairs. A Hugging Face checkpoint in data/checkpoints/<id>/, evaluated like any checkpoint.",
)
def preference_checkpoint(
    context: dg.AssetExecutionContext,
    config: PreferenceRunConfig,
    preference_dataset: PreferenceDataset,
    gpu_cluster: GPUClusterResource,
    storage: StorageResource,
    tracking: TrackingResource,
    scale_preset: ScaleResource,
    promotion_policy: PromotionResource,
) -> dg.Output[Checkpoint]:
    scale = scale_preset.load()
    settings = config.settings(preference_settings(scale))
    production = require_production(storage)
    training = settings.settings(scale.training)
    checkpoint_id = checkpoint_id_for(context, storage, prefix="pref")
    reference = model_fingerprint(production.checkpoint_path).removeprefix("sha256:")[:16]
    job = TrainingJob(
        run_id=checkpoint_id,
        data_kind="preference",
        train_path=preference_dataset.train_path,
        validation_path=preference_dataset.validation_path,
        tokenizer_path=preference_dataset.tokenizer_path,
        settings=training,
        output_dir=str(storage.checkpoint_dir(checkpoint_id)),
        dataset_run_hash=preference_dataset.run_hash,
        **preset_on_cluster(scale, scale_preset, gpu_cluster),
        init_from=production.checkpoint_path,
        parent=f"production:{production.checkpoint_id}",
        objective=DPOObjective(
            beta=settings.beta,
            loss=settings.loss,
            sft_weight=settings.sft_weight,
            reference_path=production.checkpoint_path,
            reference_logps_path=io.join(preference_dataset.root, f"ref_logps-{reference}.parquet"),
        ),
    )
    stage = dpo_record(job, scale, settings, training, preference_dataset, production.checkpoint_id)
    stage = replace(
        stage, metadata=production_metadata(production)
    )  # where DPO started (its input data version)
    publish = registered(context, tracking, promotion_policy.policy().registered_model)
    return launch_and_record(context, job, stage, gpu_cluster, storage, tracking, publish)


def dpo_record(
    job: TrainingJob,
    scale: ScalePreset,
    settings: PreferenceSettings,
    training: TrainingSettings,
    data: PreferenceDataset,
    production_id: str,
) -> StageRecord:
    """What is DPO's own in the launch-and-record path: its parameters, record fields and held-out figures."""
    return StageRecord(
        stage="preference",
        title=f"{job.run_id} (DPO)",
        curve_label="DPO loss",
        launch_message=f"launching DPO of {job.run_id} from production {production_id} "
        f"({settings.loss}, beta {settings.beta}, sft weight {settings.sft_weight}, {training.max_steps} steps, "
        f"{data.train_pairs} pairs)",
        params={
            **origin(scale, job),
            "dataset_run_hash": data.run_hash,
            "beta": settings.beta,
            "loss": settings.loss,
            "sft_weight": settings.sft_weight,
            **training.model_dump(),
        },
        record={"dataset_validation_path": data.validation_path, **origin(scale, job), "stage": "preference"},
        figures=dpo_figures,
    )


def dpo_figures(result: TrainingResult) -> StageFigures:
    """DPO's held-out reward accuracy and margin with their n: MLflow's final metrics, the record's
    ``preference_metrics`` (read by the evaluation) and the materialization's metadata."""
    heldout = {
        "reward_accuracy": result.reward_accuracy,
        "reward_margin": result.reward_margin,
        "pairs": float(result.validation_pairs or 0),
    }
    return StageFigures(
        final_metrics={f"heldout_{k}": v for k, v in heldout.items()},
        record={"preference_metrics": {k: v for k, v in heldout.items() if v is not None}},
        metadata={
            "heldout_reward_accuracy": result.reward_accuracy,
            "heldout_reward_margin": result.reward_margin,
            "heldout_pairs": result.validation_pairs,
        },
    )


@dg.asset_check(
    asset=preference_checkpoint,
    description="The DPO checkpoint loads with plain transformers and gives finite logits, and its held-out "
    "reward accuracy and margin were measured on at least one validation pair and are finite.",
)
def preference_checkpoint_loads_and_was_scored(preference_checkpoint: Checkpoint) -> dg.AssetCheckResult:
    summary = training_summary(preference_checkpoint)
    scored = [summary.reward_accuracy, summary.reward_margin]
    return loads_with_transformers(
        preference_checkpoint.path,
        heldout_rewards_finite=all(v is not None and math.isfinite(v) for v in scored),
        heldout_pairs=(summary.validation_pairs or 0) > 0,
    )
