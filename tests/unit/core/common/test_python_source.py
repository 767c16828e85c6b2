"""``parse_python`` holds where ``ast.parse`` breaks: threads parsing while garbage collections run Python code
(CPython gh-106905, 3.11.0-3.11.7; the reproduction is the issue's own: a ``gc`` callback doing work, many threads
parsing one real module)."""

from __future__ import annotations

import ast
import difflib
import gc
import random
import sys
import threading
from collections.abc import Callable, Iterator

import pytest

from nexa_dagster.core.common.config import REPO_ROOT
from nexa_dagster.core.common.python_source import parse_python

# the module CI failed on
SOURCE = (REPO_ROOT / "nexa_dagster" / "core" / "serving" / "service.py").read_text()
RACE_FIXED = sys.version_info >= (3, 11, 8)


@pytest.fixture
def collections_run_python() -> Iterator[None]:
    """Every collection runs Python code (a diff of two random lists), as a finalizer or a ``gc`` callback does."""
    rng = random.Random(0)

    def busy(phase: str, info: dict[str, int]) -> None:
        a, b = ([f"{rng.randint(0, 10)}\n" for _ in range(100)] for _ in range(2))
        list(difflib.unified_diff(a, b))

    gc.callbacks.append(busy)
    try:
        yield
    finally:
        gc.callbacks.remove(busy)


def _parse_in_threads(
    parsers: list[Callable[[str, str], ast.Module]], rounds: int
) -> list[list[SystemError]]:
    """Each parser in 10 threads of its own, all at once, each parsing SOURCE 10 times a round: the errors each
    parser's threads met."""
    errors: list[list[SystemError]] = [[] for _ in parsers]

    def work(i: int) -> None:
        for _ in range(10):
            try:
                parsers[i](SOURCE, "service.py")
            except SystemError as e:
                errors[i].append(e)

    for _ in range(rounds):
        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(parsers)) for _ in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return errors


def test_parses_never_fail_beside_threads_whose_plain_parses_do(collections_run_python: None) -> None:
    plain = lambda source, filename: ast.parse(source, filename=filename)  # noqa: E731
    ours, theirs = _parse_in_threads([parse_python, plain], rounds=3)
    assert ours == []
    if not RACE_FIXED:  # the same run met the race: the check above could have failed
        assert theirs and all("recursion depth mismatch" in str(e) for e in theirs)


def test_the_tree_is_ast_parses_and_the_collector_is_left_as_it_was() -> None:
    assert ast.dump(parse_python(SOURCE, "service.py")) == ast.dump(ast.parse(SOURCE))
    assert gc.isenabled()
    gc.disable()
    try:
        parse_python("x = 1", "x.py")
        assert not gc.isenabled()  # a caller that paused the collector keeps it paused
    finally:
        gc.enable()
    with pytest.raises(SyntaxError, match="x.py"):
        parse_python("def (", "x.py")
    assert gc.isenabled()
