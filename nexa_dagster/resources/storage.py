"""Storage: where the pipeline's files live (data root, landing zone, checkpoint store, reports)."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
from pydantic import Field

from nexa_dagster.core.common import storage as io
from nexa_dagster.core.common.artifacts import require_model_dir
from nexa_dagster.core.common.config import resolve_path


class StorageResource(dg.ConfigurableResource):
    """The data root (any fsspec URL for tables) and the local folders models and reports need.

    Checkpoints are model directories loaded by ``transformers`` and served by inference engines, so they live on
    a local or mounted disk; tables and manifests may live anywhere fsspec reaches.
    """

    data_root: str = "data"
    landing_root: str = "sample_data/landing"
    results_root: str = "results"
    student_tokenizer: str = Field(
        default="tiny-teacher",
        description=(
            "the student's tokenizer and chat template (pipeline.yaml's models.student_tokenizer): a model directory, "
            "or a bare tiny-* name under <data_root>/models/"
        ),
    )

    def _root(self, value: str) -> str:
        return value if "://" in value else str(resolve_path(value))

    @property
    def root(self) -> str:
        return self._root(self.data_root)

    def path(self, *parts: str) -> str:
        return io.join(self.root, *parts)

    def landing_dir(self, day: str) -> Path:
        return resolve_path(self.landing_root) / day

    def checkpoints_dir(self) -> Path:
        return io.local_dir(Path(self.root) / "checkpoints")

    def checkpoint_dir(self, checkpoint_id: str) -> Path:
        return self.checkpoints_dir() / checkpoint_id

    def model_path(self, name: str) -> str:
        """Where a configured model lives: bare ``tiny-*`` names are under ``<data_root>/models/``."""
        if name.startswith("tiny-") and "/" not in name:
            return str(Path(self.root) / "models" / name)
        return name

    def student_tokenizer_dir(self) -> str:
        """The student tokenizer's directory, or an error naming it when it is not a model directory."""
        return str(require_model_dir(self.model_path(self.student_tokenizer), "student tokenizer"))

    def report_dir(self, checkpoint_id: str) -> str:
        return io.join(self._root(self.results_root), "evaluation", "reports", checkpoint_id)

    def results_path(self, *parts: str) -> str:
        return io.join(self._root(self.results_root), *parts)

    def production_pointer(self) -> str:
        """The JSON file that says which checkpoint is in production (and which were before)."""
        return self.path("serving", "production.json")

    def serving_dir(self) -> Path:
        """Where the serving service keeps its engines, router and ``service.json`` (beside the pointer)."""
        return Path(self.path("serving"))

    def deployment_dir(self, checkpoint_id: str) -> Path:
        return io.local_dir(Path(self._root(self.results_root)) / "deployments" / checkpoint_id)
