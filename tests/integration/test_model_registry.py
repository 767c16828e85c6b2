"""Checkpoints in the MLflow model registry are MLflow ``transformers`` models, loadable by any client.

Against the project's default local store (SQLite + artifacts under the data root) and against a real
``mlflow server`` process (artifacts proxied by the server): the version's source is an artifact URI, not a path of
the training host, and ``mlflow.transformers.load_model("models:/nexa-moe@production")`` gives the checkpoint's
logits and generates.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.services import mlflow_server

from nexa_dagster.resources.tracking import TrackingResource

MODEL = "nexa-moe"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """One ``mlflow server`` for the module's server tests: it takes a while to come up (close to a minute on a
    loaded 2-core machine), so those tests are ``slow``; ``server()`` waits for it."""
    root = tmp_path_factory.mktemp("mlflow-server")
    with mlflow_server(root, wait=False) as (url, wait):
        yield lambda: (wait(), (url, root))[1]


@pytest.fixture
def client_of(monkeypatch: pytest.MonkeyPatch):
    """Point MLflow's fluent API (what ``mlflow.transformers.load_model`` resolves ``models:/`` with) at a
    tracking URI for this test only: monkeypatch restores the env var and the module global afterwards."""
    import mlflow.tracking._model_registry.utils as registry_utils
    import mlflow.tracking._tracking_service.utils as tracking_utils

    def use(uri: str) -> None:
        monkeypatch.setattr(tracking_utils, "_tracking_uri", None)
        monkeypatch.setattr(registry_utils, "_registry_uri", None)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)

    return use


def _register_as_training_does(tracking: TrackingResource, checkpoint: Path) -> tuple[str, str]:
    """An MLflow run with an artifact (as the training asset logs its loss curve), the checkpoint registered from
    it, the production alias on it; returns (version, run id)."""
    curve = checkpoint.parent / "loss_curve.png"
    curve.write_bytes(b"\x89PNG not really")
    with tracking.start_run(run_name="ckpt-1", tags={"stage": "training"}) as run:
        run.log_metrics({"validation_loss": 1.5})
        run.log_artifact(curve)
        run_id = run.run_id
    version = tracking.register_checkpoint(MODEL, "ckpt-1", str(checkpoint), run_id)
    tracking.set_alias(MODEL, "production", version)
    return version, run_id


def _assert_loads_as_the_checkpoint(checkpoint: Path, download: Path) -> None:
    """The registered model, loaded by MLflow's own loader, is the checkpoint: same logits, same chat template,
    and it generates. It is downloaded to ``download`` (new), as docs/operations.md tells a user to: without a
    ``dst_path`` MLflow copies the model into a temporary folder it never removes, the weights in it."""
    import mlflow.transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    download.mkdir(parents=True)
    pipeline = mlflow.transformers.load_model(f"models:/{MODEL}@production", dst_path=str(download))
    reference = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    ids = torch.tensor([[5, 17, 42, 99, 7, 300]])
    with torch.no_grad():
        torch.testing.assert_close(pipeline.model.eval()(ids).logits, reference(ids).logits)
    assert pipeline.tokenizer.chat_template == AutoTokenizer.from_pretrained(checkpoint).chat_template
    out = pipeline("def f(x):", max_new_tokens=4, do_sample=False)
    assert out[0]["generated_text"].startswith("def f(x):") and len(out[0]["generated_text"]) > len(
        "def f(x):"
    )


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import shutil

    out = tmp_path_factory.mktemp("checkpoint") / "ckpt-1"
    shutil.copytree(tiny_model_dir, out)
    return out


def test_local_store_holds_the_model_not_a_path(checkpoint: Path, tmp_path: Path, client_of) -> None:
    tracking = TrackingResource(data_root=str(tmp_path / "data"))
    version, run_id = _register_as_training_does(tracking, checkpoint)
    client = tracking._client()
    v = client.get_model_version(MODEL, version)
    assert v.source == f"runs:/{run_id}/model" and str(checkpoint) not in v.source
    assert tracking.registered_checkpoints(MODEL) == {
        "ckpt-1": str(checkpoint)
    }  # this host's stages still find it
    assert {"model", "loss_curve.png"} <= {a.path for a in client.list_artifacts(run_id)}
    assert "MLmodel" in {Path(a.path).name for a in client.list_artifacts(run_id, "model")}
    client_of(tracking.uri())
    _assert_loads_as_the_checkpoint(checkpoint, tmp_path / "download")


@pytest.mark.slow  # an `mlflow server` process: left out of make test-fast
@pytest.mark.xdist_group("mlflow_server")  # both server tests on one worker: one server, not one per worker
def test_a_tracking_server_holds_and_serves_the_model(
    server, checkpoint: Path, tmp_path: Path, client_of
) -> None:
    """The client's host keeps nothing: the model and the run's artifacts are in the server's artifact store, and a
    client that only knows the server's URL loads the model from there."""
    url, server_root = server()
    tracking = TrackingResource(tracking_uri=url, data_root=str(tmp_path / "data"))
    version, run_id = _register_as_training_does(tracking, checkpoint)
    client = tracking._client()
    assert client.get_model_version(MODEL, version).source == f"runs:/{run_id}/model"
    assert client.get_run(run_id).info.artifact_uri.startswith("mlflow-artifacts:/")
    stored = {p.name for p in (server_root / "artifacts").rglob("*") if p.is_file()}
    assert {"MLmodel", "loss_curve.png", "config.json"} <= stored
    assert not (tmp_path / "data" / "mlartifacts").exists()  # nothing at a path of the client's host

    moved = checkpoint.parent / "gone"
    checkpoint.rename(moved)  # the registry must not need the training host's directory
    try:
        client_of(url)
        _assert_loads_as_the_checkpoint(moved, tmp_path / "download")
        # the python_function flavor, what `mlflow models serve -m models:/nexa-moe@production` serves
        import mlflow.pyfunc

        (tmp_path / "download-pyfunc").mkdir()
        served = mlflow.pyfunc.load_model(
            f"models:/{MODEL}@production", dst_path=str(tmp_path / "download-pyfunc")
        )
        assert served.metadata.flavors["python_function"]["loader_module"] == "mlflow.transformers"
        answer = served.predict(["def f(x):"], params={"max_new_tokens": 4, "do_sample": False})
        assert isinstance(answer[0], str) and answer[0]
    finally:
        moved.rename(checkpoint)


@pytest.mark.slow  # an `mlflow server` process: left out of make test-fast
@pytest.mark.xdist_group("mlflow_server")  # both server tests on one worker: one server, not one per worker
def test_an_evaluation_run_holds_its_report(server, tmp_path: Path) -> None:
    """What the eval_report asset logs: report.json / report.md, read from the project's storage, become artifacts
    of the evaluation run on the server."""
    import json

    url, _ = server()
    tracking = TrackingResource(tracking_uri=url, data_root=str(tmp_path / "data"))
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"eval_loss": 1.25}))
    with tracking.start_run(run_name="eval-ckpt-1", tags={"stage": "evaluation"}) as run:
        run.log_stored_file(str(report), "report.json")
    fetched = tracking._client().download_artifacts(run.run_id, "report.json", str(tmp_path / "fetched"))
    assert json.loads(Path(fetched).read_text()) == {"eval_loss": 1.25}
