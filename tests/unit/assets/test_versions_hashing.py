"""What a code version hashes (assets/versions.py), rule by rule, on a small package written for each test: which
definitions an asset reaches, what of a definition counts, what of the configuration counts, how the parts are
combined. ``test_code_versions.py`` checks the same rules on the real package (a minute on 2 cores); these run in
a second, so ``make mutation`` runs them for every mutant of versions.py (docs/testing.md, "Mutation testing")."""

from __future__ import annotations

import ast
import json
import os
from collections.abc import Callable
from pathlib import Path
from textwrap import dedent

import dagster as dg
import pytest
from pydantic import BaseModel

from nexa_dagster.assets import versions
from nexa_dagster.assets.ingest import raw_documents
from nexa_dagster.core.common.python_source import parse_python
from nexa_dagster.definitions import config_resources

# A package with one of each thing the reach follows. The asset functions live in nexa_dagster/assets_mod.py.
PACKAGE = {
    "__init__.py": "",
    "core/__init__.py": '"""The core."""\n',
    "core/base.py": '''
        """Backends."""

        import nexa_dagster.core.pkg.leaf
        import nexa_dagster.core.pkg.leaf as leaf_module
        import torch
        from os import path
        from torch.nn import Module

        from nexa_dagster.core import helpers
        from nexa_dagster.core.pkg.leaf import *

        LIMIT = 3
        CHOSEN, REJECTED = 0, 1
        [FIRST, *OTHERS] = [1, 2, 3]
        ALIAS = OTHER_ALIAS = "x"
        WIDTH: int = 8
        SLOT = {}
        SLOT["key"] = 1
        print("a statement that defines nothing")


        class Backend:
            """The abstract backend."""

            def run(self) -> int:
                return LIMIT


        def uses_helpers() -> int:
            """Reads one function of a module."""
            return helpers.fast()


        def uses_tuple() -> int:
            return CHOSEN + FIRST + len(OTHERS) + WIDTH


        def uses_alias() -> str:
            return OTHER_ALIAS


        def uses_libraries() -> str:
            from torch.nn import functional

            return path.join(Module, functional)
        ''',
    "core/local.py": """
        from nexa_dagster.core.base import Backend


        class LocalBackend(Backend):
            def run(self) -> int:
                return 1
        """,
    "core/helpers.py": """
        import tokenizers


        def fast() -> int:
            return 1


        def slow() -> int:
            return tokenizers.x()
        """,
    "core/pkg/__init__.py": """
        from nexa_dagster.core.pkg.leaf import LEAF as REEXPORTED


        def inner() -> int:
            from .leaf import LEAF

            return LEAF


        def outer() -> int:
            return REEXPORTED
        """,
    "core/pkg/leaf.py": "LEAF = 1\nUNUSED = 2\n",
    "core/pkg/sibling.py": """
        from . import leaf


        def nearby() -> int:
            from .leaf import UNUSED

            return UNUSED
        """,
    "core/cyc_a.py": "from nexa_dagster.core.cyc_b import X\n\n\ndef f():\n    return X\n",
    "core/cyc_b.py": "from nexa_dagster.core.cyc_a import X\n",
    "core/worker.py": "import sys\n\nSTEPS = 4\n\n\ndef main() -> int:\n    return STEPS\n\n\nprint(main())\n",
    "assets_mod.py": """
        import nexa_dagster.core.helpers as helpers_module
        from nexa_dagster.core import pkg
        from nexa_dagster.core.base import Backend, uses_helpers


        def backend_asset(backend: Backend) -> int:
            return backend.run()


        def helper_asset() -> int:
            return uses_helpers()


        def worker_asset() -> str:
            return "nexa_dagster.core.worker"


        def module_asset() -> int:
            return pkg.inner()


        def scale_asset(scale_preset) -> int:
            scale = scale_preset.load()
            return scale.preference.rank_by, scale.rl is None, len(scale_preset.load().max_docs_per_day), reads(scale)


        def reads(scale) -> int:
            return scale.training.max_steps


        def aliased_module_asset() -> int:
            return helpers_module.slow()


        def whole_import_asset() -> int:
            import nexa_dagster.core.helpers as imported

            return imported


        def submodule_asset() -> int:
            return pkg.leaf.UNUSED


        def local_import_asset() -> int:
            import transformers

            from nexa_dagster.core.pkg.sibling import nearby

            return nearby()
        """,
}


def _write(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / "nexa_dagster" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dedent(text).lstrip("\n"))
    return root


@pytest.fixture
def package(tmp_path: Path) -> Path:
    return _write(tmp_path / "src", PACKAGE)


def _reach(root: Path, module: str, name: str) -> versions.Reach:
    return versions.SourceTree(root).reach(f"nexa_dagster.{module}", name)


def _reached(root: Path, module: str, name: str) -> set[str]:
    return {key.removeprefix("nexa_dagster.") for key in _reach(root, module, name).sources}


@pytest.mark.parametrize(
    ("module", "name", "expected"),
    [
        # a class reaches its subclasses (the backend a resource is), and what they name
        (
            "assets_mod",
            "backend_asset",
            {"assets_mod:backend_asset", "core.base:Backend", "core.local:LocalBackend", "core.base:LIMIT"},
        ),
        # an attribute of an imported module is that definition, not the whole module
        (
            "assets_mod",
            "helper_asset",
            {"assets_mod:helper_asset", "core.base:uses_helpers", "core.helpers:fast"},
        ),
        # a module named in a string is reached whole: its other statements and each of its definitions
        (
            "assets_mod",
            "worker_asset",
            {"assets_mod:worker_asset", "core.worker:*", "core.worker:STEPS", "core.worker:main"},
        ),
        # a relative import inside a function of an __init__.py is relative to that package
        ("assets_mod", "module_asset", {"assets_mod:module_asset", "core.pkg:inner", "core.pkg.leaf:LEAF"}),
        # ... and inside a function of a plain module, relative to its parent
        (
            "assets_mod",
            "local_import_asset",
            {"assets_mod:local_import_asset", "core.pkg.sibling:nearby", "core.pkg.leaf:UNUSED"},
        ),
        # a module imported under another name: the attribute read of it; imported in a function: whole
        ("assets_mod", "aliased_module_asset", {"assets_mod:aliased_module_asset", "core.helpers:slow"}),
        (
            "assets_mod",
            "whole_import_asset",
            {"assets_mod:whole_import_asset", "core.helpers:*", "core.helpers:fast", "core.helpers:slow"},
        ),
        # a submodule read as an attribute of its package, not imported itself
        (
            "assets_mod",
            "submodule_asset",
            {"assets_mod:submodule_asset", "core.pkg.leaf:*", "core.pkg.leaf:LEAF", "core.pkg.leaf:UNUSED"},
        ),
        # a library name, and a cycle of re-exports, reach nothing (and end)
        ("core.base", "uses_libraries", {"core.base:uses_libraries"}),
        ("core.cyc_a", "f", {"core.cyc_a:f"}),
        # a re-export is followed to the definition
        ("core.pkg", "outer", {"core.pkg:outer", "core.pkg.leaf:LEAF"}),
        # tuple, starred, chained and annotated assignments define each name they bind
        (
            "core.base",
            "uses_tuple",
            {
                "core.base:uses_tuple",
                "core.base:CHOSEN",
                "core.base:REJECTED",  # CHOSEN's statement
                "core.base:FIRST",
                "core.base:OTHERS",
                "core.base:WIDTH",
            },
        ),
        ("core.base", "uses_alias", {"core.base:uses_alias", "core.base:OTHER_ALIAS", "core.base:ALIAS"}),
    ],
)
def test_what_a_definition_reaches(package: Path, module: str, name: str, expected: set[str]) -> None:
    assert _reached(package, module, name) == expected


def test_the_libraries_that_decide_bytes_are_those_reached(package: Path) -> None:
    assert _reach(package, "assets_mod", "helper_asset").libraries == set()  # fast() uses no library
    assert _reach(package, "core.helpers", "slow").libraries == {"tokenizers"}
    assert _reach(package, "assets_mod", "local_import_asset").libraries == {"transformers"}
    assert _reach(package, "core.base", "uses_helpers").libraries == set()  # torch is imported, not used here
    assert _reach(package, "assets_mod", "worker_asset").libraries == set()  # sys: not byte-deciding
    assert _reach(package, "core.base", "uses_libraries").libraries == {
        "torch"
    }  # torch.nn, top-level or inside
    _write(
        package,
        {"core/inside.py": "def g():\n    from torch.nn import functional\n\n    return functional\n"},
    )
    assert _reach(package, "core.inside", "g").libraries == {"torch"}
    _write(package, {"core/top.py": "from torch.nn import Module\n\n\ndef h():\n    return Module\n"})
    assert _reach(package, "core.top", "h").libraries == {"torch"}  # a name bound at the top to torch.nn's


def test_the_scale_reads_are_collected_along_the_reach(package: Path) -> None:
    reads = _reach(package, "assets_mod", "scale_asset").scale_reads
    assert reads == {
        "preference.rank_by",
        "rl?",
        "max_docs_per_day",
        "training.max_steps",
    }  # and what it calls


def test_a_subclass_is_recorded_once_per_base(package: Path) -> None:
    tree = versions.SourceTree(package)
    assert tree.subclasses == {
        ("nexa_dagster.core.base", "Backend"): {("nexa_dagster.core.local", "LocalBackend")}
    }


def test_the_module_table(package: Path) -> None:
    """What parsing keeps of a module: its definitions, what its imports bind, its other statements; and the
    package its relative imports are relative to."""
    tree = versions.SourceTree(package)
    base = tree.modules["nexa_dagster.core.base"]
    assert base.package == "nexa_dagster.core"
    assert tree.modules["nexa_dagster.core.pkg"].package == "nexa_dagster.core.pkg"
    assert tree.modules["nexa_dagster"].package == "nexa_dagster"
    assert set(base.definitions) == {
        "LIMIT", "CHOSEN", "REJECTED", "FIRST", "OTHERS", "ALIAS", "OTHER_ALIAS", "WIDTH", "SLOT",
        "Backend", "uses_helpers", "uses_tuple", "uses_alias", "uses_libraries",
    }  # fmt: skip
    assert base.definitions["CHOSEN"] is base.definitions["REJECTED"] or (
        base.definitions["CHOSEN"] == base.definitions["REJECTED"]
    )
    assert base.imports == {
        "nexa_dagster": ("nexa_dagster", None),  # import a.b binds a
        "leaf_module": ("nexa_dagster.core.pkg.leaf", None),  # import a.b as c binds c to a.b
        "torch": ("torch", None),
        "path": ("os", "path"),
        "Module": ("torch.nn", "Module"),
        "helpers": ("nexa_dagster.core", "helpers"),
    }  # a star import binds nothing it names
    assert tree.modules["nexa_dagster.core.pkg.sibling"].imports == {
        "leaf": ("nexa_dagster.core.pkg", "leaf")
    }
    assert [ast.unparse(s) for s in base.rest] == [
        "SLOT['key'] = 1",
        "print('a statement that defines nothing')",
    ]


def _edited(package: Path, relative: str, old: str, new: str) -> None:
    path = package / "nexa_dagster" / relative
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new, 1))


@pytest.mark.parametrize(
    ("relative", "old", "new", "counts"),
    [
        ("core/local.py", "return 1", "return 2", True),  # the subclass the resource is
        ("core/base.py", "LIMIT = 3", "LIMIT = 4", True),
        ("core/base.py", '"""The abstract backend."""', '"""The abstract backend, reworded."""', False),
        ("core/base.py", '"""Backends."""', '"""Backends, reworded."""', False),
        (
            "core/base.py",
            "    def run(self) -> int:\n        return LIMIT",
            "    def run(self) -> int:\n\n        return LIMIT  # why",
            False,
        ),
        ("core/base.py", "def uses_tuple", "def uses_tuple_renamed", False),  # not reached from the asset
    ],
)
def test_what_of_a_definition_counts(package: Path, relative: str, old: str, new: str, counts: bool) -> None:
    before = _reach(package, "assets_mod", "backend_asset").sources
    _edited(package, relative, old, new)
    after = _reach(package, "assets_mod", "backend_asset").sources
    assert (after != before) is counts


def test_a_function_docstring_alone_leaves_a_body(package: Path) -> None:
    """A function whose body is only its docstring still parses to a definition (``pass``), and counts as one."""
    _write(package, {"core/empty.py": 'def empty():\n    """Only a docstring."""\n'})
    source = _reach(package, "core.empty", "empty").sources["nexa_dagster.core.empty:empty"]
    assert "Pass()" in source and "Only a docstring" not in source


def test_the_module_statements_count_for_a_whole_module(package: Path) -> None:
    before = _reach(package, "assets_mod", "worker_asset").sources
    _edited(package, "core/worker.py", "print(main())", "print(main(), 1)")
    assert _reach(package, "assets_mod", "worker_asset").sources != before


# -- configuration -------------------------------------------------------------------------------------------------
class Named(BaseModel):
    name: str


class Policy(BaseModel):
    file: str = "promotion.yaml"
    level: float = 0.05
    missing: str = "no-such-file.yaml"
    weights: dict[str, float] = {"b": 1.0, "a": 2.0}
    where: Path = Path("/x")


@pytest.fixture
def configs(tmp_path: Path) -> Path:
    root = tmp_path / "configs"
    (root / "scales").mkdir(parents=True)
    (root / "models").mkdir()
    (root / "blends").mkdir()
    (root / "scales" / "small.yaml").write_text(
        "preference:\n  rank_by: reward\n  learning_rate: 0.001\nrl:\n  steps: 2\nmodel_preset: tiny\n"
        "max_docs_per_day: 5\nteacher:\n  since: 2026-01-02\n"
    )
    (root / "models" / "tiny.yaml").write_text("# a comment\nlayers: 2\nmerges: blends/merges.txt\n")
    (root / "blends" / "merges.txt").write_text("a b\n")
    (root / "promotion.yaml").write_text("level: 0.05\nblend: blends/sft.yaml\n")
    (root / "blends" / "sft.yaml").write_text("weights: blends/deeper.yaml\n")
    (root / "blends" / "deeper.yaml").write_text("x: 1\n")
    return root


def _json(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, default=str).encode()


def test_a_field_read_counts_the_field_and_a_presence_read_counts_whether_it_is_set(configs: Path) -> None:
    reader = versions.ConfigReader(configs, {"scale_preset": Named(name="small")})
    assert reader.scale_sections({"preference.rank_by", "rl?", "absent", "absent?", "model_preset?"}) == [
        ("scale.model_preset?", b"set"),
        ("scale.preference.rank_by", _json("reward")),
        ("scale.rl?", b"set"),
    ]
    assert reader.scale_sections({"teacher"}) == [("scale.teacher", b'{"since": "2026-01-02"}')]  # a date


def test_a_section_read_whole_counts_whole_with_the_file_it_names(configs: Path) -> None:
    reader = versions.ConfigReader(configs, {"scale_preset": Named(name="small")})
    # preference.settings is a method: the whole section; its field read is then in the whole
    assert reader.scale_sections(
        {"preference.settings", "preference.rank_by", "preference?", "model_preset"}
    ) == [
        ("scale.model_preset", _json("tiny")),
        ("models/tiny.yaml", _json({"layers": 2, "merges": "blends/merges.txt"})),
        ("blends/merges.txt", b"a b\n"),
        ("scale.preference", _json({"rank_by": "reward", "learning_rate": 0.001})),
    ]


def test_the_scale_preset_named_by_the_settings_without_a_resource(
    configs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NEXA_SCALE", "small")
    assert versions.ConfigReader(configs, {}).scale["max_docs_per_day"] == 5


def test_a_resource_counts_its_values_and_the_files_they_name(configs: Path) -> None:
    reader = versions.ConfigReader(configs, {"policy": Policy()})
    assert reader.resource("policy") == [
        ("promotion.yaml", _json({"level": 0.05, "blend": "blends/sft.yaml"})),
        ("blends/sft.yaml", _json({"weights": "blends/deeper.yaml"})),  # one level of files named, no deeper
        ("policy.level", _json(0.05)),
        ("policy.missing", _json("no-such-file.yaml")),
        (
            "policy.weights",
            b'{"a": 2.0, "b": 1.0}',
        ),  # keys sorted: the order they were written in does not count
        ("policy.where", b'"/x"'),
    ]


def test_a_folder_counts_every_file_in_it_and_nothing_outside_counts(configs: Path) -> None:
    reader = versions.ConfigReader(configs, {})
    assert [name for name, _ in reader.files("blends")] == [
        "blends/deeper.yaml",
        "blends/merges.txt",
        "blends/sft.yaml",
    ]
    assert (
        reader.files("") == [] and reader.files(".") == [] and reader.files("../configs/promotion.yaml") == []
    )
    assert reader.files("promotion.yaml", depth=0) == [
        ("promotion.yaml", _json({"level": 0.05, "blend": "blends/sft.yaml"}))
    ]


def test_a_yaml_comment_does_not_count_and_another_file_counts_as_bytes(configs: Path) -> None:
    model = configs / "models" / "tiny.yaml"
    before = versions._content(model)
    model.write_text(model.read_text() + "# another comment\n")
    assert versions._content(model) == before
    other = configs / "blends" / "merges.txt"
    other.write_text("a b\n# c\n")
    assert versions._content(other) == b"a b\n# c\n"
    short = configs / "short.yml"
    short.write_text("# a comment\nwhen: 2026-01-02\n")
    assert versions._content(short) == b'{"when": "2026-01-02"}'  # .yml too; a date as its text


def test_the_strings_a_yaml_value_names() -> None:
    assert list(versions._strings({"a": ["x", {"b": "y"}, 3], "c": "z"})) == ["x", "y", "z"]


# -- a code version ------------------------------------------------------------------------------------------------
def _asset(name: str, resources: set[str]) -> dg.AssetsDefinition:
    def compute(context):  # noqa: ARG001
        return None

    compute.__module__, compute.__name__ = "nexa_dagster.assets_mod", name
    return dg.asset(name=name, required_resource_keys=resources)(compute)


RESOURCES = {"scale_preset": Named(name="small"), "policy": Policy()}


def _versions(package: Path, configs: Path, assets: list) -> dict[str, str]:
    return versions.code_versions(assets, RESOURCES, package, configs)


def test_what_a_code_version_is_made_of(package: Path, configs: Path) -> None:
    parts: list[str] = []
    asset = _asset("scale_asset", {"scale_preset", "policy"})
    tree, reader = versions.SourceTree(package), versions.ConfigReader(configs, RESOURCES)
    version = versions.code_version_of(asset, tree, reader, parts)
    assert len(version) == 16 and int(version, 16) >= 0
    assert parts == [
        "source nexa_dagster.assets_mod:reads",
        "source nexa_dagster.assets_mod:scale_asset",
        "scale.max_docs_per_day",
        "scale.preference.rank_by",
        "scale.rl?",
        "promotion.yaml",
        "blends/sft.yaml",
        "policy.level",
        "policy.missing",
        "policy.weights",
        "policy.where",
    ]
    parts.clear()
    versions.code_version_of(_asset("local_import_asset", set()), tree, reader, parts)
    assert parts == [
        "source nexa_dagster.assets_mod:local_import_asset",
        "source nexa_dagster.core.pkg.leaf:UNUSED",
        "source nexa_dagster.core.pkg.sibling:nearby",
        "library transformers",
    ]


def test_each_part_moves_the_version_of_the_assets_it_is_part_of(
    package: Path, configs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assets = [
        _asset("scale_asset", {"scale_preset"}),
        _asset("helper_asset", {"policy"}),
        _asset("local_import_asset", set()),
        _asset("backend_asset", set()),
    ]
    base = _versions(package, configs, assets)
    assert len(set(base.values())) == 4

    def changed() -> set[str]:
        after = _versions(package, configs, assets)
        return {k for k in base if after[k] != base[k]}

    preset = configs / "scales" / "small.yaml"
    preset.write_text(preset.read_text().replace("rank_by: reward", "rank_by: judge"))
    assert changed() == {"scale_asset"}
    preset.write_text(preset.read_text().replace("rank_by: judge", "rank_by: reward"))
    (configs / "promotion.yaml").write_text("level: 0.1\nblend: blends/sft.yaml\n")
    assert changed() == {"helper_asset"}
    (configs / "promotion.yaml").write_text("level: 0.05\nblend: blends/sft.yaml\n")
    real = versions.library_version
    monkeypatch.setattr(versions, "library_version", lambda n: "9" if n == "transformers" else real(n))
    assert changed() == {"local_import_asset"}
    monkeypatch.setattr(versions, "library_version", real)
    _edited(package, "core/local.py", "return 1", "return 2")
    assert changed() == {"backend_asset"}


def test_a_part_is_framed_so_moving_bytes_between_parts_moves_the_version(
    package: Path, configs: Path
) -> None:
    """Two parts whose concatenation is the same (``ab`` + ``c``, ``a`` + ``bc``) give different versions: each
    part is hashed with its name and length."""
    asset = _asset("helper_asset", {"policy"})
    tree = versions.SourceTree(package)
    a = versions.code_version_of(asset, tree, versions.ConfigReader(configs, {"policy": Policy(level=0.1)}))
    b = versions.code_version_of(asset, tree, versions.ConfigReader(configs, {"policy": Policy(level=0.15)}))
    assert a != b


def test_an_external_asset_has_no_code_version(package: Path, configs: Path) -> None:
    external = dg.AssetSpec("production_model")  # as a spec, and as the definition Dagster makes of one
    assets = [_asset("helper_asset", set()), external, dg.AssetsDefinition(specs=[external])]
    assert set(_versions(package, configs, assets)) == {"helper_asset"}


def test_a_library_absent_is_named_absent() -> None:
    assert versions.library_version("torch") not in ("", "absent")
    versions.BYTE_DECIDING["__nexa_test__"] = "no-such-distribution-nexa"
    try:
        assert versions.library_version("__nexa_test__") == "absent"
    finally:
        del versions.BYTE_DECIDING["__nexa_test__"]


def test_relative_import_names() -> None:
    assert versions._absolute("m", 0, "a.b") == "m"
    assert versions._absolute("m", 1, "a.b") == "a.b.m"
    assert versions._absolute("m", 2, "a.b") == "a.m"
    assert versions._absolute("", 1, "a.b") == "a.b"
    assert versions._absolute("", 2, "a.b") == "a"


def test_the_code_location_gives_each_computed_asset_its_version_and_leaves_an_external_one(
    tmp_path: Path,
) -> None:
    """``with_code_versions`` (what ``build_defs`` calls) on the real package: the computed asset's spec carries
    the version ``code_versions`` derives, the external one none, and a non-asset passes through."""
    resources = config_resources()
    external = dg.AssetsDefinition(specs=[dg.AssetSpec("production_model")])
    spec = dg.AssetSpec("a_spec")
    out = versions.with_code_versions([raw_documents, external, spec], resources, tmp_path)
    assert out[2] is spec and len(out) == 3
    expected = versions.code_versions([raw_documents], resources)["raw_documents"]
    assert [s.code_version for s in out[0].specs] == [expected]
    assert [s.code_version for s in out[1].specs] == [None]


def test_what_a_preset_read_is_for_sections_of_every_shape() -> None:
    assert versions._as_read("training.max_steps") == "training.max_steps"  # a section that is always set
    assert versions._as_read("max_docs_per_day.real") == "max_docs_per_day"  # a plain value's attribute
    assert versions._as_read("no_such_section.field") == "no_such_section"
    code = "a = scale.rl is False\nb = scale_preset.load\n"
    reads = versions._scale_reads(list(ast.walk(parse_python(code, "<test>"))))
    assert reads == {"rl", "load"}  # not None: the value


# -- the versions remembered -----------------------------------------------------------------------------------------
def test_derived_versions_are_remembered_and_derived_again_after_any_edit_of_what_they_read(
    package: Path, configs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every process that loads the code location asks for the versions; they are derived once per state of the
    sources, the configuration, the libraries and the resources, and an edit of any of those derives them again."""
    cache, assets = tmp_path / "cache", [_asset("scale_asset", {"scale_preset", "policy"})]
    derived: list[int] = []
    derive = versions.code_versions

    def counted(*args: object) -> dict[str, str]:
        derived.append(1)
        return derive(*args)

    monkeypatch.setattr(versions, "code_versions", counted)

    def cached(resources: dict = RESOURCES, assets: list = assets) -> dict[str, str]:
        return versions.cached_code_versions(assets, resources, cache, package, configs)

    first = cached()
    assert first == derive(assets, RESOURCES, package, configs) and len(derived) == 1
    assert cached() == first and len(derived) == 1, "the same inputs derived twice"
    assert len(list(cache.glob("*.json"))) == 1

    def edited(what: str, edit: Callable[[], object], **inputs: object) -> None:
        before = len(derived)
        edit()
        cached(**inputs)
        assert len(derived) == before + 1, f"{what}: the remembered versions were used"

    leaf = package / "nexa_dagster" / "core" / "pkg" / "leaf.py"
    edited("a source's comment", lambda: leaf.write_text(leaf.read_text() + "# a comment\n"))
    edited("a new module", lambda: (package / "nexa_dagster" / "core" / "new.py").write_text("X = 1\n"))
    edited("a template", lambda: (configs / "blends" / "merges.txt").write_text("a c\n"))
    edited("a new config file", lambda: (configs / "extra.yaml").write_text("x: 2\n"))
    monkeypatch.setitem(versions.BYTE_DECIDING, "zz_lib", "no-such-distribution-here")
    edited("a byte-deciding library", lambda: None)
    monkeypatch.setenv("NEXA_SCALE", "some-other-preset")
    edited("the scale preset's name", lambda: None)
    other = {**RESOURCES, "policy": Policy(level=0.01)}
    edited("a resource's value", lambda: None, resources=other)
    more = [*assets, _asset("another", set())]
    edited("another asset", lambda: None, resources=other, assets=more)
    assert cached(resources=other, assets=more) == derive(more, other, package, configs)


def test_an_unreadable_entry_is_derived_again_and_a_changing_tree_is_not_remembered(
    package: Path, configs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, assets = tmp_path / "cache", [_asset("scale_asset", {"scale_preset", "policy"})]
    truth = versions.code_versions(assets, RESOURCES, package, configs)
    versions.cached_code_versions(assets, RESOURCES, cache, package, configs)
    (entry,) = cache.glob("*.json")
    for bad in ("{not json", '{"scale_asset": 3}', "[]"):
        entry.write_text(bad)
        assert versions.cached_code_versions(assets, RESOURCES, cache, package, configs) == truth, bad
        assert json.loads(entry.read_text()) == truth, f"{bad!r} left in the cache"

    # an edit while the versions are derived: they may describe either state, so they are not remembered
    entry.unlink()
    derive = versions.code_versions
    leaf = package / "nexa_dagster" / "core" / "pkg" / "leaf.py"

    def racing(*args: object) -> dict[str, str]:
        out = derive(*args)
        leaf.write_text(leaf.read_text() + "X_RACE = 1\n")
        return out

    monkeypatch.setattr(versions, "code_versions", racing)
    versions.cached_code_versions(assets, RESOURCES, cache, package, configs)
    assert list(cache.glob("*.json")) == []


def test_the_cache_keeps_its_newest_entries(
    package: Path, configs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, assets = tmp_path / "cache", [_asset("scale_asset", {"scale_preset", "policy"})]
    monkeypatch.setattr(versions, "CACHE_ENTRIES_KEPT", 2)
    written = []
    for level in (0.1, 0.2, 0.3):
        resources = {**RESOURCES, "policy": Policy(level=level)}
        versions.cached_code_versions(assets, resources, cache, package, configs)
        (newest,) = set(cache.glob("*.json")) - set(written)
        written.append(newest)
        os.utime(newest, (1_000_000 + level * 10, 1_000_000 + level * 10))  # mtimes apart on any clock
    assert sorted(cache.glob("*.json")) == sorted(written[1:])


def _same_function_as(name: str) -> dg.AssetsDefinition:
    """An asset named ``name`` computed by one shared function (a factory's assets: only the key differs)."""

    def shared(context):  # noqa: ARG001
        return None

    shared.__module__ = "nexa_dagster.assets_mod"
    return dg.asset(name=name, required_resource_keys={"policy"})(shared)


def test_remembered_versions_are_those_of_the_same_assets(
    package: Path, configs: Path, tmp_path: Path
) -> None:
    """A renamed asset (a factory's, its function unchanged) or another set of assets is another entry: the
    versions asked for are the ones given back."""
    cache = tmp_path / "cache"
    one = versions.cached_code_versions([_same_function_as("one")], RESOURCES, cache, package, configs)
    two = versions.cached_code_versions([_same_function_as("two")], RESOURCES, cache, package, configs)
    assert set(one) == {"one"} and set(two) == {"two"}
    assert len(list(cache.glob("*.json"))) == 2


def test_a_renamed_file_or_library_swap_is_another_state_of_the_inputs(
    package: Path, configs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The digest frames each part with its name: the same bytes under another file name, or two libraries'
    versions exchanged, are other inputs (a moved module is imported by another name)."""

    def digest() -> str:
        return versions.inputs_digest([], RESOURCES, package, configs)

    module, config = package / "nexa_dagster" / "core" / "moved_a.py", configs / "moved_a.yaml"
    module.write_text("X = 1\n")
    config.write_text("x: 1\n")
    before = digest()
    module.rename(module.with_name("moved_b.py"))
    after_module = digest()
    config.rename(config.with_name("moved_b.yaml"))
    assert len({before, after_module, digest()}) == 3

    monkeypatch.setattr(versions, "BYTE_DECIDING", {"lib_a": "a", "lib_b": "b"})
    monkeypatch.setattr(versions, "library_version", {"lib_a": "1.0", "lib_b": "2.0"}.__getitem__)
    first = digest()
    monkeypatch.setattr(versions, "library_version", {"lib_a": "2.0", "lib_b": "1.0"}.__getitem__)
    assert digest() != first


def test_a_resource_value_given_in_another_key_order_is_the_same_entry(
    package: Path, configs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, assets = tmp_path / "cache", [_asset("scale_asset", {"scale_preset", "policy"})]
    derived: list[int] = []
    derive = versions.code_versions
    monkeypatch.setattr(versions, "code_versions", lambda *a: derived.append(1) or derive(*a))
    reordered = {**RESOURCES, "policy": Policy(weights={"a": 2.0, "b": 1.0})}
    first = versions.cached_code_versions(assets, RESOURCES, cache, package, configs)
    assert versions.cached_code_versions(assets, reordered, cache, package, configs) == first
    assert len(derived) == 1


def test_by_default_the_versions_are_remembered_in_the_machines_cache(
    package: Path, configs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NEXA_CACHE_DIR", str(tmp_path / "machine-cache"))
    assets = [_asset("scale_asset", {"scale_preset", "policy"})]
    versions.cached_code_versions(assets, RESOURCES, None, package, configs)
    assert len(list((tmp_path / "machine-cache" / "code-versions").glob("*.json"))) == 1

    given: list[object] = []
    monkeypatch.setattr(
        versions, "cached_code_versions", lambda a, r, cache_dir: given.append(cache_dir) or {}
    )
    versions.with_code_versions(assets, RESOURCES, cache_dir=tmp_path / "elsewhere")
    assert given == [tmp_path / "elsewhere"]


def test_a_cache_that_cannot_be_written_costs_only_the_derivation(
    package: Path, configs: Path, tmp_path: Path
) -> None:
    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("a file where the cache folder would be\n")
    assets = [_asset("scale_asset", {"scale_preset", "policy"})]
    got = versions.cached_code_versions(assets, RESOURCES, not_a_folder, package, configs)
    assert got == versions.code_versions(assets, RESOURCES, package, configs)


def test_the_oldest_entries_go_whatever_their_names(
    package: Path, configs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, assets = tmp_path / "cache", [_asset("scale_asset", {"scale_preset", "policy"})]
    cache.mkdir()
    monkeypatch.setattr(versions, "CACHE_ENTRIES_KEPT", 2)
    newer, older = cache / "00000000.json", cache / "ffffffff.json"
    for entry, mtime in ((newer, 2_000_000), (older, 1_000_000)):
        entry.write_text("{}")
        os.utime(entry, (mtime, mtime))
    versions.cached_code_versions(assets, RESOURCES, cache, package, configs)
    kept = {p.name for p in cache.glob("*.json")}
    assert newer.name in kept and older.name not in kept and len(kept) == 2
