"""The project's own tiny model: built on first use, and safely when several runs start at once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from nexa_dagster.core.tiny_model import COMPLETION_MARKER

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BUILD = ("import sys; from nexa_dagster.core.tiny_model import ensure_model; "
         "from transformers import AutoModelForCausalLM; "
         "AutoModelForCausalLM.from_pretrained(ensure_model(sys.argv[1])); print('loaded')")


def test_runs_that_start_together_build_the_model_once_and_all_load_it(tmp_path: Path) -> None:
    """The first runs of a multi-run backfill on a fresh data root all ask for data/models/tiny-teacher at once:
    every one of them must load a complete model, and one directory (no leftovers) must remain."""
    target = tmp_path / "models" / "tiny-teacher"
    procs = [subprocess.Popen([sys.executable, "-c", BUILD, str(target)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [p.communicate(timeout=300) for p in procs]
    for proc, (out, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0 and out.strip().endswith("loaded"), err[-2000:]
    assert (target / COMPLETION_MARKER).exists()
    left = sorted(p.name for p in target.parent.iterdir())
    assert left == [".tiny-teacher.lock", "tiny-teacher"], left
