"""What protecting the frozen held-out RL prompts leaves out of ``make run``'s first night (docs/stages/rl.md): the
night as the demo runs it up to the base model's training, in the data root the environment names:

    NEXA_DATA_ROOT=$(mktemp -d)/data NEXA_LANDING_ROOT=$PWD/sample_data/landing DAGSTER_HOME=$(mktemp -d) \\
        .venv/bin/python scripts/rl_protection_figures.py

The first day's data (ingest, teacher, judge), ``pretrain_corpus`` and ``eval_set``, then ``rl_prompts`` and
``rl_eval_set`` (frozen from the held-out side of the first day's documents), then what ``base_model`` would leave
out of that corpus (its check, without the training) and what ``sft_dataset`` leaves out of the first night's
samples. The last line is one JSON object: the counts per protected source (``eval_set v1``, ``rl_eval_set v1``,
``benchmark:<task>``; a row holding two sources' items counts in both).
"""

from __future__ import annotations

import json
from typing import Any

import dagster as dg

from nexa_dagster.assets.packaging import contamination_index
from nexa_dagster.core.packaging.decontaminate import decontaminate, document_texts, recorded_inputs
from nexa_dagster.core.tiny.install import install_tiny_models
from nexa_dagster.definitions import build_defs
from nexa_dagster.resources.build import local_model_dirs

DAY = "2026-11-20"


def _metadata(result: dg.ExecuteInProcessResult, asset: str) -> dict[str, Any]:
    [event] = [e for e in result.get_asset_materialization_events() if e.asset_key.to_user_string() == asset]
    return {k: v.value for k, v in event.materialization.metadata.items()}


def main() -> None:
    defs = build_defs()
    install_tiny_models(local_model_dirs(defs.resources))
    instance = dg.DagsterInstance.get()

    def run(job: str, *assets: str, **kwargs: Any) -> dg.ExecuteInProcessResult:
        selection = [dg.AssetKey(a) for a in assets] or None
        return defs.resolve_job_def(job).execute_in_process(
            instance=instance, asset_selection=selection, **kwargs
        )

    run("daily_data_job", partition_key=DAY)
    corpus_run = run("pretraining_job", "pretrain_corpus", "eval_set")
    rl = run("rl_training_job", "rl_prompts", "rl_eval_set")
    sft = run("training_job", "sft_dataset")
    corpus = corpus_run.output_for_node("pretrain_corpus")
    resources = defs.resources
    storage, scale = resources["storage"], resources["scale_preset"].load()
    cfg = resources["packaging_config"].config().contamination
    index, _ = contamination_index(storage, resources["eval_sets"], scale, resources["prompts"], cfg)
    files = recorded_inputs(corpus.root, storage.path("pretrain"))
    _, report = decontaminate(
        files, index, storage.path("pretrain"), "report", document_texts, "doc_id", print
    )
    prompts, sft_meta = _metadata(rl, "rl_prompts"), _metadata(sft, "sft_dataset")
    print(
        json.dumps(
            {
                "rl_held_out_items": prompts["task_items_held_out"],
                "rl_train_items": prompts["task_items_train"],
                "rl_eval_set_prompts": _metadata(rl, "rl_eval_set")["prompts"],
                "corpus_documents": corpus.num_documents,
                "base_model_leaves_out": report.contaminated_rows,
                "base_model_leaves_out_by_source": report.rows_by_source,
                "sft_rows_checked": sft_meta["contamination_rows_checked"],
                "sft_rows_left_out": sft_meta["contaminated_rows_removed"],
                "sft_rows_left_out_by_source": sft_meta["contaminated_rows_by_source"],
            }
        )
    )


if __name__ == "__main__":
    main()
