"""Paths that survive a move of their root: stored relative to it, resolved under wherever it is now.

A data root (or a whole checkout) may be moved, copied to another host or restored from a backup. Whatever the
project writes about its own files (the production pointer, a checkpoint's record, a stored artifact) therefore
names a file under a root by its place *in* the root, never by an absolute path:

* ``relative_to(path, root)`` is the stored form of ``path``: ``checkpoints/ckpt-1`` for a file under ``root``;
  a path outside the root (a checkpoint registered from elsewhere) stays absolute.
* ``resolve_under(stored, root)`` is where a stored path is now: a relative one is joined to the root as it is
  now; an absolute one that exists is used as it is.
* A record written before paths were stored relative names an absolute path under the root's *old* place. When
  that path no longer exists, its tail is looked for under the current root (``found_under``: the longest tail of
  at least two parts that exists there, e.g. ``/old/place/data/checkpoints/ckpt-1`` -> ``<root>/checkpoints/
  ckpt-1``), so old pointers and records keep working after a move.

Artifacts that name files of several roots (the data root and the results root) mark the root in the stored
string: ``{data_root}/checkpoints/ckpt-1`` (``portable`` / ``localize``, applied to every string of a record).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

from nexa_dagster.core.common import storage

MIN_TAIL_PARTS = 2  # a tail of one part ("config.json") could be any file: never resolved by itself


def _clean(root: str) -> str:
    return str(root).rstrip("/") or "/"


def relative_to(path: str, root: str) -> str:
    """``path``'s place under ``root`` (``"."`` for the root itself), or ``path`` unchanged when it is not under
    it (or is relative already)."""
    path, root = str(path), _clean(root)
    if path == root:
        return "."
    if path.startswith(root + "/"):
        return path[len(root) + 1 :]
    return path


def is_absolute(path: str) -> bool:
    return str(path).startswith("/") or "://" in str(path)


def found_under(path: str, roots: list[str]) -> str | None:
    """Where a stale absolute ``path`` (written under a root's old place) lies now: the longest tail of it, of at
    least ``MIN_TAIL_PARTS`` parts, that exists under one of ``roots``; None when no tail does."""
    if "://" in str(path):
        return None
    parts = PurePosixPath(path).parts[1:]  # without the leading "/"
    for start in range(len(parts) - MIN_TAIL_PARTS + 1):
        tail = "/".join(parts[start:])
        for root in roots:
            candidate = storage.join(_clean(root), tail)
            if storage.exists(candidate):
                return candidate
    return None


def resolve_under(stored: str, root: str, also: list[str] | None = None) -> str:
    """Where ``stored`` (a path as a record keeps it) is now: relative -> under ``root``; absolute and existing ->
    itself; absolute and gone -> its tail under ``root`` (or under one of ``also``) when there is one, else
    unchanged (the caller says it is not there)."""
    stored = str(stored)
    if not stored:
        return stored
    if not is_absolute(stored):
        return storage.join(_clean(root), stored) if stored != "." else _clean(root)
    if "://" in stored or storage.exists(stored):
        return stored
    return found_under(stored, [root, *(also or [])]) or stored


# -- records that name files of several roots ---------------------------------------------------------------------
def _mark(name: str) -> str:
    return "{" + name + "}"


def portable(value: Any, roots: Mapping[str, str]) -> Any:
    """``value`` (a record as plain data: dicts, lists, strings) with every string that names a file under one of
    ``roots`` ({name: root}) written as ``{name}/<its place in that root>``; the most specific root wins."""
    ordered = sorted(((n, _clean(r)) for n, r in roots.items() if r), key=lambda nr: -len(nr[1]))

    def convert(v: Any) -> Any:
        if isinstance(v, str):
            for name, root in ordered:
                if v == root or v.startswith(root + "/"):
                    rest = relative_to(v, root)
                    return _mark(name) if rest == "." else f"{_mark(name)}/{rest}"
            return v
        if isinstance(v, dict):
            return {k: convert(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [convert(x) for x in v]
        return v

    return convert(value)


def localize(value: Any, roots: Mapping[str, str], stale: bool = True) -> Any:
    """The inverse of ``portable`` under the roots as they are now: ``{name}/x`` -> ``<root>/x``. With ``stale``,
    an absolute path that does not exist (a record written before paths were portable, at the roots' old place)
    is looked for by its tail under the roots (``found_under``) and replaced when found."""
    clean = {n: _clean(r) for n, r in roots.items() if r}

    def convert(v: Any) -> Any:
        if isinstance(v, str):
            for name, root in clean.items():
                mark = _mark(name)
                if v == mark:
                    return root
                if v.startswith(mark + "/"):
                    return storage.join(root, v[len(mark) + 1 :])
            if stale and v.startswith("/") and "\n" not in v and len(v) < 4096 and not storage.exists(v):
                return found_under(v, list(clean.values())) or v
            return v
        if isinstance(v, dict):
            return {k: convert(x) for k, x in v.items()}
        if isinstance(v, list):
            return [convert(x) for x in v]
        return v

    return convert(value)
