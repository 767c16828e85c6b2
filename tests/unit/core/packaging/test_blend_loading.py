"""A blend file goes through the configuration's one loading sequence (``config.load_validated``): relative to
``configs/`` or absolute, and each way it can be wrong fails naming the file (and the key)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nexa_dagster.core.common.config import ConfigError, config_dir
from nexa_dagster.core.packaging.blend import DataBlend


def test_a_blend_outside_configs_loads_from_its_absolute_path(tmp_path: Path) -> None:
    shipped = (config_dir() / "blends" / "sft.yaml").read_text(encoding="utf-8")
    copy = tmp_path / "my_blend.yaml"
    copy.write_text(shipped, encoding="utf-8")
    assert DataBlend.load(copy) == DataBlend.load("blends/sft.yaml")


def test_a_missing_blend_names_its_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not_there.yaml"):
        DataBlend.load(tmp_path / "not_there.yaml")


def test_a_blend_that_is_not_yaml_names_its_file_and_line(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: sft\nsources: [\n  {name: a, path: x.jsonl\n", encoding="utf-8")
    with pytest.raises(ValueError, match="invalid YAML in .*broken.yaml") as caught:
        DataBlend.load(broken)
    assert "line" in str(caught.value)


def test_a_blend_with_an_unknown_key_names_its_file_and_the_key(tmp_path: Path) -> None:
    typo = tmp_path / "typo.yaml"
    typo.write_text("name: sft\nsources:\n  - name: a\n    path: x.jsonl\n    wieght: 2\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"typo\.yaml.*wieght"):
        DataBlend.load(typo)


def test_an_empty_blend_says_what_it_lacks(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"empty\.yaml.*name"):
        DataBlend.load(empty)
