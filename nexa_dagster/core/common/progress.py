"""Progress of a long stage in the run logs, at least every few seconds, whatever the pace of the work.

The work calls ``progress(done, total)`` as often as it likes (it only records the numbers); a background thread
writes ``"<what>: done/total (rate/s)"`` every ``every_s`` seconds while the stage runs, and once more at the end.
So a slow teacher or judge, where one batch takes longer than the interval, still shows it is alive.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType


class Progress:
    """``with Progress(log, "teacher answers") as progress: ... progress(done, total) ...``"""

    def __init__(self, log: Callable[[str], None], what: str, every_s: float = 10.0) -> None:
        self.log, self.what, self.every_s = log, what, every_s
        self.done, self.total = 0, 0
        self._start = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._report, name=f"progress-{what}", daemon=True)

    def __call__(self, done: int, total: int) -> None:
        self.done, self.total = done, total

    def line(self) -> str:
        elapsed = time.monotonic() - self._start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        return f"{self.what}: {self.done}/{self.total} ({rate:.1f}/s, {elapsed:.0f} s)"

    def _report(self) -> None:
        while not self._stop.wait(self.every_s):
            self.log(self.line())

    def __enter__(self) -> Progress:
        self._start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if exc is None:
            self.log(self.line())
