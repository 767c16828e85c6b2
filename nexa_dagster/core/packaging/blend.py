"""Data blends: which sources go into a dataset, with what weight and through which transform.

A blend is a YAML file under ``configs/blends/``. Its fingerprint (a hash of the parsed content) is part of the run
hash and of the asset's metadata, so changing a weight, adding a source or switching a transform produces a new
dataset version that lineage shows, instead of silently rewriting the old one.

A source's ``weight`` is how many times each of its records goes in: ``2.0`` repeats every record twice, ``0.5``
keeps a deterministic half (chosen by a hash of the record's id and the seed, so the same half every run and the
same records stay in when more data arrives). This is the same notion as the weights of a Megatron blend
(proportions of the mix), made concrete at preparation time.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nexa_dagster.core.common import storage
from nexa_dagster.core.common.config import (
    load_validated,
    resolve_path,
)
from nexa_dagster.core.packaging.shards import default_workers
from nexa_dagster.core.packaging.transforms import build_transform

ASSET_PREFIX = "asset:"


class BlendSource(BaseModel):
    """One input: a JSONL file, glob or fsspec URL, or ``asset:<name>`` for an upstream asset's records."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    path: str = Field(min_length=1)
    weight: float = Field(default=1.0, gt=0)
    transform: Any = "openai_chat"
    id_field: str | None = Field(
        default="sample_id", description="record field with a stable id; without one the content hash is used"
    )

    @field_validator("transform")
    @classmethod
    def _known_transform(cls, v: Any) -> Any:
        build_transform(v)  # raises with the list of built-in transforms
        return v

    @property
    def is_asset(self) -> bool:
        return self.path.startswith(ASSET_PREFIX)

    def copies(self, record_id: str, seed: int) -> int:
        """How many times a record goes in: ``floor(weight)`` plus one more for a hashed share of ``frac(weight)``."""
        whole = math.floor(self.weight)
        frac = self.weight - whole
        if frac <= 0:
            return whole
        h = int(hashlib.sha256(f"{seed}:{self.name}:{record_id}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        return whole + (1 if h < frac else 0)


class DataBlend(BaseModel):
    """A named list of sources; the order of sources is the order of shards and of rows in the output."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    sources: list[BlendSource] = Field(min_length=1)

    @field_validator("sources")
    @classmethod
    def _unique_names(cls, v: list[BlendSource]) -> list[BlendSource]:
        names = [s.name for s in v]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"source names must be unique; repeated: {dupes}")
        return v

    @classmethod
    def load(cls, path: str | Path) -> DataBlend:
        """A blend from YAML: a path relative to ``configs/`` (``blends/sft.yaml``) or an absolute one."""
        return load_validated(cls, path)

    def fingerprint(self) -> str:
        """A hash of what the blend says (not of its formatting or comments)."""
        return hashlib.sha256(json.dumps(self.model_dump(), sort_keys=True).encode()).hexdigest()[:16]

    def plan_fields(self) -> dict[str, Any]:
        """The blend as a packaging plan's configuration records it (in the run hash): its name, its fingerprint
        and each source's settings."""
        return {
            "blend": self.name,
            "blend_fingerprint": self.fingerprint(),
            "sources": {s.name: s.model_dump() for s in self.sources},
        }

    def resolve(
        self, assets: dict[str, str | list[str]] | None = None
    ) -> list[tuple[BlendSource, list[str]]]:
        """Each source with its input files: globs expanded (sorted), ``asset:`` names looked up in ``assets``."""
        out = []
        for source in self.sources:
            if source.is_asset:
                key = source.path[len(ASSET_PREFIX) :]
                if not assets or key not in assets:
                    raise ValueError(
                        f"blend {self.name!r} source {source.name!r} wants asset {key!r}, which this "
                        f"stage does not provide (it provides {sorted(assets or {})})"
                    )
                given = assets[key]
                files = (
                    [given] if isinstance(given, str) else list(given)
                )  # a partitioned asset: one file a day
            else:
                pattern = source.path if "://" in source.path else str(resolve_path(source.path))
                files = storage.glob(pattern) if any(c in pattern for c in "*?[") else [pattern]
                if not files or not all(storage.exists(f) for f in files):
                    raise FileNotFoundError(
                        f"blend {self.name!r} source {source.name!r}: no input at {pattern}"
                    )
            out.append((source, files))
        return out


class ContaminationConfig(BaseModel):
    """``contamination`` of packaging.yaml: every training input checked against the frozen eval set and the
    benchmark items before it is packed (``core/packaging/decontaminate.py``)."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(default=13, ge=1, description="words per n-gram (13, as the common decontamination tools)")
    min_words: int = Field(
        default=8,
        ge=1,
        description="a protected item shorter than n but at least this long is "
        "matched whole; shorter ones are too generic to check",
    )
    on_overlap: Literal["remove", "report"] = Field(
        default="remove",
        description="remove: a training row holding protected text is left out (counted); "
        "report: it stays, counted and shown",
    )


class PackagingConfig(BaseModel):
    """``configs/packaging.yaml``: which blends feed which format and how the shards run."""

    model_config = ConfigDict(extra="forbid")

    sft_blend: str = "blends/sft.yaml"
    pretrain_blend: str = "blends/pretrain.yaml"
    rl_blend: str = "blends/rl.yaml"
    rows_per_shard: int = Field(default=5000, gt=0)
    workers: int = Field(default=0, ge=0)
    on_error: Literal["raise", "quarantine"] = "raise"
    # where the shards of the three formats run: this machine's processes, or the gpu_cluster resource's backend
    # (a Slurm job array, a Kubernetes indexed Job; the local backend keeps the processes); never changes the bytes
    runner: Literal["local", "cluster"] = "local"
    cluster_parallelism: int = Field(default=0, ge=0)  # runner: cluster: shards running at once (0: no limit)
    # after each sft_dataset snapshot: keep the newest N snapshots and the store shards they list, remove the rest
    keep_snapshots: int = Field(default=14, ge=0)  # 0: keep every snapshot and shard
    contamination: ContaminationConfig = Field(default_factory=ContaminationConfig)

    def worker_count(self) -> int:
        return self.workers or default_workers()


def load_packaging_config(name: str = "packaging.yaml") -> PackagingConfig:
    return load_validated(PackagingConfig, name)
