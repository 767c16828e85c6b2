"""The package's shape, checked on its source: core is Dagster-free and layered by stage, no import cycles, every
environment variable read in the settings module, no function over a screen (60 lines), and a function-level import
only with its reason beside it (an optional dependency, or a start-up cost the caller's path does not pay).

Each rule is a function of a source tree, so the tests also run it on a small tree that breaks the rule: a check
that could never fail would prove nothing.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from nexa_dagster.core.common.python_source import parse_python

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "nexa_dagster"
# the project's Python: what the parse rule reads (the package, its tests, benches and scripts)
PYTHON_ROOTS = [PACKAGE, REPO / "tests", REPO / "bench", REPO / "scripts"]
# ``ast.parse`` itself: in parse_python, and in the test that proves parse_python holds where ast.parse breaks
PLAIN_PARSE_ALLOWED = {
    "nexa_dagster/core/common/python_source.py",
    "tests/unit/core/common/test_python_source.py",
}
# the stages of core, lowest first: a stage imports its own modules and those of stages before it, never after
STAGES = [
    "common",
    "llm",
    "data",
    "distill",
    "packaging",
    "rl",
    "training",
    "evaluation",
    "serving",
    "cluster",
    "tiny",
]
ENVIRONMENT_MODULES = {"nexa_dagster.settings", "nexa_dagster.core.common.faults"}
# a screen: past it, a function's story is no longer read at once (issue 49, "a house that stays small")
MAX_FUNCTION_LINES = 60


def modules(root: Path) -> dict[str, ast.Module]:
    """``dotted name -> parsed module`` for every ``.py`` under ``root`` (a package directory)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = parse_python(path.read_text(encoding="utf-8"), str(path))
    return out


def imports(tree: ast.Module) -> Iterator[tuple[str, int]]:
    """Every module an import names (``from a.b import c`` gives ``a.b`` and ``a.b.c``), with its line."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, node.lineno
            for alias in node.names:
                yield f"{node.module}.{alias.name}", node.lineno


def internal_graph(mods: dict[str, ast.Module]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, tree in mods.items():
        for target, _ in imports(tree):
            if target in mods and target != name and not name.startswith(target + "."):
                graph[name].add(target)
    return graph


def stage_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "core" else None


def layering_violations(mods: dict[str, ast.Module]) -> list[str]:
    """Core modules importing Dagster, or a stage importing a later stage."""
    problems = []
    for name, tree in mods.items():
        stage = stage_of(name)
        if stage is None:
            continue
        for target, line in imports(tree):
            if (
                target == "dagster"
                or target.startswith(("dagster.", "dagster_"))
                and not target.startswith("dagster_pipes")
            ):
                problems.append(f"{name}:{line} imports {target} (core is Dagster-free)")
            other = stage_of(target)
            if target.startswith("nexa_dagster.") and other is None and target.split(".")[1] != "settings":
                problems.append(f"{name}:{line} imports {target}, outside core")
            if other and other != stage and STAGES.index(other) > STAGES.index(stage):
                problems.append(
                    f"{name}:{line} imports {target}: stage {stage} must not import the later stage {other}"
                )
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle, as the modules on it (Tarjan's strongly connected components of size > 1)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def environment_reads(mods: dict[str, ast.Module]) -> list[str]:
    """``os.environ`` / ``os.getenv`` / ``os.putenv`` outside the settings module and the fault hooks."""
    problems = []
    for name, tree in mods.items():
        if name in ENVIRONMENT_MODULES:
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "os"
                and node.attr in ("environ", "getenv", "putenv", "unsetenv")
            ):
                problems.append(f"{name}:{node.lineno} reads os.{node.attr}")
    return problems


def long_functions(mods: dict[str, ast.Module], limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Functions (and methods) longer than ``limit`` lines, from ``def`` to their last line."""
    return [
        f"{name}:{node.lineno} {node.name} has {node.end_lineno - node.lineno + 1} lines"
        for name, tree in mods.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > limit
    ]


def _is_import(line: str) -> bool:
    return line.lstrip().startswith(("import ", "from ")) and " import " in f" {line.strip()} "


def unexplained_function_imports(root: Path) -> list[str]:
    """Imports inside functions with no reason beside them: a comment on one of the imports of its block (the
    contiguous import lines around it) or on the line just above that block (a ``try:`` saying why, say)."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        tree = parse_python("\n".join(lines), str(path))
        nested = {
            sub.lineno
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            for sub in ast.walk(node)
            if isinstance(sub, ast.Import | ast.ImportFrom)
        }
        for line in sorted(nested):
            lo = hi = line - 1
            while lo > 0 and (_is_import(lines[lo - 1]) or not lines[lo - 1].strip()):
                lo -= 1
            while hi + 1 < len(lines) and (_is_import(lines[hi + 1]) or not lines[hi + 1].strip()):
                hi += 1
            block = [text for text in lines[lo : hi + 1] if _is_import(text)]
            above = lines[lo - 1].strip() if lo > 0 else ""
            if not any(" #" in text for text in block) and not (above.startswith("#") or " # " in above):
                problems.append(f"{path.relative_to(root.parent)}:{line} {lines[line - 1].strip()}")
    return problems


def plain_ast_parses(roots: list[Path], allowed: set[str]) -> list[str]:
    """Calls of ``ast.parse`` outside ``allowed`` (paths relative to the roots' parent): on CPython 3.11.0-3.11.7 a
    garbage collection during one can fail it (``nexa_dagster.core.common.python_source`` says how; it failed CI
    twice), so everything parses through ``parse_python``."""
    problems = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root.parent).as_posix()
            if rel in allowed:
                continue
            for node in ast.walk(parse_python(path.read_text(encoding="utf-8"), str(path))):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "parse"
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "ast"
                ):
                    problems.append(f"{rel}:{node.lineno} calls ast.parse (use parse_python)")
    return problems


def same_named_test_files(tests: Path) -> list[str]:
    """Test files that share a name: pytest imports a test file under its bare name (the test folders are not
    packages), so in a run that collects both, as ``make test`` does, the second fails the whole collection
    ("import file mismatch"); a run of one folder never shows it. It failed the suite's clean-clone run once
    (2026-12-07: ``test_engine_sampling.py`` in tests/unit/core/llm and tests/integration)."""
    by_name: dict[str, list[str]] = {}
    for path in sorted(tests.rglob("test_*.py")):
        by_name.setdefault(path.name, []).append(path.relative_to(tests).as_posix())
    return [f"{name}: {', '.join(paths)}" for name, paths in by_name.items() if len(paths) > 1]


@pytest.fixture(scope="module")
def package() -> dict[str, ast.Module]:
    return modules(PACKAGE)


def test_core_is_dagster_free_and_its_stages_import_only_downward(package) -> None:
    assert layering_violations(package) == []


def test_the_package_has_no_import_cycle(package) -> None:
    assert cycles(internal_graph(package)) == []


def test_only_the_settings_module_reads_the_environment(package) -> None:
    assert environment_reads(package) == []


def test_no_function_is_longer_than_a_screen(package) -> None:
    assert long_functions(package) == []


def test_every_function_level_import_says_why_it_is_there() -> None:
    assert unexplained_function_imports(PACKAGE) == []


def test_every_parse_of_python_source_goes_through_parse_python() -> None:
    assert plain_ast_parses(PYTHON_ROOTS, PLAIN_PARSE_ALLOWED) == []


def test_no_two_test_files_share_a_name(tmp_path: Path) -> None:
    assert same_named_test_files(REPO / "tests") == []
    for folder in ("unit", "integration"):  # the failing case
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "test_x.py").write_text("")
    assert same_named_test_files(tmp_path) == ["test_x.py: integration/test_x.py, unit/test_x.py"]


def test_core_holds_only_stage_folders() -> None:
    top = sorted(p.name for p in (PACKAGE / "core").iterdir() if not p.name.startswith((".", "__pycache__")))
    assert top == ["__init__.py", *sorted(STAGES)]


def test_each_rule_catches_a_tree_that_breaks_it(tmp_path: Path) -> None:
    """The failing case of every rule above, on a small package written for it."""
    pkg = tmp_path / "nexa_dagster"
    files = {
        "__init__.py": "",
        "settings.py": "import os\nX = os.environ.get('X')\n",
        "core/__init__.py": "",
        "core/common/__init__.py": "",
        "core/common/io.py": "import dagster as dg\nfrom nexa_dagster.core.training import loop\n",
        "core/training/__init__.py": "",
        "core/training/loop.py": "import os\nfrom nexa_dagster.core.training import data\nHOME = os.getenv('HOME')\n",
        "core/training/data.py": "def f():\n    from nexa_dagster.core.training import loop\n",
        "core/common/source.py": "import ast\nTREE = ast.parse('x = 1')\n",
        "core/training/lazy.py": "def g():\n    import torch  # seconds to import: only g needs it\n"
        + "def h():\n    x = 1\n"
        + "    x += 1\n" * (MAX_FUNCTION_LINES - 1),
    }
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    mods = modules(pkg)
    assert layering_violations(mods) == [
        "nexa_dagster.core.common.io:1 imports dagster (core is Dagster-free)",
        "nexa_dagster.core.common.io:2 imports nexa_dagster.core.training: stage common must not import the "
        "later stage training",
        "nexa_dagster.core.common.io:2 imports nexa_dagster.core.training.loop: stage common must not import the "
        "later stage training",
    ]
    assert cycles(internal_graph(mods)) == [
        ["nexa_dagster.core.training.data", "nexa_dagster.core.training.loop"]
    ]
    assert environment_reads(mods) == ["nexa_dagster.core.training.loop:3 reads os.getenv"]
    assert long_functions(mods) == [f"nexa_dagster.core.training.lazy:3 h has {MAX_FUNCTION_LINES + 1} lines"]
    assert unexplained_function_imports(pkg) == [
        "nexa_dagster/core/training/data.py:2 from nexa_dagster.core.training import loop"
    ]
    assert plain_ast_parses([pkg], set()) == [
        "nexa_dagster/core/common/source.py:2 calls ast.parse (use parse_python)"
    ]
    assert plain_ast_parses([pkg], {"nexa_dagster/core/common/source.py"}) == []
