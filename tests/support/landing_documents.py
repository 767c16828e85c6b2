"""The suite's small landing days (tests/data/landing) as the pipeline reads them: each day ingested by ``read_day``
with the tiny preset's caps (what ``raw_documents`` does), and the checkable RL tasks ``build_tasks`` makes of those
documents (what ``rl_prompts`` and the SFT blend's ``checkable_tasks`` source do). Check tests start from these, so a
check fails on what the pipeline wrote, not on a frame made to fail it."""

from __future__ import annotations

import functools
from typing import Any

from nexa_dagster.core.common.config import RLTaskSettings
from nexa_dagster.core.data.ingest import landed_days, read_day
from nexa_dagster.core.rl.tasks import TaskBuild, build_tasks
from nexa_dagster.resources.scale import ScaleResource
from support.sandbox import SAMPLE_LANDING


@functools.cache
def landing_documents() -> tuple[dict[str, Any], ...]:
    """Every raw_documents row of the three small landing days, in day order (read once per process)."""
    scale = ScaleResource(name="tiny").load()
    return tuple(
        row
        for day in landed_days(SAMPLE_LANDING)
        for row in read_day(
            SAMPLE_LANDING / day,
            day,
            max_docs=scale.max_docs_per_day,
            max_chars=scale.max_chars_per_doc,
        ).documents.to_dict("records")
    )


def tiny_task_settings(**changes: Any) -> RLTaskSettings:
    """The tiny preset's ``rl.tasks``, with ``changes`` (a preset edited since)."""
    rl = ScaleResource(name="tiny").load().rl
    assert rl is not None, "the tiny preset has an rl section"
    return rl.tasks.model_copy(update=changes)


def landing_tasks(settings: RLTaskSettings | None = None) -> TaskBuild:
    """The checkable tasks of the landing documents, both sides, not decontaminated (no eval set is frozen here)."""
    return build_tasks(landing_documents(), settings or tiny_task_settings(), None)
