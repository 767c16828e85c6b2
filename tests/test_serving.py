"""Serving a checkpoint: a real server comes up, answers a smoke request, and is gone afterwards."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import psutil

from nexa_dagster.core.serving import DeploymentManifest, deploy_and_smoke


def test_deploy_and_smoke_writes_a_manifest_and_stops_the_server(tiny_model_dir: Path, tmp_path: Path) -> None:
    manifest = deploy_and_smoke(tiny_model_dir, "tiny", tmp_path, max_tokens=16)
    stored = DeploymentManifest.model_validate(json.loads((tmp_path / "deployment.json").read_text()))
    assert stored == manifest
    assert manifest.engine == "transformers" and manifest.status == "ok" and manifest.error is None
    assert manifest.smoke_response.strip() and 0 < manifest.completion_tokens <= 16
    assert manifest.smoke_latency_s > 0 and manifest.ready_s > 0
    assert manifest.started_at <= manifest.stopped_at
    assert manifest.model_name == str(tiny_model_dir.resolve())
    port = int(manifest.base_url.rsplit(":", 1)[1].split("/")[0])
    with socket.socket() as s:  # nothing listens on the port any more
        assert s.connect_ex(("127.0.0.1", port)) != 0
    leftovers = [p for p in psutil.Process().children(recursive=True) if "serve" in " ".join(p.cmdline())]
    assert not leftovers
    assert not list(tmp_path.glob(".*.tmp"))  # the manifest was written under a temporary name, then renamed
    log = Path(manifest.log_path)
    assert log == tmp_path / f"transformers-serve-{port}.log" and "serve" in log.read_text()
