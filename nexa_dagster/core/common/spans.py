"""Spans: how long a stage's own work and its fixed costs took, one log line each.

A stage says ``span work/training_steps: 11.204 s`` or ``span fixed/model_load: 2.310 s`` through the log it already
has (a step's ``context.log``, a worker's Pipes log): the line lands in the Dagster run's event log, where
``bench/pipeline_profile.py`` reads it back beside the steps' own start and end times, to split each job's time
into the stage's work (training steps, scoring, judging, generation) and what it pays around it (process starts,
imports, engine start-up, model loads, checkpoint writes, MLflow). Timing only: nothing reads a span to decide.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator
from typing import Literal

Kind = Literal["work", "fixed"]
# a worker process's whole time, launched to exited and its messages read: logged after the spans the worker sent,
# which it holds (what it spent outside them is its start-up: the interpreter, imports, teardown)
WORKER_PROCESS = "{kind}_worker_process"
PATTERN = re.compile(r"^span (?P<kind>work|fixed)/(?P<name>[\w.-]+): (?P<seconds>\d+(?:\.\d+)?) s$")


def span_line(kind: Kind, name: str, seconds: float) -> str:
    """The log line of one span (``PATTERN`` reads it back)."""
    return f"span {kind}/{name}: {seconds:.3f} s"


@contextlib.contextmanager
def span(log: Callable[[str], None], kind: Kind, name: str) -> Iterator[None]:
    """Say how long the block took, once it completed (a block that raised is not a cost to count)."""
    t0 = time.perf_counter()
    yield
    log(span_line(kind, name, time.perf_counter() - t0))
