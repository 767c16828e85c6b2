"""The configuration files as Dagster resources: what configures an asset is in its signature and in the Launchpad.

Each resource is built when the code location loads, from ``configs/pipeline.yaml`` (checked there, naming the file
and the key), and a run may change it in the Launchpad (``resources: eval_sets: config: version: 2``) or with
``--config``. The files with a deep schema of their own (``promotion.yaml``, ``packaging.yaml``, ``filters.yaml``)
are named by their resource (``file``) and read, checked, when an asset asks for them: a run can point at another
file (``configs/filters.production.yaml``) without a code change. Nothing reads YAML when a module is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypeVar

import dagster as dg
from pydantic import ConfigDict, Field, ValidationError

from nexa_dagster.core.common.config import ConfigError, explain, read_text
from nexa_dagster.core.distill.sample_gate import GateConfig, load_gate_config
from nexa_dagster.core.evaluation.promotion import PromotionPolicy, load_policy
from nexa_dagster.core.packaging.blend import PackagingConfig, load_packaging_config

R = TypeVar("R", bound=dg.ConfigurableResource)


def from_section(cls: type[R], fields: Mapping[str, Any], where: str) -> R:
    """``cls`` built from a section of a configuration file; a bad key is a ``ConfigError`` naming ``where`` (the
    file and the section) and the key, when the code location loads."""
    try:
        return cls(**fields)
    except ValidationError as e:
        raise ConfigError("\n".join(f"{where}.{problem}" for problem in explain(e, cls))) from None


class IngestResource(dg.ConfigurableResource):
    """``ingest`` of pipeline.yaml (its ``landing_root`` is the storage resource's): how a landed file's rows
    become documents."""

    model_config = ConfigDict(extra="forbid")

    text_field_candidates: list[str] = Field(
        default=["text", "content", "body"],
        min_length=1,
        description="the first of these fields a row has is its text",
    )
    title_field_candidates: list[str] = Field(default=["title", "name", "topic"])
    on_error: Literal["raise", "quarantine"] = Field(
        default="raise",
        description="a bad line fails the day naming file:line (raise), or is set aside with its "
        "reason in data/quarantine/raw_documents/<day>.jsonl (quarantine)",
    )


class EvalSetsResource(dg.ConfigurableResource):
    """``eval_set`` of pipeline.yaml: which frozen eval set the gate scores on, and which ids are held out for it."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(
        default=1,
        ge=1,
        description="frozen once; a new number freezes a new set from the data "
        "then known (the old one stays for its leaderboard rows)",
    )
    fraction: float = Field(
        default=0.2,
        gt=0,
        lt=1,
        description="share of sample ids on the held-out side, which no training split ever contains",
    )
    corpus_fraction: float = Field(
        default=0.2,
        gt=0,
        lt=1,
        description=(
            "share of pretraining-corpus documents (by a hash of their tokens) on the eval side: frozen with the "
            "version for the base models, never in any base model's training"
        ),
    )


class PromotionResource(dg.ConfigurableResource):
    """The promotion gate's policy: metric, margin, evidence, interval (``configs/<file>``)."""

    file: str = Field(default="promotion.yaml", description="the policy file under configs/")

    def policy(self) -> PromotionPolicy:
        return load_policy(self.file)


class PackagingResource(dg.ConfigurableResource):
    """Blends, shard size, workers, where shards run and how long the store keeps snapshots (``configs/<file>``)."""

    file: str = Field(default="packaging.yaml", description="the packaging file under configs/")

    def config(self) -> PackagingConfig:
        return load_packaging_config(self.file)


class SampleGateResource(dg.ConfigurableResource):
    """SampleGate's thresholds, dedup and judge settings (``configs/<file>``; ``filters.production.yaml`` holds
    thresholds for a real teacher)."""

    file: str = Field(default="filters.yaml", description="the SampleGate file under configs/")

    def config(self) -> GateConfig:
        return load_gate_config(self.file)


class PromptsResource(dg.ConfigurableResource):
    """The prompt templates under configs/ that teacher generation and the judge render."""

    teacher: str = Field(default="prompts/teacher.jinja", description="a document -> the teacher's prompt")
    teacher_system: str = Field(
        default="prompts/teacher_system.txt", description="the teacher's system prompt"
    )
    judge: str = Field(
        default="prompts/judge.jinja", description="prompt + answer -> the judge's score request"
    )
    judge_verdict: str = Field(
        default="prompts/judge_verdict.jinja",
        description="the JSON-verdict request (engines with response_format)",
    )

    def text(self, which: Literal["teacher", "teacher_system", "judge", "judge_verdict"]) -> str:
        text = read_text(getattr(self, which))
        return text.strip() if which == "teacher_system" else text
