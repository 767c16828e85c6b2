"""The sensor that hands a skipped run retry back to Dagster's retry daemon: which runs it counts as skipped, and
that it moves the daemon's cursor only for those (a real instance with run retries on; the daemon's part, a real
retry after the rewind, is tests/integration/test_run_recovery.py's)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import dagster as dg
import pytest

# private on purpose: the test exists to notice Dagster renaming the retry daemon's cursor key the sensor moves
from dagster._daemon.auto_run_reexecution.event_log_consumer import _create_cursor_key

from nexa_dagster.sensors.missed_retries import (
    FAILURE_CURSOR_KEY,
    LOOKBACK_S,
    MAX_HAND_BACKS,
    consumer_failure_cursor,
    missed_retries,
    missed_run_retries,
)

# Dagster's run tags (strings it documents; its own constants live in a private module)
AUTO_RETRY_RUN_ID_TAG, PARENT_RUN_ID_TAG, WILL_RETRY_TAG = (
    "dagster/auto_retry_run_id",
    "dagster/parent_run_id",
    "dagster/will_retry",
)


@dg.op
def fails() -> None:
    raise RuntimeError("a transient fault")


@dg.job
def flaky_job() -> None:
    fails()


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test(overrides={"run_retries": {"enabled": True, "max_retries": 2}}) as instance:
        yield instance


def failed_run(instance: dg.DagsterInstance) -> tuple[str, int]:
    """A failed run tagged to be retried, as the instance tags it, and its RUN_FAILURE event's id."""
    result = flaky_job.execute_in_process(instance=instance, raise_on_error=False)
    run = instance.get_run_by_id(result.run_id)
    assert (
        run is not None and run.status == dg.DagsterRunStatus.FAILURE and run.tags[WILL_RETRY_TAG] == "true"
    )
    # its id in the cross-run index, the one the daemon's cursor counts
    failures = instance.fetch_run_status_changes(dg.DagsterEventType.RUN_FAILURE, limit=1).records
    assert failures[0].run_id == run.run_id
    return run.run_id, failures[0].storage_id


def evaluate(instance: dg.DagsterInstance, cursor: str | None = None) -> tuple[str, str | None]:
    """The sensor's skip reason and its new cursor, for one tick."""
    context = dg.build_sensor_context(instance=instance, cursor=cursor)
    result = missed_run_retries(context)
    assert isinstance(result, dg.SkipReason)  # it never launches a run itself
    return result.skip_message or "", context.cursor


def test_the_cursor_key_is_the_one_dagsters_retry_daemon_keeps() -> None:
    assert _create_cursor_key(dg.DagsterEventType.RUN_FAILURE) == FAILURE_CURSOR_KEY


def test_a_run_the_daemon_passed_over_is_handed_back_by_moving_its_cursor_to_just_before_it(
    instance: dg.DagsterInstance,
) -> None:
    first, first_event = failed_run(instance)
    second, second_event = failed_run(instance)
    instance.daemon_cursor_storage.set_cursor_values({FAILURE_CURSOR_KEY: str(second_event + 5)})

    assert [m.run_id for m in missed_retries(instance)] == [first, second]
    message, _ = evaluate(instance)
    assert first in message and second in message
    assert consumer_failure_cursor(instance) == first_event - 1  # the daemon re-reads both failures


def test_runs_the_daemon_has_not_reached_or_has_retried_or_that_are_old_are_left_alone(
    instance: dg.DagsterInstance,
) -> None:
    assert evaluate(instance)[0] == "no failed run waits for a retry the daemon skipped"  # no daemon tick yet
    ahead, ahead_event = failed_run(instance)
    retried, _ = failed_run(instance)
    instance.add_run_tags(retried, {AUTO_RETRY_RUN_ID_TAG: "the-retry"})
    instance.daemon_cursor_storage.set_cursor_values({FAILURE_CURSOR_KEY: str(ahead_event - 1)})

    assert missed_retries(instance) == []  # one not read yet by the daemon, one retried
    assert evaluate(instance)[0].startswith("no failed run")
    assert consumer_failure_cursor(instance) == ahead_event - 1  # untouched

    instance.daemon_cursor_storage.set_cursor_values({FAILURE_CURSOR_KEY: str(ahead_event + 5)})
    assert [m.run_id for m in missed_retries(instance)] == [ahead]
    assert missed_retries(instance, now=time.time() + LOOKBACK_S + 60) == []  # past the look-back
    instance.add_run_tags(ahead, {WILL_RETRY_TAG: "false"})
    assert missed_retries(instance) == []  # not to be retried (max_retries reached, say)

    instance.add_run_tags(ahead, {WILL_RETRY_TAG: "true"})
    # re-executed by a person: a child run, and no automatic-retry tag on the parent
    flaky_job.execute_in_process(instance=instance, raise_on_error=False, tags={PARENT_RUN_ID_TAG: ahead})
    assert ahead not in [m.run_id for m in missed_retries(instance)]


def test_a_run_the_daemon_keeps_declining_is_handed_back_three_times_then_named_for_a_person(
    instance: dg.DagsterInstance,
) -> None:
    """The daemon can decline a run for a reason of its own (its job deleted, say): the sensor hands it back a few
    times (a rewind can be overwritten by the daemon's own cursor write), then stops moving the cursor and names it."""
    run_id, event = failed_run(instance)
    cursor = None
    for _ in range(MAX_HAND_BACKS):
        # the daemon has read past it again
        instance.daemon_cursor_storage.set_cursor_values({FAILURE_CURSOR_KEY: str(event + 5)})
        message, cursor = evaluate(instance, cursor)
        assert message == f"handed back to Dagster's retry daemon: {run_id}"
        assert consumer_failure_cursor(instance) == event - 1
    instance.daemon_cursor_storage.set_cursor_values({FAILURE_CURSOR_KEY: str(event + 5)})
    message, cursor = evaluate(instance, cursor)
    assert message.startswith(f"not retried after {MAX_HAND_BACKS} hand-backs") and run_id in message
    assert consumer_failure_cursor(instance) == event + 5  # left where the daemon put it

    instance.add_run_tags(run_id, {AUTO_RETRY_RUN_ID_TAG: "the-retry"})
    message, cursor = evaluate(instance, cursor)
    assert message.startswith("no failed run") and cursor == "{}"  # no longer missed: dropped from the cursor
