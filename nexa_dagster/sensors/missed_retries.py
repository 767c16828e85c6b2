"""Make Dagster's run retries happen when its own daemon skipped one (dagster-io/dagster#33741).

Why this exists: Dagster's retry daemon (the event-log consumer) reads each new RUN_FAILURE event and retries the
run if its record says FAILURE and ``dagster/will_retry: true``. The instance writes the event first, then the run's
status, then that tag (``dagster/_core/instance/methods/event_methods.py``, Dagster 1.13). A consumer tick that
falls between the two reads a run that is still STARTING, skips it, and moves its cursor past the event: the run
stays failed, tagged to be retried, and is never retried. Seen here once in about ten full test runs, for a run
failed by run monitoring on a loaded machine.

What this sensor does: it finds such runs (failed in the last hour, tagged ``will_retry: true``, no retry launched,
no child run, their RUN_FAILURE event already behind the consumer's cursor, so the consumer has looked at them)
and moves that cursor back to just before the earliest one. On its next tick the consumer reads the event again,
now with the run's record complete, and retries it the way it retries any run (same strategy, tags and
``max_retries``). Re-reading the events in between is safe: Dagster's ``retry_run`` launches no second retry for a
run that has one. The sensor launches nothing itself; it says what it did in its skip reason and log. A run
the daemon still does not retry after three hand-backs (it declined it for a reason of its own, written in the
run's engine events) is named in the skip reason for a person, and the cursor is left alone.

The cursor key is Dagster's own (``EVENT_LOG_CONSUMER_CURSOR-<event type>``, from
``dagster/_daemon/auto_run_reexecution/event_log_consumer.py``); ``tests/unit/sensors/test_missed_retries.py``
checks it against the daemon's code, so a Dagster upgrade that renames it fails there.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import dagster as dg
from dagster._core.storage.tags import AUTO_RETRY_RUN_ID_TAG, PARENT_RUN_ID_TAG, WILL_RETRY_TAG

from nexa_dagster.automation import sensor_default_status

FAILURE_CURSOR_KEY = f"EVENT_LOG_CONSUMER_CURSOR-{dg.DagsterEventType.RUN_FAILURE.value}"
# A run failed longer ago than this is left to a person: by then they may have re-run it by hand.
LOOKBACK_S = 3600
MAX_HAND_BACKS = 3


@dataclass(frozen=True)
class MissedRetry:
    run_id: str
    failure_storage_id: int  # the RUN_FAILURE event's id in the event log


def consumer_failure_cursor(instance: dg.DagsterInstance) -> int | None:
    """The id of the last RUN_FAILURE event the retry daemon has handled; None before its first tick."""
    value = instance.daemon_cursor_storage.get_cursor_values({FAILURE_CURSOR_KEY}).get(FAILURE_CURSOR_KEY)
    return int(value) if value is not None else None


def missed_retries(instance: dg.DagsterInstance, now: float | None = None) -> list[MissedRetry]:
    """Runs the retry daemon has passed over although they are tagged to be retried, oldest failure first.

    The failure events come from the same cross-run index the daemon reads, so their ids compare with its cursor
    (a per-run SQLite event log numbers each run's events from 1; the index does not)."""
    cursor = consumer_failure_cursor(instance)
    if cursor is None:
        return []
    since = (now if now is not None else time.time()) - LOOKBACK_S
    failures = instance.fetch_run_status_changes(
        dg.RunStatusChangeRecordsFilter(
            event_type=dg.DagsterEventType.RUN_FAILURE, after_timestamp=since, before_storage_id=cursor + 1
        ),
        limit=100,
    ).records
    if not failures:
        return []
    # the failed runs among them still tagged to be retried, in one query
    tagged = instance.get_runs(
        dg.RunsFilter(
            run_ids=list({f.run_id for f in failures}),
            statuses=[dg.DagsterRunStatus.FAILURE],
            tags={WILL_RETRY_TAG: "true"},
        )
    )
    failure_ids = {f.run_id: f.storage_id for f in failures}
    missed = [
        MissedRetry(run.run_id, failure_ids[run.run_id])
        for run in tagged
        # not retried already, by the daemon or by a person
        if AUTO_RETRY_RUN_ID_TAG not in run.tags
        and not instance.get_runs(dg.RunsFilter(tags={PARENT_RUN_ID_TAG: run.run_id}), limit=1)
    ]
    return sorted(missed, key=lambda m: m.failure_storage_id)


@dg.sensor(
    minimum_interval_seconds=30,
    default_status=sensor_default_status(),
    description="Makes Dagster's run retries happen when its retry daemon skipped a failed run "
    "(dagster-io/dagster#33741): rewinds the daemon's cursor so that it retries the run itself.",
)
def missed_run_retries(context: dg.SensorEvaluationContext) -> dg.SkipReason:
    # cursor: {run id: times handed back} for the runs still missed, so that a run the daemon declines for a
    # reason of its own (its job was deleted, say: it says why in the run's engine events) is not handed back
    # every 30 s for an hour; more than once, because the daemon can overwrite a rewind it had not yet read
    handed_back: dict[str, int] = json.loads(context.cursor) if context.cursor else {}
    missed = missed_retries(context.instance)
    handed_back = {m.run_id: handed_back.get(m.run_id, 0) for m in missed}
    again = [m for m in missed if handed_back[m.run_id] < MAX_HAND_BACKS]
    declined = sorted(run_id for run_id, n in handed_back.items() if n >= MAX_HAND_BACKS)
    if again:
        rewind_to = again[0].failure_storage_id - 1
        context.instance.daemon_cursor_storage.set_cursor_values({FAILURE_CURSOR_KEY: str(rewind_to)})
        for m in again:
            handed_back[m.run_id] += 1
        context.log.warning(
            f"the retry daemon skipped {len(again)} failed run(s) tagged to be retried "
            f"({', '.join(m.run_id for m in again)}); its RUN_FAILURE cursor is moved back to {rewind_to} so "
            "that it retries them"
        )
    context.update_cursor(json.dumps(handed_back))
    said = []
    if again:
        said.append(f"handed back to Dagster's retry daemon: {', '.join(m.run_id for m in again)}")
    if declined:
        said.append(
            f"not retried after {MAX_HAND_BACKS} hand-backs, see their engine events and re-execute them by "
            f"hand: {', '.join(declined)}"
        )
    return dg.SkipReason("; ".join(said) or "no failed run waits for a retry the daemon skipped")
