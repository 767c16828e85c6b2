"""The code location loads the way the UI and `dagster definitions validate` load it."""

from __future__ import annotations

import os
import subprocess
import sys

import dagster as dg

from nexa_dagster.core.config import REPO_ROOT

STAGE_KEYS = {"raw_documents", "teacher_samples", "filtered_samples", "rejected_samples", "sft_dataset",
              "moe_checkpoint", "eval_report", "model_deployment"}


def test_dagster_definitions_validate_passes(tmp_path) -> None:
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "dagster", "definitions", "validate", "-w", "workspace.yaml"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "All code locations passed validation" in proc.stderr + proc.stdout


def test_lineage_graph_has_every_stage_in_order() -> None:
    from nexa_dagster.definitions import defs

    graph = defs.resolve_asset_graph()
    keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
    assert keys >= STAGE_KEYS
    upstream = {k: {p.to_user_string() for p in graph.get(dg.AssetKey(k)).parent_keys} for k in STAGE_KEYS}
    assert upstream["teacher_samples"] == {"raw_documents"}
    assert upstream["filtered_samples"] == {"teacher_samples"}
    assert upstream["sft_dataset"] == {"filtered_samples"}
    assert upstream["moe_checkpoint"] == {"sft_dataset"}
    assert {"moe_checkpoint", "sft_dataset"} <= upstream["eval_report"]
    assert upstream["model_deployment"] == {"eval_report"}


def test_model_calling_stages_retry_and_training_uses_the_gpu_pool() -> None:
    from nexa_dagster.definitions import defs

    graph = defs.resolve_asset_graph()
    for key in ("teacher_samples", "filtered_samples", "moe_checkpoint", "eval_report", "model_deployment"):
        node = graph.get(dg.AssetKey(key))
        policy = node.assets_def.op.retry_policy
        assert policy is not None and policy.max_retries >= 1, key
    assert graph.get(dg.AssetKey("moe_checkpoint")).assets_def.op.pool == "gpu"
