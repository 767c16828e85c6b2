"""A checkpoint copied by hand into a data root that has no frozen eval set: the evaluation fails at once
with a message that says what to materialize, and the checkpoint sensor tries it again (a bounded number of
times) instead of counting it as handled. The evaluation of such a copy from where it lies, with an eval set, is
tests/test_pipeline.py::test_a_copied_checkpoint_is_evaluated_from_where_it_lies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
from support.checkpoint_files import copy_checkpoint_from_elsewhere
from support.sandbox import make_sandbox, sandbox_env

from nexa_dagster.core.common.config import REPO_ROOT


def test_without_a_dataset_the_evaluation_says_what_to_materialize_and_is_retried(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nexa_dagster.sensors.checkpoints import MAX_EVALUATION_ATTEMPTS, RETRY_COMMAND, new_checkpoint_sensor

    for key, value in sandbox_env(make_sandbox(tmp_path)).items():
        monkeypatch.setenv(key, value)
    from nexa_dagster.definitions import build_defs

    defs = build_defs()
    copy_checkpoint_from_elsewhere(tiny_model_dir, tmp_path / "data" / "checkpoints" / "copied")
    resources = {k: defs.resources[k] for k in ("storage", "tracking", "promotion_policy")}
    instance = dg.DagsterInstance.from_config(str(tmp_path / "home"))
    try:
        tick = new_checkpoint_sensor(dg.build_sensor_context(instance=instance, resources=resources))
        assert [r.run_key for r in tick.run_requests] == ["evaluate-copied"]
        instance.add_dynamic_partitions("checkpoints", ["copied"])  # what the daemon does with the request
        keys = []
        for _ in range(MAX_EVALUATION_ATTEMPTS):
            result = defs.resolve_job_def("evaluation_job").execute_in_process(
                instance=instance, partition_key="copied", raise_on_error=False
            )
            assert not result.success
            failure = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE][0]
            message = failure.step_failure_data.error.message
            assert (
                "no eval set v1 to evaluate checkpoint copied on: none has been frozen under" in message
                and "--select eval_set" in message
            )
            assert "--partition copied" in message  # and how to evaluate it again afterwards
            assert not [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_UP_FOR_RETRY]
            # the next tick asks again, until the attempts are spent; then it says which and how to retry by hand
            tick = new_checkpoint_sensor(
                dg.build_sensor_context(instance=instance, cursor=tick.cursor, resources=resources)
            )
            keys.append([r.run_key for r in tick.run_requests])
        assert keys == [["evaluate-copied-attempt-2"], ["evaluate-copied-attempt-3"], []]
        assert "failed 3 times, not retried: copied" in tick.skip_reason.skip_message
        assert RETRY_COMMAND.format(checkpoint="<id>") in tick.skip_reason.skip_message
        # the command the message gives runs the evaluation of that checkpoint again (and fails the same way here)
        command = RETRY_COMMAND.format(checkpoint="copied").split()
        proc = subprocess.run(
            [str(Path(sys.executable).parent / command[0]), *command[1:]],
            cwd=REPO_ROOT,
            env=sandbox_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode != 0 and "none has been frozen under" in proc.stderr + proc.stdout
        assert len(instance.get_runs(dg.RunsFilter(tags={"dagster/partition": "copied"}))) == 4
    finally:
        instance.dispose()
