"""Experiment tracking: MLflow, with a local SQLite store under the data root by default."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dagster as dg

from nexa_dagster.core.config import resolve_path


class MLflowRun:
    """A thin handle on one MLflow run (the client API, so nothing depends on MLflow's global state)."""

    def __init__(self, client: Any, run_id: str) -> None:
        self.client = client
        self.run_id = run_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        for k, v in params.items():
            self.client.log_param(self.run_id, k, str(v)[:6000])

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        for k, v in metrics.items():
            if v is not None:
                self.client.log_metric(self.run_id, k, float(v), step=step or 0)

    def log_artifact(self, path: str | Path) -> None:
        self.client.log_artifact(self.run_id, str(path))


class TrackingResource(dg.ConfigurableResource):
    """MLflow tracking. ``tracking_uri`` empty means ``sqlite:///<data_root>/mlflow.db``."""

    tracking_uri: str = ""
    data_root: str = "data"
    experiment: str = "nexa"

    def uri(self) -> str:
        if self.tracking_uri:
            return self.tracking_uri
        root = resolve_path(self.data_root)
        root.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{root / 'mlflow.db'}"

    @contextmanager
    def start_run(self, run_name: str, tags: Mapping[str, str] | None = None) -> Iterator[MLflowRun]:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.uri())
        exp = client.get_experiment_by_name(self.experiment)
        if exp is None:
            artifacts = resolve_path(self.data_root) / "mlartifacts"
            exp_id = client.create_experiment(self.experiment, artifact_location=artifacts.as_uri())
        else:
            exp_id = exp.experiment_id
        run = client.create_run(exp_id, run_name=run_name, tags=dict(tags or {}))
        status = "FAILED"
        try:
            yield MLflowRun(client, run.info.run_id)
            status = "FINISHED"
        finally:
            client.set_terminated(run.info.run_id, status=status)

    # -- model registry ---------------------------------------------------------------------------------------
    def _client(self) -> Any:
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.uri())

    def register_checkpoint(self, model_name: str, checkpoint_id: str, path: str, run_id: str | None) -> str:
        """Register a checkpoint directory as a new version of ``model_name``; returns the version."""
        from mlflow.exceptions import MlflowException

        client = self._client()
        with contextlib.suppress(MlflowException):  # already registered
            client.create_registered_model(model_name)
        version = client.create_model_version(model_name, source=path, run_id=run_id,
                                              tags={"checkpoint_id": checkpoint_id})
        return str(version.version)

    def version_of(self, model_name: str, checkpoint_id: str) -> str | None:
        for v in self._client().search_model_versions(f"name='{model_name}'"):
            if v.tags.get("checkpoint_id") == checkpoint_id:
                return str(v.version)
        return None

    def registered_checkpoints(self, model_name: str) -> dict[str, str]:
        """{checkpoint_id: source path} of every registered version of ``model_name`` (empty if none)."""
        from mlflow.exceptions import MlflowException

        try:
            versions = self._client().search_model_versions(f"name='{model_name}'")
        except MlflowException:
            return {}
        return {v.tags["checkpoint_id"]: v.source for v in versions if v.tags.get("checkpoint_id")}

    def set_alias(self, model_name: str, alias: str, version: str) -> None:
        self._client().set_registered_model_alias(model_name, alias, version)

    def alias_version(self, model_name: str, alias: str) -> tuple[str, str] | None:
        """(version, checkpoint_id) behind an alias, or None."""
        from mlflow.exceptions import MlflowException

        try:
            v = self._client().get_model_version_by_alias(model_name, alias)
        except MlflowException:
            return None
        return str(v.version), v.tags.get("checkpoint_id", "")
