"""Installs of the shipped tiny models that start together (two `make run`s at once on a fresh data root): real
processes racing for one target, each importing torch and transformers, so the test is ``slow``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nexa_dagster.core.common.artifacts import COMPLETION_MARKER

pytestmark = pytest.mark.slow  # three processes importing transformers: left out of make test-fast

BUILD = (
    "import sys; from nexa_dagster.core.tiny.install import install_tiny_models; "
    "from transformers import AutoModelForCausalLM; "
    "AutoModelForCausalLM.from_pretrained(install_tiny_models([sys.argv[1]])[0]); print('loaded')"
)


def test_installs_that_start_together_install_the_model_once_and_all_load_it(tmp_path: Path) -> None:
    """Three installs into one fresh data root at once (two `make run`s started together): every one of them must
    load a complete model, and one directory (no leftovers) must remain."""
    target = tmp_path / "models" / "tiny-teacher"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BUILD, str(target)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    for proc, (out, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0 and out.strip().endswith("loaded"), err[-2000:]
    assert (target / COMPLETION_MARKER).exists()
    left = sorted(p.name for p in target.parent.iterdir())
    assert left == [".tiny-teacher.lock", "tiny-teacher"], left
