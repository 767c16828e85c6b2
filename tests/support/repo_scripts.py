"""The repository's scripts and benches (``scripts/``, ``bench/``) loaded as modules, for tests of what they read
and decide: they are programs, not a package, so nothing imports them by name."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from nexa_dagster.core.common.config import REPO_ROOT


def load_script(relative: str) -> ModuleType:
    """``relative`` (``"scripts/clean_clone_times.py"``) under the repository root, executed as a module of its own
    (registered in ``sys.modules`` first: a dataclass in it looks its module up there)."""
    name = relative.removesuffix(".py").replace("/", "_")
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / relative)
    assert spec is not None and spec.loader is not None, relative
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
