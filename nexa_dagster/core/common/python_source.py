"""``ast.parse`` that threads cannot break on CPython 3.11.0-3.11.7.

On those versions the counter that ``ast.parse`` keeps while it turns the parser's tree into Python objects lives in
state shared by every thread (CPython gh-106905, fixed in 3.11.8 and 3.12.2). When a garbage collection starts
during that conversion and runs Python code (a finalizer, a ``gc`` callback: SQLAlchemy closing a pooled connection
did, in this suite), the interpreter can switch threads; a second thread parsing at that moment moves the shared
counter, and one of the two parses fails with ``SystemError: AST constructor recursion depth mismatch``. It failed
a CI run of this project in ``code_versions`` (``assets/versions.py``), which parses every module of the package
while a Dagster process has other threads, and it can fail any code location load the same way.

The conversion itself runs no Python code unless a collection does, so a parse with the collector paused cannot be
interrupted by another thread and cannot be the parse that moves another's counter mid-way. The lock keeps two of
these parses from re-enabling the collector under each other.
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
