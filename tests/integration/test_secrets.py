"""An API key given to the pipeline never leaves the process that uses it.

The teacher is reached through the `openai` backend (a real `transformers serve` on the tiny model) with an API
key from the environment (dagster.EnvVar); after a real day's run, the key is searched for in everything the run
left behind: the event log (every event, serialized), materialization metadata, the process's stdout/stderr, and
every byte of every file written under the data, results and Dagster home directories.
"""

import shutil
from pathlib import Path

import dagster as dg
import pytest
from support.sandbox import SAMPLE_LANDING

from nexa_dagster.core.common.config import REPO_ROOT
from nexa_dagster.core.llm.managed_server import ManagedServer
from nexa_dagster.core.tiny.model import build_tiny_causal_lm

# whole runs whose every log, event and file is searched: left out of make test-fast
pytestmark = pytest.mark.slow

SECRET = "sk-nexa-TEST-9f2c41d7e8b0a6"
DAY = "2026-11-20"


def test_the_api_key_is_in_no_event_metadata_log_or_file(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    teacher = build_tiny_causal_lm(tmp_path / "data" / "models" / "tiny-teacher")
    shutil.copytree(SAMPLE_LANDING / DAY, tmp_path / "landing" / DAY)
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(REPO_ROOT / "dagster.yaml", home / "dagster.yaml")
    with ManagedServer(teacher, tmp_path / "server-logs") as server:
        for key, value in {
            "NEXA_DATA_ROOT": str(tmp_path / "data"),
            "NEXA_RESULTS_ROOT": str(tmp_path / "results"),
            "NEXA_LANDING_ROOT": str(tmp_path / "landing"),
            "DAGSTER_HOME": str(home),
            "NEXA_TEACHER_BACKEND": "openai",
            "NEXA_TEACHER_URL": server.base_url,
            "NEXA_TEACHER_MODEL": server.model_name,
            "NEXA_TEACHER_API_KEY": SECRET,
        }.items():
            monkeypatch.setenv(key, value)
        from nexa_dagster.definitions import build_defs

        instance = dg.DagsterInstance.get()
        try:
            result = (
                build_defs()
                .resolve_job_def("daily_data_job")
                .execute_in_process(instance=instance, partition_key=DAY)
            )
            assert result.success
            teacher_meta = instance.get_latest_materialization_event(dg.AssetKey("teacher_samples"))
            assert teacher_meta is not None
            described = str({k: v.value for k, v in teacher_meta.asset_materialization.metadata.items()})
            assert "openai" in described, "the teacher did not go through the openai backend"
            events = instance.all_logs(result.run_id)
            assert len(events) > 20
            for event in events:
                assert SECRET not in dg.serialize_value(event), event.dagster_event_type
        finally:
            instance.dispose()

    out, err = capfd.readouterr()
    assert SECRET not in out and SECRET not in err
    leaked = [
        str(p)
        for root in (tmp_path / "data", tmp_path / "results", home, tmp_path / "server-logs")
        if root.exists()
        for p in root.rglob("*")
        if p.is_file() and SECRET.encode() in p.read_bytes()
    ]
    assert not leaked, leaked
    scanned = sum(1 for root in (tmp_path / "data", home) for p in root.rglob("*") if p.is_file())
    assert scanned > 10, "the scan saw too few files to mean anything"
