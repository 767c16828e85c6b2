"""Install the project's tiny models where the configuration expects them: an explicit step, never a side effect.

Every configured model directory named ``tiny-*`` (``configs/pipeline.yaml``'s ``models``: a bare name means
``<data_root>/models/<name>``) gets a copy of the tiny teacher/judge the repository ships. ``make run`` and the
tests run it (``nexa-dagster tiny-models``); the pipeline itself never builds a model behind a configured path: a
path that holds no model is an error naming it (``core/common/artifacts.require_model_dir``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from nexa_dagster.core.tiny.pretrain import build_pretrained_tiny_lm


def install_tiny_models(model_dirs: Iterable[str | Path]) -> list[Path]:
    """A complete tiny model in each of ``model_dirs`` named ``tiny-*`` (others are real models: left alone)."""
    return [
        build_pretrained_tiny_lm(d)
        for d in dict.fromkeys(Path(p) for p in model_dirs)
        if d.name.startswith("tiny-")
    ]
