"""A disk that fills up during a write: a clear error naming the file, and the previous materialization intact.

The data root is a real 1 MB tmpfs mounted by the test (root, as in CI); a filler file leaves it nearly full
before the second materialization of the same partition.
"""

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
from support.sandbox import SAMPLE_LANDING
from support.services import missing

from nexa_dagster.definitions import config_resources

DAY = "2026-11-20"


@pytest.fixture
def small_disk() -> Iterator[Path]:
    if os.geteuid() != 0:
        missing("root (to mount a size-limited tmpfs)", "run as root, as CI does")
    mount = Path(tempfile.mkdtemp(prefix="nexa-full-"))
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        missing(f"a mountable tmpfs ({proc.stderr.strip()})", "run where root may mount tmpfs")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)
        shutil.rmtree(mount, ignore_errors=True)


def test_a_full_disk_fails_the_write_clearly_and_keeps_the_previous_version(
    small_disk: Path, tmp_path: Path
) -> None:
    from nexa_dagster.assets.ingest import raw_documents
    from nexa_dagster.resources.io_manager import NexaIOManager
    from nexa_dagster.resources.storage import StorageResource

    landing = tmp_path / "landing"
    shutil.copytree(SAMPLE_LANDING / DAY, landing / DAY)
    data = str(small_disk / "data")
    resources = {
        **config_resources(),
        "io_manager": NexaIOManager(data_root=data),
        "storage": StorageResource(data_root=data, landing_root=str(landing)),
        **config_resources(),
    }
    instance = dg.DagsterInstance.ephemeral()
    assert dg.materialize([raw_documents], partition_key=DAY, resources=resources, instance=instance).success
    written = sorted(p for p in (small_disk / "data").rglob("*") if p.is_file())
    assert written, "the first materialization wrote nothing"
    before = {p: p.read_bytes() for p in written}

    free = shutil.disk_usage(small_disk).free
    (small_disk / "filler").write_bytes(b"\0" * max(0, free - 2048))  # leave 2 KB: less than one partition
    result = dg.materialize(
        [raw_documents], partition_key=DAY, resources=resources, instance=instance, raise_on_error=False
    )
    assert not result.success
    error = str(result.get_step_failure_events()[0].step_failure_data.error)
    assert "No space left on device" in error and "cannot write" in error and str(small_disk) in error, error
    assert {p: p.read_bytes() for p in written} == before, "the previous materialization was changed"
    leftovers = [p.name for p in (small_disk / "data").rglob("*.tmp")]
    assert not leftovers, f"half-written temporary files left behind: {leftovers}"
