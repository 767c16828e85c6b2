"""The vLLM environment the tests of the real engine need: `make test` installs it beside the suite (the Makefile's
`test` target starts `python -m nexa_dagster.core.llm.vllm_env install` in the background, writing
`.vllm-install.log`, its process id in `.vllm-install.pid` and, when it ends, its exit status in
`.vllm-install.rc`); a test that needs the engine waits
for that install here instead of skipping.

What a test gets: the install finished and vLLM is there, or a failure naming the install's log (its last lines)
under `make test` and CI, never a silent skip there. Run by hand (`pytest tests/integration/test_vllm_engine.py`)
with no install under way and none done, it skips with the one line that says how to install it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from nexa_dagster.core.llm.managed_server import vllm_available
from nexa_dagster.core.llm.vllm_env import INSTALL_HINT, env_dir

REPO = Path(__file__).resolve().parents[2]
LOG, STATUS, PID = REPO / ".vllm-install.log", REPO / ".vllm-install.rc", REPO / ".vllm-install.pid"
# from nothing: 2 min idle on the 2-core machine, 9 min at load 8-9 (docs/measurements.md, vLLM); then twice that
WAIT_S = 1200.0
POLL_S = 5.0


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _installing() -> bool:
    """`make test`'s install is still running (its process is alive and has not written its status)."""
    if STATUS.exists():
        return False
    try:
        os.kill(int(PID.read_text().strip()), 0)
    except (OSError, ValueError):
        return False
    return True


def require_vllm() -> None:
    """Wait for `make test`'s install of vLLM if one is under way; fail on a failed one; skip only by hand."""
    deadline = time.monotonic() + WAIT_S
    while _installing() and time.monotonic() < deadline:
        time.sleep(POLL_S)
    if _installing():
        pytest.fail(f"vLLM's install ({LOG}) has not ended after {WAIT_S:.0f} s:\n{_tail(LOG)}")
    if STATUS.exists() and STATUS.read_text().strip() != "0":
        pytest.fail(f"vLLM's install failed (exit {STATUS.read_text().strip()}), {LOG}:\n{_tail(LOG)}")
    if vllm_available():
        return
    message = f"vLLM is not installed for this host at {env_dir()}: {INSTALL_HINT}"
    if os.environ.get("CI") or STATUS.exists():  # make test or CI: the install said it worked, yet no vLLM
        pytest.fail(message)
    pytest.skip(message)
