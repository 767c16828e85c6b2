"""A local model's identity is its content (config, weights, tokenizer), cheap to recompute, blind to location."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from nexa_dagster.core.llm import model_identity
from nexa_dagster.core.llm.model_identity import model_fingerprint


def _model(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "mixtral"}')
    (root / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (root / "tokenizer.json").write_text('{"version": "1.0"}')
    (root / "_COMPLETE").write_text("ok\n")
    (root / "checkpoint.json").write_text(f'{{"path": "{root}"}}')  # names where it lies: not part of it
    return root


def test_fingerprint_follows_the_content_not_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NEXA_CACHE_DIR", str(tmp_path / "cache"))
    a = _model(tmp_path / "a" / "models" / "teacher")
    first = model_fingerprint(a)
    assert first.startswith("sha256:") and len(first) == len("sha256:") + 32
    b = tmp_path / "b" / "elsewhere"
    shutil.copytree(a, b)
    (b / "checkpoint.json").write_text(f'{{"path": "{b}"}}')
    assert model_fingerprint(b) == first
    assert len(list((tmp_path / "cache" / "model-fingerprints").glob("*.json"))) == 2  # cached per directory

    # a changed weight (same size: only the bytes and the mtime differ) is a different model
    weights = bytearray((b / "model.safetensors").read_bytes())
    weights[100] ^= 0xFF
    (b / "model.safetensors").write_bytes(bytes(weights))
    st = (b / "model.safetensors").stat()
    os.utime(b / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert model_fingerprint(b) != first
    # a changed tokenizer too
    (a / "tokenizer.json").write_text('{"version": "1.1"}')
    assert model_fingerprint(a) != first


def test_an_unchanged_model_is_not_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEXA_CACHE_DIR", str(tmp_path / "cache"))
    a = _model(tmp_path / "m")
    first = model_fingerprint(a)
    model_identity._MEMO.clear()  # a new process: only the on-disk cache is left

    def no_reading(files: list[Path]) -> str:
        raise AssertionError(f"hashed {files} again although nothing changed")

    monkeypatch.setattr(model_identity, "_digest", no_reading)
    assert model_fingerprint(a) == first


def test_a_directory_without_config_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        model_fingerprint(tmp_path)
