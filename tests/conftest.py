"""Shared fixtures. Tests run offline (no model hub) against real components built locally."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from nexa_dagster.core.tiny.model import build_tiny_causal_lm  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny tokenizer + random Mixtral, saved with save_pretrained (built once per test session)."""
    return build_tiny_causal_lm(tmp_path_factory.mktemp("shared") / "models" / "tiny-teacher")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))
