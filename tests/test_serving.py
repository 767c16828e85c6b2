"""Serving a checkpoint: a real server comes up, answers a smoke request, and is gone afterwards."""

from __future__ import annotations

import json
from pathlib import Path

from nexa_dagster.core.serving import DeploymentManifest, deploy_and_smoke


def test_deploy_and_smoke_writes_a_manifest_and_stops_the_server(tiny_model_dir: Path, tmp_path: Path) -> None:
    manifest = deploy_and_smoke(tiny_model_dir, "tiny", tmp_path)
    stored = DeploymentManifest.model_validate(json.loads((tmp_path / "deployment.json").read_text()))
    assert stored == manifest
    assert manifest.engine == "transformers" and manifest.status == "ok"
    assert manifest.completion_tokens > 0 and manifest.smoke_latency_s > 0 and manifest.ready_s > 0
    port = int(manifest.base_url.rsplit(":", 1)[1].split("/")[0])
    import socket

    with socket.socket() as s:  # nothing listens on the port any more
        assert s.connect_ex(("127.0.0.1", port)) != 0
    assert not list(tmp_path.glob(".*.tmp"))
    assert (tmp_path / f"transformers-serve-{port}.log").exists()
