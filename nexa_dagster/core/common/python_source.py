"""``ast.parse`` that garbage collections cannot break on CPython 3.11.0-3.11.7.

On those versions the counter that ``ast.parse`` keeps while it turns the parser's tree into Python objects lives in
state shared by every parse of the interpreter (CPython gh-106905, fixed in 3.11.8 and 3.12.2). When a garbage
collection starts during that conversion and runs Python code (a finalizer, a ``gc`` callback), a second parse can
start before the first ends and move the shared counter, and the first fails with ``SystemError: AST constructor
recursion depth mismatch``. Two ways were met in this project's CI, both on 3.11.7:

- **another thread**: the collection's Python code lets the interpreter switch threads, and a thread parsing at that
  moment moves the counter. It failed ``code_versions`` (``assets/versions.py``), which parses every module of the
  package while a Dagster process has other threads; it can fail any code location load the same way.
- **the same thread**: a finalizer logs an error with its traceback (SQLAlchemy's pool, resetting a connection
  another thread opened), and 3.11's ``traceback`` module calls ``ast.parse`` to place its carets under the failing
  expression, inside the parse the collection interrupted. It failed a test that read the asset modules' source.

The conversion itself runs no Python code unless a collection does, so a parse with the collector paused can be
neither interrupted nor entered again. The lock keeps two of these parses from re-enabling the collector under each
other. ``tests/unit/test_architecture.py`` holds every parse of the project's Python to this function.
"""

from __future__ import annotations

import ast
import gc
import threading

_COLLECTOR = threading.Lock()


def parse_python(source: str, filename: str) -> ast.Module:
    """``ast.parse(source, filename)``, with the garbage collector paused for the parse (see the module's
    docstring); a collection owed meanwhile runs at the next allocation after it resumes."""
    with _COLLECTOR:
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return ast.parse(source, filename=filename)
        finally:
            if was_enabled:
                gc.enable()
