"""Experiment tracking: MLflow, with a local SQLite store under the data root by default.

The local store moves with its data root: MLflow records an experiment's artifact location (and each run's) as an
absolute ``file://`` URI when it creates them, so after a move (``mv`` of the data root or the checkout, a copy to
another host, a restore) the store still names the old place, and runs logged afterwards would be written there,
outside the data root. Before every run the resource checks the experiment's location against the data root as it
is now and, when it names an ``mlartifacts`` folder elsewhere, moves the store's records to the current one
(``rebase_sqlite_store``): nothing is written under the old path, and earlier runs' artifacts (which moved with
the data root) are found again. A checkpoint's directory is kept in its model version's ``checkpoint_path`` tag
relative to the data root.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dagster as dg

from nexa_dagster.core.common import roots, storage
from nexa_dagster.core.common.config import resolve_path
from nexa_dagster.core.evaluation.model_registry import log_checkpoint_model

ARTIFACTS = "mlartifacts"
# every place a local SQLite store keeps an artifact location: (table, column); tables an MLflow version lacks are
# skipped
LOCATION_COLUMNS = (
    ("experiments", "artifact_location"),
    ("runs", "artifact_uri"),
    ("model_versions", "storage_location"),
    ("model_versions", "source"),
    ("logged_models", "artifact_location"),
)


def rebase_sqlite_store(db: Path, old: str, new: str) -> None:
    """Rewrite every artifact location of the SQLite tracking store ``db`` under ``old`` (a ``file://`` URI) to the
    same place under ``new``, in one transaction (concurrent runs rebasing at once: the second finds nothing)."""
    con = sqlite3.connect(str(db), timeout=60, isolation_level=None)
    try:
        con.execute("BEGIN IMMEDIATE")
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        for table, column in LOCATION_COLUMNS:
            if table not in tables:
                continue
            columns = {r[1] for r in con.execute(f"PRAGMA table_info({table})")}
            if column not in columns:
                continue
            con.execute(
                f"UPDATE {table} SET {column} = ? || substr({column}, ?) "
                f"WHERE {column} = ? OR substr({column}, 1, ?) = ?",
                (new, len(old) + 1, old, len(old) + 1, old + "/"),
            )
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
    finally:
        con.close()


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

    def log_stored_file(self, path: str, artifact_file: str) -> None:
        """A text file from the project's storage (local or fsspec URL) as an artifact of this run."""
        with storage.open_read(path) as f:
            self.client.log_text(self.run_id, f.read().decode("utf-8"), artifact_file)


class TrackingResource(dg.ConfigurableResource):
    """MLflow tracking. ``tracking_uri`` empty means ``sqlite:///<data_root>/mlflow.db``."""

    tracking_uri: str = ""
    data_root: str = "data"
    experiment: str = "nexa"

    def is_server(self) -> bool:
        """A tracking server (``http(s)://``): it decides where artifacts go, not a path of this host."""
        return self.uri().startswith(("http://", "https://"))

    def uri(self) -> str:
        if self.tracking_uri:
            return self.tracking_uri
        root = resolve_path(self.data_root)
        root.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{root / 'mlflow.db'}"

    def artifact_root(self) -> str:
        """Where a local store keeps its artifacts: ``<data_root>/mlartifacts``, as a ``file://`` URI."""
        return (resolve_path(self.data_root) / ARTIFACTS).as_uri()

    def follow_moved_data_root(self, artifact_location: str) -> bool:
        """When the local store's experiment keeps its artifacts in an ``mlartifacts`` folder that is not this data
        root's (the data root was moved, copied or restored elsewhere), move the store's records to this data
        root's folder; True when it did. A tracking server, or a location the project did not choose, is left as
        it is."""
        here = self.artifact_root()
        if (
            self.tracking_uri
            or artifact_location == here
            or not artifact_location.startswith("file://")
            or not artifact_location.rstrip("/").endswith("/" + ARTIFACTS)
        ):
            return False
        rebase_sqlite_store(resolve_path(self.data_root) / "mlflow.db", artifact_location.rstrip("/"), here)
        return True

    @contextmanager
    def start_run(self, run_name: str, tags: Mapping[str, str] | None = None) -> Iterator[MLflowRun]:
        from mlflow.tracking import MlflowClient  # MLflow: seconds to import, not at the code location's load

        client = MlflowClient(tracking_uri=self.uri())
        exp = client.get_experiment_by_name(self.experiment)
        if exp is None:
            # a local store keeps artifacts under the data root; a server stores them itself (mlflow-artifacts:/),
            # where every client can fetch them, instead of at a path of whichever host created the experiment
            artifacts = None if self.is_server() else self.artifact_root()
            exp_id = client.create_experiment(self.experiment, artifact_location=artifacts)
        else:
            exp_id = exp.experiment_id
            self.follow_moved_data_root(exp.artifact_location)
        run = client.create_run(exp_id, run_name=run_name, tags=dict(tags or {}))
        status = "FAILED"
        try:
            yield MLflowRun(client, run.info.run_id)
            status = "FINISHED"
        finally:
            client.set_terminated(run.info.run_id, status=status)

    # -- model registry ---------------------------------------------------------------------------------------
    def _client(self) -> Any:
        from mlflow.tracking import MlflowClient  # MLflow: seconds to import, not at the code location's load

        return MlflowClient(tracking_uri=self.uri())

    def register_checkpoint(self, model_name: str, checkpoint_id: str, path: str, run_id: str | None) -> str:
        """Log the checkpoint directory as an MLflow ``transformers`` model (an artifact of ``run_id``, or of a
        new registration run) and register it as a new version of ``model_name``; returns the version.

        The version's source is ``runs:/<run>/model`` (the model itself, loadable by any client of the tracking
        server); the directory it came from is kept in the ``checkpoint_path`` tag for this host's stages.
        """
        from mlflow.exceptions import MlflowException  # MLflow: seconds, not at the code location's load

        client = self._client()
        if run_id is None:
            with self.start_run(
                run_name=f"register-{checkpoint_id}",
                tags={"stage": "registration", "checkpoint_id": checkpoint_id},
            ) as run:
                source = log_checkpoint_model(client, run.run_id, path)
                run_id = run.run_id
        else:
            source = log_checkpoint_model(client, run_id, path)
        with contextlib.suppress(MlflowException):  # already registered
            client.create_registered_model(model_name)
        version = client.create_model_version(
            model_name,
            source=source,
            run_id=run_id,
            # relative to the data root when it lies there: a moved data root keeps finding it
            tags={
                "checkpoint_id": checkpoint_id,
                "checkpoint_path": roots.relative_to(str(path), str(resolve_path(self.data_root))),
            },
        )
        return str(version.version)

    def version_of(self, model_name: str, checkpoint_id: str) -> str | None:
        for v in self._client().search_model_versions(f"name='{model_name}'"):
            if v.tags.get("checkpoint_id") == checkpoint_id:
                return str(v.version)
        return None

    def registered_checkpoints(self, model_name: str) -> dict[str, str]:
        """{checkpoint_id: checkpoint directory} of every registered version of ``model_name`` (empty if none):
        the ``checkpoint_path`` tag, or the source of a version registered elsewhere from a plain path."""
        from mlflow.exceptions import MlflowException  # MLflow: seconds, not at the code location's load

        try:
            versions = self._client().search_model_versions(f"name='{model_name}'")
        except MlflowException:
            return {}
        root = str(resolve_path(self.data_root))
        return {
            v.tags["checkpoint_id"]: roots.resolve_under(v.tags["checkpoint_path"], root)
            if "checkpoint_path" in v.tags
            else v.source
            for v in versions
            if v.tags.get("checkpoint_id")
        }

    def set_alias(self, model_name: str, alias: str, version: str) -> None:
        self._client().set_registered_model_alias(model_name, alias, version)

    def alias_version(self, model_name: str, alias: str) -> tuple[str, str] | None:
        """(version, checkpoint_id) behind an alias, or None."""
        from mlflow.exceptions import MlflowException  # MLflow: seconds, not at the code location's load

        try:
            v = self._client().get_model_version_by_alias(model_name, alias)
        except MlflowException:
            return None
        return str(v.version), v.tags.get("checkpoint_id", "")
