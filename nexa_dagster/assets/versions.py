"""Every asset's ``code_version``, derived from the code and configuration that decide its output, never a hand list.

An asset's code version is 16 hex characters of a SHA-256 over three things, each found from the sources when the
code location loads (``with_code_versions`` in ``build_defs``), so an asset added in any module of
``ASSET_MODULES`` (the RL stage's included) gets one with nothing to list:

* **The source of every ``nexa_dagster`` definition its computation reaches**, read with ``ast`` from the files: the
  asset function, then every top-level function, class or constant it names, transitively, through the module's
  own names, its imports (relative ones and re-exports followed), attributes of an imported module (``io.exists``),
  imports inside a function, the subclasses of a class it names (the resource it is given is one of them), and a
  module named in a string, whole (the worker a resource launches: ``"nexa_dagster.core.training.worker"``). Each
  definition counts as its syntax tree with docstrings removed (``ast.dump``): **comments, docstrings, blank lines
  and formatting do not count**; any other edit does. A class counts whole: an edit of a method its asset never
  calls still counts (a false "stale", never a missed one: ``GPUClusterResource`` launches both workers, so a
  training-loop edit also marks the packaging and evaluation assets that are given it).
* **The configuration it reads**: of the scale preset (``NEXA_SCALE``'s ``configs/scales/<name>.yaml``) only the
  parts its definitions read (an attribute of ``scale``, ``scale_preset`` or ``scale_preset.load()`` named like a
  section): a **field** of a section where the code reads only that field (``scale.preference.rank_by``), whether
  a section is set where it only tests that (``scale.preference is None``), else the whole **section**
  (``settings = scale.preference``: what the code does with it is not followed), with the file a section names
  (``model_preset`` -> ``models/<name>.yaml``, ``deepspeed_config`` -> ``deepspeed/<file>``); of the configuration
  resources (``config_resources()``: promotion policy, packaging, sample gate, prompts, ingest, eval sets) those the
  asset requires: their field values, a value naming a file under ``configs/`` counted as that file (and the files
  that file names: ``packaging.yaml`` -> ``blends/sft.yaml``). A YAML file counts as its parsed values (its
  comments do not), any other file as its bytes.
* **The versions of the libraries that decide its bytes** (``BYTE_DECIDING``: tokenizers, torch, transformers,
  deepspeed) that its definitions use.

The versions are a pure function of those inputs, and deriving them parses every module of the package (seconds
of CPU), which every process that loads the code location would pay: the code server, each run worker and each
step's subprocess. ``with_code_versions`` therefore remembers them in this machine's cache
(``cached_code_versions``), under a digest of every input the derivation reads: each ``.py`` file of the package
(this file included, so a change of the rules is a new digest), each file under ``configs/``, the byte-deciding
libraries' versions, the scale preset's name, the configuration resources' values and the assets' keys, functions
and resources. An edit of any of them is a new entry; a missing or unreadable entry is derived again.

Dagster then shows the asset stale ("has a new code version") until it is materialized again; what it feeds goes
stale once that materialization gives a new data version. A run launched with another scale preset or another
configuration file in its run config is not what the code version describes.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib.metadata
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import dagster as dg

from nexa_dagster import settings
from nexa_dagster.core.common import storage
from nexa_dagster.core.common.config import ScalePreset, config_dir, parse_yaml
from nexa_dagster.core.common.python_source import parse_python

PACKAGE = "nexa_dagster"
SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding nexa_dagster/

# import name -> distribution: the libraries whose version changes what an asset writes (a tokenizer's merges,
# a kernel's numerics, DeepSpeed's checkpoint layout). Others (dagster, pandas, pyarrow) write the same bytes.
BYTE_DECIDING = {
    "tokenizers": "tokenizers",
    "torch": "torch",
    "transformers": "transformers",
    "deepspeed": "deepspeed",
}
SCALE_RECEIVERS = {
    "scale",
    "scale_preset",
}  # how asset modules name the preset (ScaleResource and its load())
SCALE_RESOURCE = "scale_preset"
NAMED_FILES = {
    "model_preset": "models/{}.yaml",
    "deepspeed_config": "deepspeed/{}",
}  # a section naming a file


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


Symbol = tuple[str, str]  # (module, top-level name); name "*": the whole module
WHOLE = "*"


@dataclass
class Module:
    """One parsed package module: its top-level definitions (name -> statements), what its top-level imports bind
    (local name -> (module, attribute or None)), and its other top-level statements. ``package``: what its
    relative imports are relative to (the module itself for an ``__init__.py``, else its parent)."""

    name: str
    package: str
    definitions: dict[str, list[ast.stmt]]
    imports: dict[str, tuple[str, str | None]]
    rest: list[ast.stmt]


@dataclass
class Reach:
    """What one asset's computation reaches: the definitions' sources, the byte-deciding libraries they use, the
    attributes they read on the scale preset."""

    sources: dict[str, str] = field(default_factory=dict)  # "module:name" -> ast.dump without docstrings
    libraries: set[str] = field(default_factory=set)
    scale_reads: set[str] = field(default_factory=set)


class SourceTree:
    """The ``nexa_dagster`` package's sources under ``root`` (the folder holding ``nexa_dagster/``), parsed once,
    as a graph of top-level definitions: a function, class or constant reaches every definition its body names,
    through the module's own names, its imports (re-exports followed), attributes of an imported module
    (``io.exists``), imports inside the body, and module names in strings (a worker's ``python -m``); a class
    reaches its subclasses in the package (the resource an asset is given is one of them)."""

    def __init__(self, root: Path = SOURCE_ROOT) -> None:
        self.root = root
        self.modules = {m.name: m for m in map(self._parse, sorted((root / PACKAGE).rglob("*.py")))}
        self.subclasses: dict[Symbol, set[Symbol]] = {}
        self._symbols: dict[Symbol, tuple[str, list[Symbol], set[str], set[str]]] = {}
        for module in self.modules.values():
            for name, statements in module.definitions.items():
                for base in (b for s in statements if isinstance(s, ast.ClassDef) for b in s.bases):
                    for parent in self._names(module, ast.walk(base)):
                        self.subclasses.setdefault(parent, set()).add((module.name, name))

    def _parse(self, path: Path) -> Module:
        key = (path.relative_to(self.root).as_posix(), path.read_text(encoding="utf-8"))
        if key not in _PARSED:
            if len(_PARSED) >= PARSED_KEPT:
                _PARSED.clear()
            _PARSED[key] = _module(*key, where=str(path))
        return _PARSED[key]

    def _resolve(self, module: str, name: str, seen: frozenset[Symbol] = frozenset()) -> Symbol | None:
        """The definition ``name`` of ``module`` is (through imports and re-exports), or a module; None: outside
        the package (a library, a builtin)."""
        if (module, name) in seen or module not in self.modules:
            return None
        table = self.modules[module]
        if name in table.definitions:
            return module, name
        if name in table.imports:
            target, attribute = table.imports[name]
            if attribute is None:
                return (target, WHOLE) if target in self.modules else None
            if f"{target}.{attribute}" in self.modules:
                return f"{target}.{attribute}", WHOLE
            return self._resolve(target, attribute, seen | {(module, name)})
        return (f"{module}.{name}", WHOLE) if f"{module}.{name}" in self.modules else None

    def _names(self, module: Module, nodes: Iterable[ast.AST]) -> list[Symbol]:
        """The package definitions ``nodes`` (a statement's, walked) name, read in ``module``."""
        nodes = list(nodes)  # read twice below: a generator (``ast.walk``) would be spent by the first loop
        out, module_attributes = [], set()
        for sub in nodes:
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name):
                owner = self._resolve(module.name, sub.value.id)
                # io.exists: that attribute of an imported module, not all of it
                if owner and owner[1] == WHOLE:
                    out.append(self._resolve(owner[0], sub.attr))
                    module_attributes.add(id(sub.value))
        for sub in nodes:
            if isinstance(sub, ast.Name) and id(sub) not in module_attributes:
                out.append(self._resolve(module.name, sub.id))
            if isinstance(sub, ast.Import | ast.ImportFrom):  # an import inside a function
                for target, attribute in _bindings(sub, module.package).values():
                    out.append(self._resolve(target, attribute) if attribute else (target, WHOLE))
            elif isinstance(sub, ast.Constant) and isinstance(sub.value, str) and sub.value in self.modules:
                # a worker command: ``python -m nexa_dagster.core.training.worker``
                out.append((sub.value, WHOLE))
        return [s for s in out if s is not None and s[0] in self.modules]

    def _symbol(self, symbol: Symbol) -> tuple[str, list[Symbol], set[str], set[str]]:
        """One definition's source, the definitions it names, its libraries and preset reads (computed once)."""
        if symbol not in self._symbols:
            table = self.modules[symbol[0]]
            if symbol[1] == WHOLE:  # its other statements here; each definition is a symbol of its own
                statements = table.rest
                edges = [(symbol[0], n) for n in table.definitions]
            else:
                statements = table.definitions.get(symbol[1], [])
                edges = sorted(self.subclasses.get(symbol, ()))
            nodes = [n for statement in statements for n in ast.walk(statement)]
            edges += self._names(table, nodes)
            source = "\n".join(ast.dump(s) for s in statements)
            libraries, scale_reads = _libraries(table, nodes), _scale_reads(nodes)
            self._symbols[symbol] = (source, edges, libraries, scale_reads)
        return self._symbols[symbol]

    def reach(self, module: str, name: str) -> Reach:
        """Everything the definition ``name`` of ``module`` reaches, transitively."""
        reach, todo, seen = Reach(), [(module, name)], set()
        while todo:
            symbol = todo.pop()
            if symbol not in seen:
                seen.add(symbol)
                source, edges, libraries, scale_reads = self._symbol(symbol)
                reach.sources[f"{symbol[0]}:{symbol[1]}"] = source
                reach.libraries |= libraries
                reach.scale_reads |= scale_reads
                todo += edges
        return reach


# Parsed modules by (path under the source root, source): a process that derives the versions of many edited copies
# of the package (the code-version tests, `make mutation`) parses each unchanged file once, not once per copy (about
# a second of CPU for the whole package). A Module is never changed once built, so the copies share it.
_PARSED: dict[tuple[str, str], Module] = {}
PARSED_KEPT = 4096  # ~20 copies' worth of files; past it the memory starts again from nothing


def _module(relative: str, text: str, where: str) -> Module:
    """The module at ``relative`` (a path under the source root) whose source is ``text`` (``where``: the file, for
    a syntax error's message)."""
    parts = Path(relative).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    package = name if parts[-1] == "__init__" else name.rpartition(".")[0]
    tree = _without_docstrings(parse_python(text, where))
    module = Module(name, package, {}, {}, [])
    for statement in tree.body:
        targets = _defined_names(statement)
        for target in targets:
            module.definitions.setdefault(target, []).append(statement)
        if isinstance(statement, ast.Import | ast.ImportFrom):
            module.imports.update(_bindings(statement, package))
        elif not targets:
            module.rest.append(statement)
    return module


def _defined_names(statement: ast.stmt) -> list[str]:
    if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [statement.name]
    if isinstance(statement, ast.Assign):  # ``a = b = 1`` and ``CHOSEN, REJECTED = 0, 1`` alike
        return [name for target in statement.targets for name in _target_names(target)]
    if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
        return [statement.target.id]
    return []


def _target_names(target: ast.expr) -> list[str]:
    """The names an assignment target binds: ``a``, each of ``a, (b, *c)``; none for ``x.y`` or ``x[0]``."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Starred):
        return _target_names(target.value)
    if isinstance(target, ast.Tuple | ast.List):
        return [name for element in target.elts for name in _target_names(element)]
    return []


def _bindings(statement: ast.Import | ast.ImportFrom, package: str) -> dict[str, tuple[str, str | None]]:
    """What an import binds: local name -> (module, attribute) (``from m import a``) or (module, None)."""
    if isinstance(statement, ast.Import):
        return {
            (a.asname or a.name.partition(".")[0]): ((a.name if a.asname else a.name.partition(".")[0]), None)
            for a in statement.names
        }
    base = _absolute(statement.module or "", statement.level, package)
    return {(a.asname or a.name): (base, a.name) for a in statement.names if a.name != "*"}


def _libraries(module: Module, nodes: list[ast.AST]) -> set[str]:
    """The byte-deciding libraries a statement (``nodes``: walked) uses: names bound to them, or imported in it."""
    names = {n.id for n in nodes if isinstance(n, ast.Name)}
    used = {module.imports[n][0].partition(".")[0] for n in names if n in module.imports}
    for sub in nodes:
        if isinstance(sub, ast.Import | ast.ImportFrom):
            used |= {target.partition(".")[0] for target, _ in _bindings(sub, "").values()}
    return used & BYTE_DECIDING.keys()


def _scale_reads(nodes: list[ast.AST]) -> set[str]:
    """What a statement (``nodes``: walked) reads of the scale preset: ``section.field`` where it reads a section
    only for a field of it (``scale.preference.rank_by``), ``section?`` where only for whether it is set
    (``scale.preference is None``), ``section`` where it takes the section whole (passed on, assigned, iterated:
    then every field counts). Fields, so a DPO learning rate does not mark an asset that reads only the
    preference stage's ranking; whole where the code's use cannot be followed (a false "stale", never a missed
    one)."""
    parents = {id(child): node for node in nodes for child in ast.iter_child_nodes(node)}
    reads = set()
    for node in nodes:
        if not (isinstance(node, ast.Attribute) and _reads_the_preset(node.value)):
            continue
        parent = parents.get(id(node))
        if isinstance(parent, ast.Call) and parent.func is node and node.attr == "load":
            continue  # scale_preset.load(): what is read is read on its result
        if isinstance(parent, ast.Attribute) and parent.value is node:
            reads.add(f"{node.attr}.{parent.attr}")
        elif _is_none_test(parent, node):
            reads.add(f"{node.attr}?")
        else:
            reads.add(node.attr)
    return reads


def _is_none_test(parent: ast.AST | None, node: ast.expr) -> bool:
    """``node is None`` or ``node is not None``: a read of whether a section is set, not of its values."""
    return (
        isinstance(parent, ast.Compare)
        and parent.left is node
        and all(isinstance(op, ast.Is | ast.IsNot) for op in parent.ops)
        and all(isinstance(c, ast.Constant) and c.value is None for c in parent.comparators)
    )


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
        return parse_yaml((self.root / "scales" / f"{name}.yaml").read_text()) or {}

    def scale_sections(self, reads: Iterable[str]) -> list[tuple[str, bytes]]:
        """What of the preset ``reads`` names (``_scale_reads``: a section whole, one field of it, or whether it
        is set), with the files a whole section names; a field or presence read of a section also read whole is
        in the whole. A section or field the file does not set counts as absent (its default is in the source)."""
        reads = {_as_read(r) for r in reads}
        out = []
        for read in sorted(reads):
            section, _, key = read.rstrip("?").partition(".")
            if section not in self.scale or (read != section and section in reads):
                continue
            value = self.scale[section]
            if read.endswith("?"):
                out.append((f"scale.{read}", b"set"))
                continue
            if key:
                value = value.get(key)
            out.append((f"scale.{read}", json.dumps(value, sort_keys=True, default=str).encode()))
            if not key and section in NAMED_FILES:
                out += self.files(NAMED_FILES[section].format(value))
        return out

    def resource(self, key: str) -> list[tuple[str, bytes]]:
        """A configuration resource's field values; one naming a file under configs/ counts as the file's bytes."""
        resource = self.resources[key]
        out = []
        for name in sorted(type(resource).model_fields):
            value = getattr(resource, name)
            named = self.files(value) if isinstance(value, str) else []
            out += named or [(f"{key}.{name}", json.dumps(value, sort_keys=True, default=str).encode())]
        return out

    def files(self, relative: str, depth: int = 1) -> list[tuple[str, bytes]]:
        """The bytes of ``relative`` under root (every file of a folder), and of the files a YAML file names
        (``depth`` levels); [] when it names nothing there."""
        path = self.root / relative
        if not relative or ".." in Path(relative).parts or not path.exists() or path == self.root:
            return []
        paths = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        out = [(p.relative_to(self.root).as_posix(), _content(p)) for p in paths]
        if depth and path.suffix == ".yaml":
            for value in _strings(parse_yaml(path.read_text()) or {}):
                out += self.files(value, depth - 1)
        return out


def _as_read(read: str) -> str:
    """``section.name`` when ``name`` is a field of the section's settings model, else the whole section: a method
    or property (``scale.pretraining.settings(...)``) or an attribute of a plain value (``scale.name.upper()``)
    may read any field."""
    section, _, key = read.partition(".")
    if not key:
        return read
    field_info = ScalePreset.model_fields.get(section)
    models = [getattr(field_info, "annotation", None)]
    models += list(getattr(models[0], "__args__", ()))  # Optional[Settings]
    fields = next(
        (set(m.model_fields) for m in models if isinstance(getattr(m, "model_fields", None), dict)), set()
    )
    return read if key in fields else section


def _content(path: Path) -> bytes:
    """What of a configuration file counts: a YAML file's parsed values (its comments and layout do not), any
    other file's bytes (a template's every character reaches a prompt)."""
    if path.suffix in (".yaml", ".yml"):
        return json.dumps(parse_yaml(path.read_text()), sort_keys=True, default=str).encode()
    return path.read_bytes()


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def asset_function(asset: dg.AssetsDefinition) -> Symbol:
    """(module, name) of the function that computes ``asset``."""
    fn = asset.op.compute_fn
    fn = getattr(fn, "decorated_fn", fn)
    return fn.__module__, fn.__name__


def code_version_of(
    asset: dg.AssetsDefinition, tree: SourceTree, config: ConfigReader, parts: list[str] | None = None
) -> str:
    """``asset``'s code version; ``parts``, when given, receives the names of what was hashed (for the docs)."""
    digest = hashlib.sha256()

    def add(name: str, data: bytes) -> None:
        digest.update(f"{name}:{len(data)}\n".encode())
        digest.update(data)
        if parts is not None:
            parts.append(name)

    reach = tree.reach(*asset_function(asset))
    for name in sorted(reach.sources):
        add(f"source {name}", reach.sources[name].encode())
    for library in sorted(reach.libraries):
        add(f"library {BYTE_DECIDING[library]}", library_version(library).encode())
    if SCALE_RESOURCE in asset.required_resource_keys:
        for name, data in config.scale_sections(reach.scale_reads):
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


CACHE_ENTRIES_KEPT = 64  # one entry per edited state of the sources: enough for a day of edits, a few KB each


def inputs_digest(
    assets: Iterable[Any],
    resources: Mapping[str, Any],
    source_root: Path = SOURCE_ROOT,
    configs: Path | None = None,
) -> str:
    """A SHA-256 of everything ``code_versions`` reads (the module docstring lists it): equal digests, equal
    versions. Reading the bytes of ~170 sources and ~40 configuration files takes milliseconds."""
    digest = hashlib.sha256()

    def add(name: str, data: bytes) -> None:
        digest.update(f"{name}:{len(data)}\n".encode())
        digest.update(data)

    for path in sorted((source_root / PACKAGE).rglob("*.py")):
        add(f"source {path.relative_to(source_root).as_posix()}", path.read_bytes())
    configs = configs or config_dir()
    for path in sorted(p for p in configs.rglob("*") if p.is_file()):
        add(f"config {path.relative_to(configs).as_posix()}", path.read_bytes())
    for library in sorted(BYTE_DECIDING):
        add(f"library {library}", library_version(library).encode())
    add("scale", settings.SCALE.get().encode())
    for key in sorted(resources):
        resource = resources[key]
        values = {name: getattr(resource, name) for name in sorted(type(resource).model_fields)}
        add(f"resource {key}", json.dumps(values, sort_keys=True, default=str).encode())
    for asset in assets:
        if isinstance(asset, dg.AssetsDefinition) and asset.is_executable:
            keys = sorted(k.to_user_string() for k in asset.keys)
            shape = [keys, list(asset_function(asset)), sorted(asset.required_resource_keys)]
            add("asset", json.dumps(shape).encode())
    return digest.hexdigest()


def cached_code_versions(
    assets: Iterable[Any],
    resources: Mapping[str, Any],
    cache_dir: Path | None = None,
    source_root: Path = SOURCE_ROOT,
    configs: Path | None = None,
) -> dict[str, str]:
    """``code_versions(assets, resources, source_root, configs)``, remembered under ``inputs_digest`` in
    ``cache_dir`` (default this machine's cache, ``<NEXA_CACHE_DIR>/code-versions``). An entry is written only when
    the inputs did not change while the versions were derived; an unwritable cache only costs the derivation."""
    assets = list(assets)
    folder = cache_dir or settings.cache_root() / "code-versions"
    digest = inputs_digest(assets, resources, source_root, configs)
    entry = folder / f"{digest[:32]}.json"
    with contextlib.suppress(OSError, ValueError):
        remembered = json.loads(entry.read_text())
        if isinstance(remembered, dict) and all(isinstance(v, str) for v in remembered.values()):
            return remembered
    versions = code_versions(assets, resources, source_root, configs)
    if (
        inputs_digest(assets, resources, source_root, configs) == digest
    ):  # no edit while deriving: the versions are the digest's
        with contextlib.suppress(OSError):
            storage.write_json(versions, entry)
            _prune(folder)
    return versions


def _prune(folder: Path) -> None:
    """Keep the ``CACHE_ENTRIES_KEPT`` newest entries: each edit of the sources leaves one behind."""
    entries = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for stale in entries[CACHE_ENTRIES_KEPT:]:
        stale.unlink(missing_ok=True)


def with_code_versions(
    assets: Iterable[Any], resources: Mapping[str, Any], cache_dir: Path | None = None
) -> list[Any]:
    """The assets, each spec given its derived ``code_version`` (``resources``: the configuration resources;
    ``cache_dir``: where derived versions are remembered, default this machine's cache)."""
    assets = list(assets)
    versions = cached_code_versions(assets, resources, cache_dir)

    def versioned(spec: dg.AssetSpec) -> dg.AssetSpec:
        version = versions.get(spec.key.to_user_string())
        return spec if version is None else spec.replace_attributes(code_version=version)

    return [a.map_asset_specs(versioned) if isinstance(a, dg.AssetsDefinition) else a for a in assets]
