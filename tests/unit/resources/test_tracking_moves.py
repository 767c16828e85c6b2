"""The local MLflow store moves with its data root: MLflow records artifact locations as absolute ``file://`` URIs,
so after a real move of the data root (``os.rename``, as ``mv``) runs must still be written inside it, never under
the old path, and what was logged before the move must be found at the new place."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from nexa_dagster.resources.tracking import TrackingResource

MODEL = "nexa-moe"


def test_the_local_tracking_store_follows_a_moved_data_root(tmp_path: Path, tiny_model_dir: Path) -> None:
    site, moved_to = tmp_path / "site", tmp_path / "restored" / "elsewhere"
    old = site / "data"
    checkpoint = old / "checkpoints" / "ckpt-1"
    shutil.copytree(tiny_model_dir, checkpoint)
    curve = tmp_path / "loss_curve.png"
    curve.write_bytes(b"\x89PNG before the move")
    tracking = TrackingResource(data_root=str(old))
    with tracking.start_run(run_name="ckpt-1", tags={"stage": "training"}) as run:
        run.log_artifact(curve)
        before = run.run_id
    tracking.register_checkpoint(MODEL, "ckpt-1", str(checkpoint), before)

    moved_to.parent.mkdir(parents=True)
    os.rename(site, moved_to)
    new = moved_to / "data"
    here = TrackingResource(data_root=str(new))
    report = tmp_path / "report.md"
    report.write_text("# after the move\n")
    with here.start_run(run_name="eval-ckpt-1", tags={"stage": "evaluation"}) as run:
        run.log_metrics({"eval_loss": 1.25})
        run.log_stored_file(str(report), "report.md")
        after = run.run_id

    assert not site.exists(), sorted(str(p) for p in site.rglob("*"))  # nothing written under the old path
    client = here._client()
    experiment = client.get_experiment_by_name("nexa")
    assert experiment.artifact_location == (new / "mlartifacts").as_uri()
    for run_id in (before, after):
        assert client.get_run(run_id).info.artifact_uri.startswith((new / "mlartifacts").as_uri()), run_id
    # the run logged before the move: its artifacts moved with the data root and are found there
    downloaded = Path(client.download_artifacts(before, "loss_curve.png", str(tmp_path / "dl")))
    assert downloaded.read_bytes() == b"\x89PNG before the move"
    assert (new / "mlartifacts").is_dir() and any((new / "mlartifacts").rglob("report.md"))
    # the registered checkpoint is found where it lies now
    assert here.registered_checkpoints(MODEL) == {"ckpt-1": str(new / "checkpoints" / "ckpt-1")}
    (version,) = client.search_model_versions(f"name='{MODEL}'")
    assert version.tags["checkpoint_path"] == "checkpoints/ckpt-1"
