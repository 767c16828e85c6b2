"""The executor of every multi-step job: each step in a process of its own, forked from a server that imported what
the steps import, once per run.

A step in a process of its own fails alone (the OOM killer, a lost node) and is retried alone. Dagster's default
``spawn`` start imports the code location again for every step (about 3.5 s of CPU each on a 2-core host); a
``forkserver`` imports what it is told to before the first step, and every step forks from it already holding it
(docs/operations.md, "Step processes").

What the server imports is chosen per run, from the run's plan:

* always ``STEP_PRELOAD``: the code location (~1 s of CPU per step) and the instance's storage (~0.5 s). Named,
  because with ``forkserver: {}`` Dagster 1.13 preloads only its executor (its "the job's module" default is never
  reached: an absent ``preload_modules`` reads as an empty list);
* and ``MODEL_PRELOAD`` (torch and transformers' tokenizers, ~3.5 s of CPU) when two or more of the run's steps are
  tagged ``IMPORTS_MODELS`` (``assets/common.py``): steps that load a tokenizer, a model or the training
  configuration in their own process. A run with one such step gains nothing (the step imports them itself, at
  the same cost), and a run with none would pay for them for nothing: ``ingest_job``, the leaderboard's runs and a
  day's data runs, the runs the product starts most often on their own (preloading torch for every run cost them
  +4.5 CPU-s a run, measured 2026-12-05: docs/measurements.md).

The forkserver is one per process (Python's ``multiprocessing``): the choice holds for the first run a process
executes, as in a run worker, which executes one. A process that executes several runs (a test's
``execute_job``s) keeps its first run's server.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import dagster as dg
from dagster._core.execution.retries import RetryMode
from dagster._core.executor.multiprocess import MultiprocessExecutor

from nexa_dagster.assets.common import IMPORTS_MODELS

# The code location (this package's definitions), then the instance's storage: SQLAlchemy and Dagster's SQLite or
# Postgres storage. The forkserver skips a module that will not import (dagster_postgres where it is not installed).
STEP_PRELOAD = ("nexa_dagster.definitions", "dagster._core.storage.sqlite_storage", "dagster_postgres")
# What every step tagged IMPORTS_MODELS imports: torch and transformers' tokenizer classes (`from transformers import
# AutoTokenizer`), which the packing steps need, and a training launch's configuration check and a checkpoint's check
# import anyway. With these preloaded each of them imports nothing more of either before its work (measured on the
# code location's process, 2026-12-06: the preload 3.4-4.1 CPU-s, then 0.00-0.03). The modelling code is left to the
# steps that load a model: preloading the tiny student's too (`transformers.models.mixtral.modeling_mixtral`) cost
# 5.8-7.0 CPU-s, and the packing and launch steps never import it.
MODEL_PRELOAD = ("torch", "transformers.models.auto.tokenization_auto")


def preload_for(plan: Any) -> list[str]:
    """What the forkserver imports for ``plan`` (an ``ExecutionPlan``): ``STEP_PRELOAD``, and ``MODEL_PRELOAD`` when
    at least two of the steps it executes are tagged ``IMPORTS_MODELS``."""
    ((tag, value),) = IMPORTS_MODELS.items()
    loading = [key for key in plan.step_keys_to_execute if plan.get_step_by_key(key).tags.get(tag) == value]
    return [*STEP_PRELOAD, *(MODEL_PRELOAD if len(loading) >= 2 else ())]


class PlanPreloadingExecutor(MultiprocessExecutor):
    """Dagster's multiprocess executor on a forkserver whose preload is chosen from the run's plan (``preload_for``)
    when the run starts, rather than fixed for every run of the job."""

    def execute(self, plan_context: Any, execution_plan: Any) -> Iterator[dg.DagsterEvent]:
        self._explicit_forkserver_preload = preload_for(execution_plan)
        yield from super().execute(plan_context, execution_plan)


# A run may still turn its steps' retry policies off, as Dagster's own executor lets it (run config `execution:
# {config: {retries: {disabled: {}}}}`): the kill tests do, where each retry would be killed at the same point.
# Nothing else is configurable: the start method is what this executor is for.
@dg.executor(
    name="multiprocess_forkserver",
    config_schema={
        "retries": dg.Field(
            dg.Selector({"enabled": {}, "disabled": {}}),
            default_value={"enabled": {}},
            description="`disabled`: a failed step is not retried, whatever its retry policy",
        )
    },
    requirements=dg.multiple_process_executor_requirements(),
)
def step_executor(init_context: dg.InitExecutorContext) -> PlanPreloadingExecutor:
    """Every step forked from a server that imported what the run's steps import (see the module's docstring),
    retried by its retry policy unless the run turns retries off."""
    retries = RetryMode.from_config(init_context.executor_config["retries"])
    assert retries is not None  # the selector has a default
    return PlanPreloadingExecutor(
        retries=retries,
        max_concurrent=None,
        start_method="forkserver",
        explicit_forkserver_preload=STEP_PRELOAD,
    )
