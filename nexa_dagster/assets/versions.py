"""Every asset's ``code_version``, derived from the code and configuration that decide its output, never a hand list.

An asset's code version is 16 hex characters of a SHA-256 over three things, each found from the code itself when
the code location loads (``with_code_versions`` in ``build_defs``):

* **The source of every ``nexa_dagster`` module its computation reaches**: the module that defines the asset
  function and, transitively, every package module it imports (``import``/``from ... import``, relative ones too, at
  any depth in the file), read with ``ast`` from the files, plus the modules a worker command names as a string
  (``"nexa_dagster.core.training.worker"``: the process the asset launches runs it). Each module counts as its
  syntax tree with docstrings removed (``ast.dump``): **comments, docstrings, blank lines and formatting do not
  count**; any other edit does. The graph is of modules, not functions: an edit anywhere in a reached module counts,
  also in a function this asset never calls (an over-approximation: a false "stale", never a missed one).
* **The configuration it reads**: of the scale preset (``NEXA_SCALE``'s ``configs/scales/<name>.yaml``), only the
  top-level **sections** the asset's module reads (``scale.preference``, ``scale_preset.deepspeed_config()``: an
  attribute of ``scale``/``scale_preset`` named like a section), with the file a section names (``model_preset`` ->
  ``models/<name>.yaml``, ``deepspeed_config`` -> ``deepspeed/<file>``); of the configuration resources
  (``config_resources()``: promotion policy, packaging, sample gate, prompts, ingest, eval sets), those the asset
  requires: their field values, a value naming a file under ``configs/`` hashed as that file's bytes (and the
  files that file names in turn: ``packaging.yaml`` -> ``blends/sft.yaml``).
* **The versions of the libraries that decide its bytes** (``BYTE_DECIDING``: tokenizers, torch, transformers,
  deepspeed), those that a reached module imports.

Dagster then shows the asset stale ("has a new code version") until it is materialized again; what it feeds goes
stale once that materialization gives a new data version. A run launched with another scale preset or another
configuration file in its run config is not what the code version describes.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import dagster as dg
import yaml

from nexa_dagster import settings
from nexa_dagster.core.common.config import config_dir

PACKAGE = "nexa_dagster"
SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding nexa_dagster/

# import name -> distribution: the libraries whose version changes what an asset writes (a tokenizer's merges,
# a kernel's numerics, DeepSpeed's checkpoint layout). Others (dagster, pandas, pyarrow) write the same bytes.
BYTE_DECIDING = {"tokenizers": "tokenizers", "torch": "torch", "transformers": "transformers", "deepspeed": "deepspeed"}
SCALE_RECEIVERS = {"scale", "scale_preset"}  # how asset modules name the preset (ScaleResource and its load())
SCALE_RESOURCE = "scale_preset"
NAMED_FILES = {"model_preset": "models/{}.yaml", "deepspeed_config": "deepspeed/{}"}  # a section naming a file


def _without_docstrings(tree: ast.AST) -> ast.AST:
    """``tree`` with every module, class and function docstring removed (in place)."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return tree


@dataclass(frozen=True)
class Module:
    """One parsed package module: what counts of its source, the package modules and libraries it imports, and
    the scale-preset attributes it reads."""

    name: str
    source: str  # ast.dump without docstrings: comments and formatting do not count
    imports: frozenset[str]
    libraries: frozenset[str]
    scale_reads: frozenset[str]


class SourceTree:
    """The ``nexa_dagster`` package's sources under ``root`` (the folder holding ``nexa_dagster/``), parsed once."""

    def __init__(self, root: Path = SOURCE_ROOT) -> None:
        self.root = root
        self._modules: dict[str, Module] = {}
        self._paths: dict[str, Path | None] = {}

    def path(self, name: str) -> Path | None:
        """The file of module ``name`` in this tree; None: not a module of it."""
        if name not in self._paths:
            base = self.root.joinpath(*name.split("."))
            found = [c for c in (base / "__init__.py", base.with_suffix(".py")) if c.is_file()]
            self._paths[name] = found[0] if found else None
        return self._paths[name]

    def module(self, name: str) -> Module:
        if name not in self._modules:
            self._modules[name] = self._parse(name)
        return self._modules[name]

    def _parse(self, name: str) -> Module:
        path = self.path(name)
        if path is None:
            raise ModuleNotFoundError(f"{name}: no such module under {self.root}")
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imports, libraries, scale_reads = set(), set(), set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    self._add_import(alias.name, imports, libraries)
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node.module or "", node.level, package)
                self._add_import(base, imports, libraries)
                imports.update(m for a in node.names if self.path(m := f"{base}.{a.name}"))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value.startswith(f"{PACKAGE}.") and self.path(node.value):
                    imports.add(node.value)  # a worker command: ``python -m nexa_dagster.core.training.worker``
            elif isinstance(node, ast.Attribute) and _reads_the_preset(node.value):
                scale_reads.add(node.attr)
        return Module(
            name=name,
            source=ast.dump(_without_docstrings(tree)),
            imports=frozenset(self._with_parents(imports)),
            libraries=frozenset(libraries),
            scale_reads=frozenset(scale_reads),
        )

    def _add_import(self, name: str, imports: set[str], libraries: set[str]) -> None:
        top = name.partition(".")[0]
        if top == PACKAGE:
            imports.add(name)
        elif top in BYTE_DECIDING:
            libraries.add(top)

    def _with_parents(self, names: Iterable[str]) -> set[str]:
        """Every name and the packages above it (importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__``),
        those that are modules of this tree."""
        out = set()
        for name in names:
            parts = name.split(".")
            out.update(p for i in range(1, len(parts) + 1) if self.path(p := ".".join(parts[:i])))
        return out

    def closure(self, name: str) -> list[str]:
        """``name`` and every package module it reaches through imports, transitively, sorted."""
        seen: set[str] = set()
        todo = [name, *self._with_parents([name])]
        while todo:
            current = todo.pop()
            if current not in seen:
                seen.add(current)
                todo.extend(self.module(current).imports - seen)
        return sorted(seen)


def _reads_the_preset(node: ast.expr) -> bool:
    """``scale``, ``scale_preset`` or ``scale_preset.load()``: what an attribute of the preset is read on."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load":
        node = node.func.value
    return isinstance(node, ast.Name) and node.id in SCALE_RECEIVERS


def _absolute(module: str, level: int, package: str) -> str:
    """The absolute name of ``from <level dots><module> import ...`` written in ``package``."""
    if not level:
        return module
    parts = package.split(".")
    parts = parts[: len(parts) - (level - 1)]
    return ".".join([*parts, module] if module else parts)


def library_version(import_name: str) -> str:
    try:
        return importlib.metadata.version(BYTE_DECIDING[import_name])
    except importlib.metadata.PackageNotFoundError:
        return "absent"


@dataclass
class ConfigReader:
    """The configuration an asset reads, as (name, bytes) pairs, from the files under ``root``."""

    root: Path
    resources: Mapping[str, Any]

    @cached_property
    def scale(self) -> dict[str, Any]:
        resource = self.resources.get(SCALE_RESOURCE)
        name = resource.name if resource is not None else settings.SCALE.get()
        return yaml.safe_load((self.root / "scales" / f"{name}.yaml").read_text()) or {}

    def scale_sections(self, reads: Iterable[str]) -> list[tuple[str, bytes]]:
        """The preset's sections among ``reads`` (attribute names read on the preset), and the files they name."""
        out = []
        for section in sorted(set(reads) & set(self.scale)):
            value = self.scale[section]
            out.append((f"scale.{section}", json.dumps(value, sort_keys=True, default=str).encode()))
            if section in NAMED_FILES:
                out += self.files(NAMED_FILES[section].format(value))
        return out

    def resource(self, key: str) -> list[tuple[str, bytes]]:
        """A configuration resource's field values; one naming a file under configs/ counts as the file's bytes."""
        resource = self.resources[key]
        out = []
        for field in sorted(type(resource).model_fields):
            value = getattr(resource, field)
            named = self.files(value) if isinstance(value, str) else []
            out += named or [(f"{key}.{field}", json.dumps(value, sort_keys=True, default=str).encode())]
        return out

    def files(self, relative: str, depth: int = 1) -> list[tuple[str, bytes]]:
        """The bytes of ``relative`` under root (every file of a folder), and of the files a YAML file names
        (``depth`` levels); [] when it names nothing there."""
        path = self.root / relative
        if not relative or ".." in Path(relative).parts or not path.exists() or path == self.root:
            return []
        paths = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        out = [(p.relative_to(self.root).as_posix(), p.read_bytes()) for p in paths]
        if depth and path.suffix == ".yaml":
            for value in _strings(yaml.safe_load(path.read_text()) or {}):
                out += self.files(value, depth - 1)
        return out


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def asset_module(asset: dg.AssetsDefinition) -> str:
    """The module that defines ``asset``'s function."""
    fn = asset.op.compute_fn
    return getattr(fn, "decorated_fn", fn).__module__


def code_version_of(
    asset: dg.AssetsDefinition, tree: SourceTree, config: ConfigReader, parts: list[str] | None = None
) -> str:
    """``asset``'s code version; ``parts``, when given, receives the names of what was hashed (for the docs)."""
    digest = hashlib.sha256()
    own = asset_module(asset)

    def add(name: str, data: bytes) -> None:
        digest.update(f"{name}:{len(data)}\n".encode())
        digest.update(data)
        if parts is not None:
            parts.append(name)

    libraries: set[str] = set()
    for name in tree.closure(own):
        module = tree.module(name)
        add(f"module {name}", module.source.encode())
        libraries |= module.libraries
    for library in sorted(libraries):
        add(f"library {BYTE_DECIDING[library]}", library_version(library).encode())
    if SCALE_RESOURCE in asset.required_resource_keys:
        for name, data in config.scale_sections(tree.module(own).scale_reads):
            add(name, data)
    for key in sorted(asset.required_resource_keys & (config.resources.keys() - {SCALE_RESOURCE})):
        for name, data in config.resource(key):
            add(name, data)
    return digest.hexdigest()[:16]


def code_versions(
    assets: Iterable[Any],
    resources: Mapping[str, Any],
    source_root: Path = SOURCE_ROOT,
    configs: Path | None = None,
) -> dict[str, str]:
    """The code version of every asset key of ``assets`` (read from the sources under ``source_root`` and the
    configuration under ``configs``, default the configured one); ``resources``: the configuration resources."""
    tree, reader = SourceTree(source_root), ConfigReader(configs or config_dir(), resources)
    out = {}
    for asset in assets:
        if isinstance(asset, dg.AssetsDefinition) and asset.is_executable:  # not production_model (external)
            version = code_version_of(asset, tree, reader)
            out.update({key.to_user_string(): version for key in asset.keys})
    return out


def with_code_versions(assets: Iterable[Any], resources: Mapping[str, Any]) -> list[Any]:
    """The assets, each spec given its derived ``code_version`` (``resources``: the configuration resources)."""
    assets = list(assets)
    versions = code_versions(assets, resources)

    def versioned(spec: dg.AssetSpec) -> dg.AssetSpec:
        version = versions.get(spec.key.to_user_string())
        return spec if version is None else spec.replace_attributes(code_version=version)

    return [a.map_asset_specs(versioned) if isinstance(a, dg.AssetsDefinition) else a for a in assets]
