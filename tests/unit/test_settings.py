"""Every environment variable in one module, documented: the table in docs/configuration.md is the module's, and a
variable's value is read when asked for, so setting it takes effect without a re-import."""

from __future__ import annotations

from pathlib import Path

import pytest

from nexa_dagster import settings

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_configuration_page_lists_every_variable_as_the_settings_module_does() -> None:
    page = DOCS.read_text(encoding="utf-8")
    assert settings.markdown_table() in page, (
        "docs/configuration.md's variable table differs from nexa_dagster/settings.py: paste "
        "`python -c 'from nexa_dagster import settings; print(settings.markdown_table())'` there"
    )
    names = [v.name for v in settings.VARIABLES]
    assert len(names) == len(set(names))


def test_a_variable_is_read_when_asked_for(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("NEXA_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert settings.cache_root() == tmp_path / "xdg" / "nexa-dagster"
    monkeypatch.setenv("NEXA_CACHE_DIR", str(tmp_path / "mine"))
    assert settings.cache_root() == tmp_path / "mine"
    monkeypatch.setenv("NEXA_SCALE", "")  # empty counts as unset: the default
    assert settings.SCALE.get() == "tiny" and not settings.SCALE.is_set()
