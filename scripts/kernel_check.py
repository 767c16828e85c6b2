"""Day 1's data and the eval set it freezes, in the data root the environment names: run it once per CPU kernel
set and compare the printed hashes (docs/reproducibility.md).

    NEXA_DATA_ROOT=$(mktemp -d)/data NEXA_LANDING_ROOT=$PWD/sample_data/landing DAGSTER_HOME=$(mktemp -d) \\
        ATEN_CPU_CAPABILITY=default .venv/bin/python scripts/kernel_check.py

The last line is one JSON object: the kernel set, the teacher's answers (count and a hash of their text), the
samples SampleGate kept (count and a hash of their ids) and the frozen eval set's metadata.
"""

from __future__ import annotations

import hashlib
import json
import os

import dagster as dg
import pandas as pd

from nexa_dagster.core.tiny.install import install_tiny_models
from nexa_dagster.definitions import build_defs
from nexa_dagster.resources.build import local_model_dirs

DAY = "2026-11-20"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def main() -> None:
    defs = build_defs()
    install_tiny_models(local_model_dirs(defs.resources))
    instance = dg.DagsterInstance.get()
    defs.resolve_job_def("daily_data_job").execute_in_process(instance=instance, partition_key=DAY)
    frozen = defs.resolve_implicit_global_asset_job_def().execute_in_process(
        instance=instance, asset_selection=[dg.AssetKey("eval_set")]
    )
    metadata = frozen.get_asset_materialization_events()[0].materialization.metadata
    eval_set = {k: v.value for k, v in metadata.items() if isinstance(v.value, int | float | str)}
    root = os.environ["NEXA_DATA_ROOT"]
    teacher = pd.read_parquet(f"{root}/assets/teacher_samples/{DAY}.parquet").sort_values("sample_id")
    kept = pd.read_parquet(f"{root}/assets/filtered_samples/{DAY}.parquet")
    result = {
        "kernel": os.environ.get("ATEN_CPU_CAPABILITY", "native"),
        "teacher_answers": len(teacher),
        "answers_sha": _sha("".join(teacher["response"])),
        "kept": len(kept),
        "kept_ids_sha": _sha("".join(sorted(kept["sample_id"]))),
        "eval_set": {k: v for k, v in eval_set.items() if len(str(v)) < 80},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
