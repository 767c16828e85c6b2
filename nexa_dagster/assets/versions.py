"""Every asset's ``code_version``, derived from what decides its output, never a hand-bumped string.

An asset's output is decided by its core functions and its configuration. The core modules already name the version
of what they write (``FORMAT``, ``INDEX_VERSION``, ``PLAN_FORMAT`` ...: raised whenever the bytes change), and the
configuration is files under ``configs/`` (or one section of ``pipeline.yaml``). ``SOURCES`` lists both for each
asset; its code version is a short hash of those constants' values and those files' bytes, computed when the code
location loads (``with_code_versions`` in ``build_defs``), so that a changed format constant or an edited file gives
a new code version at the next load, with nobody having to remember to bump one.

Dagster then shows the asset stale ("has a new code version") until it is materialized again; what it feeds goes
stale once that materialization gives a new data version (Dagster hashes the code version and the inputs' data
versions): a packing format change marks ``sft_dataset``, and the checkpoint trained on it, stale in the UI.

The scale preset is the one ``NEXA_SCALE`` selects (what schedules and sensors run with); a run launched with another
preset in its run config is not what the code version describes.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import yaml

from nexa_dagster import settings
from nexa_dagster.core.common.config import config_dir

SFT = "nexa_dagster.core.packaging.sft_dataset"
PACKING = (
    "nexa_dagster.core.packaging.formats.packed_split:FORMAT",
    "nexa_dagster.core.packaging.shards:PLAN_FORMAT",
)
CONTAMINATION = "nexa_dagster.core.data.contamination:FORMAT"


@dataclass(frozen=True)
class Sources:
    """What decides an asset's output: ``configs`` are paths under ``configs/`` (a folder: every file in it;
    ``file#section``: one top-level section of a YAML file; ``{scale}``: the preset NEXA_SCALE selects), ``formats``
    are ``module:CONSTANT`` names of the version constants of the core code that writes it."""

    configs: Sequence[str] = ()
    formats: Sequence[str] = ()


SCALE = "scales/{scale}.yaml"
TRAINING = (SCALE, "models", "deepspeed", "chat_template.jinja")

SOURCES: dict[str, Sources] = {
    "raw_documents": Sources(configs=("pipeline.yaml#ingest", SCALE)),
    "teacher_samples": Sources(configs=("pipeline.yaml#models", "prompts", "chat_template.jinja", SCALE)),
    "filtered_samples": Sources(configs=("filters.yaml", "prompts")),
    "rejected_samples": Sources(configs=("filters.yaml", "prompts")),
    "sft_dataset": Sources(
        configs=("packaging.yaml", "blends", "chat_template.jinja", SCALE),
        formats=(f"{SFT}:FORMAT", f"{SFT}:SNAPSHOT_FORMAT", *PACKING, CONTAMINATION),
    ),
    "pretrain_corpus": Sources(
        configs=("packaging.yaml", "blends", SCALE),
        formats=(
            "nexa_dagster.core.packaging.pretrain_corpus:FORMAT",
            "nexa_dagster.core.packaging.formats.indexed_dataset:INDEX_VERSION",
            "nexa_dagster.core.packaging.shards:PLAN_FORMAT",
        ),
    ),
    "rl_prompts": Sources(
        configs=("packaging.yaml", "blends", SCALE),
        formats=("nexa_dagster.core.packaging.jsonl_dataset:FORMAT", CONTAMINATION),
    ),
    "rl_eval_set": Sources(configs=(SCALE,), formats=("nexa_dagster.core.evaluation.rl_eval_set:FORMAT",)),
    "eval_set": Sources(
        configs=("pipeline.yaml#eval_set", "prompts/eval_prompts.yaml"),
        formats=("nexa_dagster.core.evaluation.eval_set:FORMAT", CONTAMINATION),
    ),
    "base_model": Sources(configs=TRAINING),
    "moe_checkpoint": Sources(configs=TRAINING),
    "preference_pairs": Sources(configs=("filters.yaml", "prompts", SCALE)),
    "preference_dataset": Sources(
        configs=("chat_template.jinja", SCALE),
        formats=(
            "nexa_dagster.core.packaging.preference_dataset:FORMAT",
            "nexa_dagster.core.training.preference_data:FORMAT",
        ),
    ),
    "preference_checkpoint": Sources(configs=TRAINING),
    "rl_checkpoint": Sources(configs=TRAINING),
    "eval_report": Sources(configs=("promotion.yaml", "benchmarks", "prompts", SCALE)),
    "base_model_eval": Sources(configs=("benchmarks", SCALE)),
    "leaderboard": Sources(configs=("promotion.yaml",)),
    "model_deployment": Sources(configs=("promotion.yaml",)),
}


def _config_files(entry: str, root: Path) -> list[tuple[str, bytes]]:
    """(name, bytes) of what one ``configs`` entry names; a missing file fails the load naming it."""
    name, _, section = entry.format(scale=settings.SCALE.get()).partition("#")
    path = root / name
    if section:
        loaded = yaml.safe_load(path.read_text()) or {}
        if section not in loaded:
            raise KeyError(f"{path}: no section {section!r} (named by nexa_dagster/assets/versions.py)")
        return [(entry, json.dumps(loaded[section], sort_keys=True, default=str).encode())]
    if path.is_dir():
        return [(str(p.relative_to(root)), p.read_bytes()) for p in sorted(path.rglob("*")) if p.is_file()]
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: named by nexa_dagster/assets/versions.py as deciding an asset's output"
        )
    return [(name, path.read_bytes())]


def _constant(ref: str) -> Any:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def code_version(asset: str, root: Path | None = None) -> str:
    """The code version of ``asset``: 16 hex characters of a SHA-256 over its ``SOURCES``."""
    sources = SOURCES[asset]
    root = root or config_dir()
    digest = hashlib.sha256()
    for ref in sources.formats:
        digest.update(f"{ref}={_constant(ref)!r}\n".encode())
    for entry in sources.configs:
        for name, data in _config_files(entry, root):
            digest.update(f"{name}:{len(data)}\n".encode())
            digest.update(data)
    return digest.hexdigest()[:16]


def with_code_versions(assets: Iterable[Any]) -> list[Any]:
    """The assets, each spec given its ``code_version``; an asset ``SOURCES`` does not list fails the load (every
    asset has one: a new asset must say what decides its output)."""

    def versioned(spec: dg.AssetSpec) -> dg.AssetSpec:
        name = spec.key.to_user_string()
        if name not in SOURCES:
            raise KeyError(f"asset {name} has no entry in nexa_dagster/assets/versions.py SOURCES")
        return spec.replace_attributes(code_version=code_version(name))

    return [a.map_asset_specs(versioned) if isinstance(a, dg.AssetsDefinition) else a for a in assets]
