"""Packaging stage: judged samples and ingested documents become training data in three formats.

* ``sft_dataset``: packed SFT Parquet (chat template, assistant-only loss mask, per-document positions and
  boundaries) plus the same conversations as JSONL;
* ``pretrain_corpus``: Megatron-Core ``.bin``/``.idx`` shards of the ingested documents;
* ``rl_prompts``: prompts with reference answers as JSONL.

What goes in is the data blend named in ``configs/packaging.yaml``; its fingerprint is in each asset's metadata,
so a blend change shows in lineage. The work is sharded, parallel across processes and resumable from receipts;
the logic lives in the Dagster-free ``nexa_dagster.core`` modules.
"""

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import dagster as dg
import pandas as pd
from pydantic import Field

from nexa_dagster.assets.common import IMPORTS_MODELS, preview
from nexa_dagster.core.cluster.shard_task import ShardTasksFailed
from nexa_dagster.core.common import storage as io
from nexa_dagster.core.common.artifacts import SFTDataset
from nexa_dagster.core.common.config import RLTaskSettings, ScalePreset
from nexa_dagster.core.data.contamination import ContaminationIndex, ProtectedItem, load_or_build
from nexa_dagster.core.data.schemas import FilteredSamples, RawDocuments
from nexa_dagster.core.evaluation.eval_set import load_eval_set
from nexa_dagster.core.evaluation.protected import benchmark_items, eval_set_items, rl_eval_set_items
from nexa_dagster.core.evaluation.rl_eval_set import load_rl_eval_set
from nexa_dagster.core.packaging.blend import ContaminationConfig, DataBlend, PackagingConfig
from nexa_dagster.core.packaging.decontaminate import (
    DecontaminationReport,
    chat_texts,
    decontaminate,
    document_texts,
    record_inputs,
    template_segments,
)
from nexa_dagster.core.packaging.jsonl_dataset import JsonlDataset, package_jsonl, partitions_to_flat_jsonl
from nexa_dagster.core.packaging.packing import check_packed_file
from nexa_dagster.core.packaging.pretrain_corpus import (
    PretrainCorpus,
    PretrainSettings,
    documents_to_jsonl,
    package_pretrain,
)
from nexa_dagster.core.packaging.sft_dataset import (
    DayInput,
    build_sft_dataset_from_days,
    day_inputs_from_partitions,
    drop_cross_day_duplicates,
)
from nexa_dagster.core.packaging.shards import Receipt, ShardRunner, ShardTask
from nexa_dagster.core.rl.tasks import RLPrompts, TaskBuild, build_tasks, write_task_rows
from nexa_dagster.resources.configs import EvalSetsResource, PackagingResource, PromptsResource
from nexa_dagster.resources.gpu_cluster import GPUClusterResource
from nexa_dagster.resources.io_manager import stored_partitions
from nexa_dagster.resources.scale import ScaleResource
from nexa_dagster.resources.storage import StorageResource


def load_student_tokenizer(storage: StorageResource) -> tuple[object, str]:
    """The student's tokenizer (its chat template tokenizes every training input) and its directory."""
    from transformers import AutoTokenizer  # 3.5 s to import: not on every load of the code location

    path = storage.student_tokenizer_dir()
    return AutoTokenizer.from_pretrained(path), path


def contamination_index(
    storage: StorageResource,
    eval_sets: EvalSetsResource,
    scale: ScalePreset,
    prompts: PromptsResource,
    cfg: ContaminationConfig,
) -> tuple[ContaminationIndex, list[str]]:
    """What training must not contain now: the current eval-set version's examples and the scale's RL eval-set
    version's held-out prompts (each once frozen) and the items of the scale's benchmark tasks, as an n-gram index
    built once per such set; with the tasks that have no local data to protect."""
    items = []
    try:
        manifest = load_eval_set(storage.path("eval_sets"), eval_sets.version)
        items += eval_set_items(manifest, template_segments(prompts.text("teacher")))
    except FileNotFoundError:
        pass  # not frozen yet (the first pretraining of a data root): the benchmarks only
    items += frozen_rl_items(storage, scale)
    benchmark, unchecked = benchmark_items(scale.evaluation.benchmarks)
    index = load_or_build(storage.path("decontamination", "indexes"), items + benchmark, cfg.n, cfg.min_words)
    return index, unchecked


def frozen_rl_items(storage: StorageResource, scale: ScalePreset) -> list[ProtectedItem]:
    """The held-out RL prompts of the scale's ``rl.eval_set_version``, once ``rl_eval_set`` froze it (none before,
    nor for a scale with no RL stage): the RL gate's evidence is only evidence if no training in the candidate's
    lineage held their passages."""
    if scale.rl is None:
        return []
    try:
        return rl_eval_set_items(load_rl_eval_set(storage.path("rl_eval_sets"), scale.rl.eval_set_version))
    except FileNotFoundError:
        return []  # not frozen yet: rl_eval_set runs before the trainings (pretraining_job, training_job)


def contamination_metadata(report: DecontaminationReport, index: ContaminationIndex) -> dict[str, object]:
    meta = report.metadata(index)
    meta["contamination_examples"] = dg.MetadataValue.json(meta["contamination_examples"])
    meta["contaminated_rows_by_source"] = dg.MetadataValue.json(meta["contaminated_rows_by_source"])
    meta["protected_items"] = len(index.items)
    return meta


def input_partitions(
    context: dg.AssetExecutionContext, storage: StorageResource, asset: str
) -> list[tuple[str, str]]:
    """(partition key, stored file) of every partition of ``asset`` this step reads: the assets that stream their
    input a day at a time (bounded memory) rather than have the IO manager load it whole."""
    return stored_partitions(storage.data_root, asset, list(context.asset_partition_keys_for_input(asset)))


def _valid_filtered_samples(frame: pd.DataFrame, path: str) -> None:
    try:
        FilteredSamples.validate(frame)
    except Exception as e:  # pandera's errors name the column and rows; add the file
        raise ValueError(f"filtered_samples partition {path} does not match its schema: {e}") from e


def shard_runner(
    context: dg.AssetExecutionContext,
    cfg: PackagingConfig,
    gpu_cluster: GPUClusterResource,
    storage: StorageResource,
    folder: str = "sft",
) -> ShardRunner | None:
    """Where the shards to pack run: ``runner: local`` (packaging.yaml) or the local backend keep this machine's
    processes; ``runner: cluster`` on Slurm or Kubernetes sends them there (task files under
    ``data/<folder>/cluster/``). Shards that did not finish there fail the step naming each one and its log."""
    runner = (
        gpu_cluster.shard_runner(context, storage.path(folder, "cluster"), cfg.cluster_parallelism)
        if cfg.runner == "cluster"
        else None
    )
    if runner is None:
        if cfg.runner == "cluster":
            context.log.info(
                f"packaging.yaml says runner: cluster; the {gpu_cluster.backend} backend runs the "
                "shards in this machine's processes"
            )
        return None
    cluster_runner: ShardRunner = runner

    def run(
        tasks: Sequence[ShardTask], work: Callable[[ShardTask], Receipt], log: Callable[[str], None]
    ) -> Sequence[Receipt]:
        try:
            return cluster_runner(tasks, work, log)
        except ShardTasksFailed as e:
            raise dg.Failure(
                description=str(e), metadata={"failed_shards": dg.MetadataValue.json(e.shard_ids)}
            ) from e

    return run


CHECKABLE_TASKS = (
    "checkable_tasks"  # the SFT blend's name for the train side of the RL stage's checkable tasks
)


def blend_tasks(
    context: dg.AssetExecutionContext,
    storage: StorageResource,
    scale: ScalePreset,
    index: ContaminationIndex | None,
    blend: DataBlend,
) -> dict[str, list[str]]:
    """The inputs beyond the judged samples that the SFT blend names: ``asset:checkable_tasks``, the train side of
    the checkable tasks (never a held-out item: those are the RL gate's), built from the documents so far."""
    if not any(s.path == f"asset:{CHECKABLE_TASKS}" for s in blend.sources):
        return {}
    build, tasks_hash, train_path, _, _ = checkable_tasks(context, storage, scale, index)
    context.log.info(
        f"sft_dataset: {len(build.train)} train-side checkable task items (tasks {tasks_hash}) for the blend's "
        f"{CHECKABLE_TASKS} source; the {len(build.held_out)} held-out ones stay out"
    )
    return {CHECKABLE_TASKS: [train_path]}


class SFTDatasetConfig(dg.Config):
    """Run configuration of ``sft_dataset`` (the Launchpad's ``ops: sft_dataset: config``)."""

    blend: str = Field(
        default="",
        description="the data blend to pack, relative to configs/ (e.g. blends/sft_negative_control.yaml: a "
        "negative control the gate must hold back); empty: packaging.yaml's sft_blend",
    )


@dg.asset(
    op_tags=IMPORTS_MODELS,  # step_executor.py: torch and transformers in its own process
    group_name="packaging",
    # not loaded by the IO manager: the asset streams the partitions' files one day at a time (bounded memory)
    ins={
        "filtered_samples": dg.AssetIn(dagster_type=dg.Nothing),
        # the checkable tasks' documents, read when the blend names asset:checkable_tasks (blends/sft.yaml)
        "raw_documents": dg.AssetIn(dagster_type=dg.Nothing),
    },
    # frozen first: no sample that holds an eval example's or a held-out RL prompt's text is packed
    deps=["eval_set", "rl_eval_set"],
    kinds={"python", "parquet"},
    description="Every filtered sample up to now (plus the other sources of the SFT blend), rendered with the "
    "student's chat template, tokenized, packed best-fit-decreasing into fixed-length sequences with "
    "an assistant-only loss mask, split into train/validation and written as Parquet and JSONL under "
    "data/sft/<run_hash>/; shards are content-addressed in data/sft/store/ and reused, so a night packs "
    "only its own day.",
)
def sft_dataset(
    context: dg.AssetExecutionContext,
    config: SFTDatasetConfig,
    storage: StorageResource,
    scale_preset: ScaleResource,
    gpu_cluster: GPUClusterResource,
    packaging_config: PackagingResource,
    eval_sets: EvalSetsResource,
    prompts: PromptsResource,
) -> SFTDataset:
    scale, cfg = scale_preset.load(), packaging_config.config()
    tokenizer, tokenizer_path = load_student_tokenizer(storage)
    try:
        blend = DataBlend.load(config.blend or cfg.sft_blend)
    except (FileNotFoundError, ValueError) as e:  # a run config naming no valid blend: retrying cannot help
        raise dg.Failure(f"sft_dataset blend: {e}", allow_retries=False) from e
    partitions = input_partitions(context, storage, "filtered_samples")
    days = day_inputs_from_partitions(partitions, storage.path("sft"), validate=_valid_filtered_samples)
    # before packing: no sample that holds eval-set or benchmark text (a night checks only its new day)
    index, _ = contamination_index(storage, eval_sets, scale, prompts, cfg.contamination)
    days, contamination = decontaminate(
        days,
        index,
        storage.path("sft"),
        cfg.contamination.on_overlap,
        chat_texts(template_segments(prompts.text("teacher"))),
        "sample_id",
        context.log.info,
    )
    extra = blend_tasks(context, storage, scale, index, blend)
    dataset, stats = build_sft_dataset_from_days(
        days,
        tokenizer,
        tokenizer_path,
        storage.path("sft"),
        scale.pack_size,
        scale.validation_fraction,
        seed=scale.training.seed,
        log=context.log.info,
        blend=blend,
        on_error=cfg.on_error,
        rows_per_shard=cfg.rows_per_shard,
        workers=cfg.worker_count(),
        eval_fraction=eval_sets.fraction,
        runner=shard_runner(context, cfg, gpu_cluster, storage),
        keep_snapshots=cfg.keep_snapshots,
        assets=extra,
    )
    context.add_output_metadata(sft_metadata(dataset, blend, stats, scale.name, contamination, index))
    record_inputs(dataset.root, storage.path("sft"), days, contamination, index)
    return dataset


def sft_metadata(
    dataset: SFTDataset,
    blend: DataBlend,
    stats: dict[str, Any],
    scale: str,
    contamination: DecontaminationReport,
    index: ContaminationIndex,
) -> dict[str, Any]:
    """What a person reads on an ``sft_dataset`` materialization: the blend, sizes, packing and contamination."""
    return {
        "run_hash": dataset.run_hash,
        "blend": dataset.blend,
        "blend_fingerprint": dataset.blend_fingerprint,
        "blend_sources": dg.MetadataValue.json([s.model_dump() for s in blend.sources]),
        "num_shards": dataset.num_shards,
        "shards_reused": dataset.shards_reused,  # from data/sft/store: only the new days' shards were packed
        "num_samples": dataset.num_samples,
        "days": dg.MetadataValue.json(dataset.days),
        "train_sequences": dataset.num_train_sequences,
        "validation_sequences": dataset.num_validation_sequences,
        "pack_size": dataset.pack_size,
        "scale": scale,
        "real_tokens": dataset.num_real_tokens,
        "loss_tokens": dataset.num_loss_tokens,
        "packing_efficiency": round(dataset.packing_efficiency, 4),
        "truncated_conversations": sum(s.truncated_documents for s in stats.values()),
        "dropped_conversations": sum(s.dropped_documents for s in stats.values()),
        "quarantined_rows": dataset.quarantined_rows,
        "held_out_for_eval_set": dataset.held_out_samples,
        # a sample on two days (two days processed at once, a document landed again): the earliest day keeps it
        "cross_day_duplicates_dropped": dataset.cross_day_duplicates_dropped,
        "train_path": dg.MetadataValue.path(dataset.train_path),
        "validation_path": dg.MetadataValue.path(dataset.validation_path),
        **contamination_metadata(contamination, index),
    }


@dg.asset_check(
    asset=sft_dataset,
    description="Both splits re-read from storage are well-formed packed sequences "
    "with assistant tokens to learn.",
)
def packed_splits_are_well_formed(sft_dataset: SFTDataset) -> dg.AssetCheckResult:
    problems = [
        p
        for split, path in (("train", sft_dataset.train_path), ("validation", sft_dataset.validation_path))
        for p in check_packed_file(path, sft_dataset.pack_size, split)
    ]
    return dg.AssetCheckResult(passed=not problems, metadata={"problems": dg.MetadataValue.json(problems)})


def _valid_raw_documents(frame: pd.DataFrame, path: str) -> None:
    try:
        RawDocuments.validate(frame)
    except Exception as e:  # pandera's errors name the column and rows; add the file
        raise ValueError(f"raw_documents partition {path} does not match its schema: {e}") from e


@dg.asset(
    op_tags=IMPORTS_MODELS,  # step_executor.py: torch and transformers in its own process
    group_name="packaging",
    # not loaded by the IO manager: the asset streams the partitions' files one day at a time (bounded memory)
    ins={"raw_documents": dg.AssetIn(dagster_type=dg.Nothing)},
    kinds={"python"},
    description="Every ingested document up to now (plus the other sources of the pretraining blend), tokenized "
    "with the student's tokenizer into Megatron-Core bin/idx shards (content-addressed in "
    "data/pretrain/store/ and reused, so a night tokenizes only its own day) listed by "
    "data/pretrain/<run_hash>/megatron_blend.json for --data-path.",
)
def pretrain_corpus(
    context: dg.AssetExecutionContext,
    storage: StorageResource,
    gpu_cluster: GPUClusterResource,
    packaging_config: PackagingResource,
    eval_sets: EvalSetsResource,
    scale_preset: ScaleResource,
    prompts: PromptsResource,
) -> PretrainCorpus:
    cfg = packaging_config.config()
    tokenizer, _ = load_student_tokenizer(storage)
    blend = DataBlend.load(cfg.pretrain_blend)
    out_root = storage.path("pretrain")
    days, repeated = document_days(context, storage, out_root)
    # before packing: no document that holds eval-set or benchmark text known now (base_model checks again, against
    # the eval set frozen since, and keeps those out of its training)
    index, _ = contamination_index(storage, eval_sets, scale_preset.load(), prompts, cfg.contamination)
    days, contamination = decontaminate(
        days, index, out_root, cfg.contamination.on_overlap, document_texts, "doc_id", context.log.info
    )
    run = package_pretrain(
        blend,
        tokenizer,
        out_root,
        PretrainSettings(
            on_error=cfg.on_error,
            rows_per_shard=cfg.rows_per_shard,
            workers=cfg.worker_count(),
            runner=shard_runner(context, cfg, gpu_cluster, storage, "pretrain"),
        ),
        assets={"raw_documents": [d.path for d in days]},
        log=context.log.info,
    )
    corpus = PretrainCorpus(
        run_hash=run.run_hash,
        root=run.root,
        megatron_blend_path=run.blend_path,
        prefixes=run.prefixes,
        num_documents=run.num_documents,
        num_tokens=run.num_tokens,
        blend=blend.name,
        blend_fingerprint=blend.fingerprint(),
        quarantined_rows=run.quarantined_rows,
        cross_day_duplicates_dropped=repeated,
    )
    context.add_output_metadata(corpus_metadata(corpus, contamination, index))
    record_inputs(run.root, out_root, days, contamination, index)
    return corpus


def document_days(
    context: dg.AssetExecutionContext, storage: StorageResource, out_root: str
) -> tuple[list[DayInput], int]:
    """Every ingested day's documents as the days to pack, each schema-checked alone, and how many documents stood
    on two days: a doc_id on two days is found by the on-disk index of every day's ids and kept on the earliest
    day only."""
    partitions = input_partitions(context, storage, "raw_documents")
    days = day_inputs_from_partitions(
        partitions, out_root, validate=_valid_raw_documents, to_jsonl=documents_to_jsonl
    )
    if not days:
        raise ValueError("pretrain_corpus: no ingested documents (no raw_documents partition materialized)")
    return drop_cross_day_duplicates(days, out_root, context.log.info, "doc_id", "raw_documents")


def corpus_metadata(
    corpus: PretrainCorpus, contamination: DecontaminationReport, index: ContaminationIndex
) -> dict[str, object]:
    """What a person reads on a ``pretrain_corpus`` materialization: the blend, sizes and contamination."""
    return {
        "run_hash": corpus.run_hash,
        "blend": corpus.blend,
        "blend_fingerprint": corpus.blend_fingerprint,
        "documents": corpus.num_documents,
        "cross_day_duplicates_dropped": corpus.cross_day_duplicates_dropped,
        "tokens": corpus.num_tokens,
        "shards": len(corpus.prefixes),
        "megatron_blend": dg.MetadataValue.path(corpus.megatron_blend_path),
        **contamination_metadata(contamination, index),
    }


@dg.asset(
    group_name="packaging",
    # streamed from the partitions' files a day at a time, like sft_dataset (bounded memory)
    ins={
        "filtered_samples": dg.AssetIn(dagster_type=dg.Nothing),
        "raw_documents": dg.AssetIn(dagster_type=dg.Nothing),  # the checkable tasks' source
    },
    deps=["eval_set"],  # frozen first: no train item that holds an eval example's text is written
    kinds={"python"},
    description="Prompts for RL as JSONL: the teacher's accepted answer as reference, through the transforms of the "
    "RL blend (path), and checkable tasks built from the ingested documents (core/rl/tasks.py: which reference "
    "topic a passage is from, its next words), split by a hash of the document id into the train side (tasks_path, "
    "what GRPO trains on; decontaminated against the eval set, the frozen RL eval set and the benchmark items) and "
    "the held-out side (held_out_path, never trained on: what the frozen rl_eval_set is drawn from), under data/rl/.",
)
def rl_prompts(
    context: dg.AssetExecutionContext,
    storage: StorageResource,
    gpu_cluster: GPUClusterResource,
    packaging_config: PackagingResource,
    eval_sets: EvalSetsResource,
    scale_preset: ScaleResource,
    prompts: PromptsResource,
) -> RLPrompts:
    cfg, scale = packaging_config.config(), scale_preset.load()
    reference = reference_rows(context, storage, gpu_cluster, cfg, eval_sets)
    index, _ = contamination_index(storage, eval_sets, scale, prompts, cfg.contamination)
    build, tasks_hash, train_path, held_out_path, days = checkable_tasks(context, storage, scale, index)
    if (
        not build.train or not build.held_out
    ):  # rl_checkpoint and rl_eval_set fail on an empty side, naming it
        context.log.warning(
            f"rl_prompts: {len(build.train)} train and {len(build.held_out)} held-out task items from "
            f"{days} raw_documents partitions (skipped: {build.skipped}): the RL stage needs both"
        )
    context.log.info(
        f"{len(build.train)} train and {len(build.held_out)} held-out task items "
        f"({len(build.contaminated)} left out as contaminated, index {index.key})"
    )
    context.add_output_metadata(
        {
            "run_hash": reference.run_hash,
            "blend": reference.blend,
            "blend_fingerprint": reference.blend_fingerprint,
            "records": reference.records,
            "quarantined_rows": reference.quarantined_rows,
            "path": dg.MetadataValue.path(reference.path),
            "tasks_run_hash": tasks_hash,
            "task_items_train": len(build.train),
            "task_items_held_out": len(build.held_out),
            "task_counts": dg.MetadataValue.json(task_counts(build)),
            "tasks_contaminated": len(build.contaminated),
            "contaminated_examples": dg.MetadataValue.json(build.contaminated[:10]),
            "documents_skipped": dg.MetadataValue.json(build.skipped),
            "protected_items": len(index.items),
            "tasks_path": dg.MetadataValue.path(train_path),
            "task_preview": preview(pd.DataFrame(build.train[:5]), ["item_id", "task", "prompt", "answer"]),
        }
    )
    return RLPrompts(
        **reference.model_dump(exclude={"created_at"}),
        tasks_run_hash=tasks_hash,
        tasks_path=train_path,
        held_out_path=held_out_path,
        task_records=len(build.train),
        held_out_records=len(build.held_out),
        tasks_contaminated=len(build.contaminated),
    )


def checkable_tasks(
    context: dg.AssetExecutionContext,
    storage: StorageResource,
    scale: ScalePreset,
    index: ContaminationIndex | None,
) -> tuple[TaskBuild, str, str, str, int]:
    """The checkable tasks of every ingested document so far, decontaminated against ``index`` and written
    content-addressed under ``data/rl/tasks/<hash>/``: (build, hash, train path, held-out path, days read). One
    build for both readers: ``rl_prompts`` (GRPO's prompts, the frozen held-out side) and ``sft_dataset`` (the
    train side as supervised rows, when its blend names ``asset:checkable_tasks``), so both see the same items."""
    documents = input_partitions(context, storage, "raw_documents")
    build = build_tasks(read_documents(documents), task_settings(scale), index)
    tasks_hash, train_path, held_out_path = write_task_rows(build, storage.path("rl", "tasks"))
    return build, tasks_hash, train_path, held_out_path, len(documents)


def task_settings(scale: ScalePreset) -> RLTaskSettings:
    """The scale preset's ``rl.tasks`` (the defaults while the preset has no RL stage)."""
    return scale.rl.tasks if scale.rl is not None else RLTaskSettings()


def task_counts(build: TaskBuild) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {}
    for side, rows in (("train", build.train), ("held_out", build.held_out)):
        for row in rows:
            counts.setdefault(row["task"], {}).setdefault(side, 0)
            counts[row["task"]][side] += 1
    return counts


def read_documents(partitions: list[tuple[str, str]]) -> Iterator[dict[str, object]]:
    """Every ingested document of the partitions, a day at a time (bounded memory), checked against its schema."""
    for _, path in partitions:
        frame = io.read_parquet(path)
        _valid_raw_documents(frame, path)
        yield from frame[["doc_id", "title", "text"]].to_dict("records")


def reference_rows(
    context: dg.AssetExecutionContext,
    storage: StorageResource,
    gpu_cluster: GPUClusterResource,
    cfg: PackagingConfig,
    eval_sets: EvalSetsResource,
) -> JsonlDataset:
    """The reference-answer rows: every filtered sample off the eval set's side, through the RL blend."""
    blend = DataBlend.load(cfg.rl_blend)
    out_root = storage.path("rl")
    partitions = input_partitions(context, storage, "filtered_samples")
    # the eval set's side is never trained on
    files = partitions_to_flat_jsonl(
        partitions, out_root, eval_sets.fraction, validate=_valid_filtered_samples
    )
    if not files:
        raise ValueError(
            "rl_prompts: no filtered samples to package (no day materialized, or every sample is on "
            "the eval set's side)"
        )
    run = package_jsonl(
        blend,
        out_root,
        "rl_prompts",
        assets={"filtered_samples_flat": files},
        on_error=cfg.on_error,
        rows_per_shard=cfg.rows_per_shard,
        workers=cfg.worker_count(),
        log=context.log.info,
        runner=shard_runner(context, cfg, gpu_cluster, storage, "rl"),
    )
    return JsonlDataset(
        run_hash=run.run_hash,
        path=run.path,
        records=run.records,
        blend=blend.name,
        blend_fingerprint=blend.fingerprint(),
        quarantined_rows=run.quarantined_rows,
        quarantine_path=run.quarantine_path,
    )
