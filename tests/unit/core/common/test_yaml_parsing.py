"""The configuration's YAML is parsed by libyaml (``config.parse_yaml``): the same values as PyYAML's own loader for
every file the project ships, and, for a document it refuses, PyYAML's own error, which quotes the line."""

from __future__ import annotations

import pytest
import yaml

from nexa_dagster.core.common import config
from nexa_dagster.core.common.config import REPO_ROOT, parse_yaml

SHIPPED = sorted((REPO_ROOT / "configs").rglob("*.yaml"))


def test_every_shipped_yaml_file_parses_to_what_pyyaml_gives() -> None:
    assert len(SHIPPED) > 20, SHIPPED
    for path in SHIPPED:
        text = path.read_text(encoding="utf-8")
        assert parse_yaml(text) == yaml.safe_load(text), path


def test_the_fast_loader_is_libyamls_where_pyyaml_has_it() -> None:
    if not yaml.__with_libyaml__:
        pytest.skip("this PyYAML was built without libyaml: the pure-Python loader is all it has")
    assert config._FAST_LOADER is yaml.CSafeLoader


def test_a_broken_document_raises_pyyamls_error_quoting_the_line() -> None:
    broken = "scale: tiny\ntraining:\n  max_steps: [1, 2\n"
    with pytest.raises(yaml.YAMLError) as caught:
        parse_yaml(broken)
    assert "max_steps: [1, 2" in str(caught.value) and "^" in str(caught.value), str(caught.value)


def test_a_tag_the_safe_loader_refuses_is_refused() -> None:
    with pytest.raises(yaml.YAMLError, match="python/object"):
        parse_yaml("x: !!python/object:os.system {}\n")
