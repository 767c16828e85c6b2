"""``rl_eval_set_is_frozen_and_apart`` decides on what the RL stage really wrote: the real ``rl_eval_set`` asset,
run by Dagster, freezes version 1 from the held-out side of the checkable tasks that ``build_tasks`` made of the
small landing days' documents (the core of ``rl_prompts``; the stand-in only skips its reference rows and its
decontamination index, which this check does not read). Then:

* the preset's ``rl.tasks.held_out_fraction`` is lowered without a new ``rl.eval_set_version``: ``rl_prompts`` made
  again puts documents of frozen v1 on the train side, and the check fails naming the shared items and documents
  (GRPO would train on prompts the RL gate scores it on). Blocking: the step fails and nothing downstream of the
  set (``trained_on_it`` here, as ``rl_checkpoint`` and the trainings that leave the frozen prompts out) runs; the
  frozen set itself is intact (v1, not frozen again): the train side is what moved.
* a frozen prompts file edited after freezing: the asset itself refuses the version (the run fails naming the
  file) before its check is evaluated, so no check result is recorded: the "files match the manifest" half of the
  check is the asset's refusal, and a damaged version is never used.
"""

import json
from pathlib import Path

import dagster as dg
from support.landing_documents import landing_tasks, tiny_task_settings

from nexa_dagster.assets.rl import rl_eval_set
from nexa_dagster.core.rl.tasks import RLPrompts, write_task_rows
from nexa_dagster.resources.io_manager import NexaIOManager
from nexa_dagster.resources.scale import ScaleResource
from nexa_dagster.resources.storage import StorageResource

CHECK = "rl_eval_set_is_frozen_and_apart"


class TasksRun(dg.Config):
    held_out_fraction: float  # rl.tasks.held_out_fraction of the preset as it is at this run


@dg.asset(key="rl_prompts")
def rl_prompts(config: TasksRun, storage: StorageResource) -> RLPrompts:
    """rl_prompts' checkable tasks as the asset writes them (``checkable_tasks``: build_tasks, write_task_rows)."""
    build = landing_tasks(tiny_task_settings(held_out_fraction=config.held_out_fraction))
    run_hash, train_path, held_out_path = write_task_rows(build, storage.path("rl", "tasks"))
    return RLPrompts(
        run_hash=run_hash,
        path=train_path,  # the reference rows: not read by rl_eval_set
        records=len(build.train),
        blend="none",
        blend_fingerprint="none",
        tasks_run_hash=run_hash,
        tasks_path=train_path,
        held_out_path=held_out_path,
        task_records=len(build.train),
        held_out_records=len(build.held_out),
    )


@dg.asset(deps=["rl_eval_set"])
def trained_on_it() -> None:
    """A stand-in for what runs after the frozen set (rl_checkpoint, base_model, sft_dataset)."""


def _make(
    tmp_path: Path, instance: dg.DagsterInstance, held_out_fraction: float
) -> dg.ExecuteInProcessResult:
    data = str(tmp_path / "data")
    return dg.materialize(
        [rl_prompts, rl_eval_set, trained_on_it],
        instance=instance,
        resources={
            "io_manager": NexaIOManager(data_root=data, results_root=str(tmp_path / "results")),
            "storage": StorageResource(data_root=data, results_root=str(tmp_path / "results")),
            "scale_preset": ScaleResource(name="tiny"),
        },
        run_config={"ops": {"rl_prompts": {"config": {"held_out_fraction": held_out_fraction}}}},
        raise_on_error=False,
    )


def test_train_rows_that_moved_onto_the_frozen_set_fail_the_check(tmp_path: Path) -> None:
    shipped = tiny_task_settings().held_out_fraction
    with dg.instance_for_test() as instance:
        frozen = _make(tmp_path, instance, shipped)
        [passed] = frozen.get_asset_check_evaluations()
        assert frozen.success and passed.check_name == CHECK and passed.passed
        v1 = frozen.output_for_node("rl_eval_set")
        assert v1.prompts == len(landing_tasks().held_out) > 0

        moved = _make(tmp_path, instance, shipped / 3)  # fewer documents held out, the same eval_set_version
        [failed] = moved.get_asset_check_evaluations()
    assert frozen.asset_materializations_for_node("trained_on_it")
    # blocking: the step fails on the check, and what follows the set does not run on it
    assert not moved.success and not moved.asset_materializations_for_node("trained_on_it")
    [failure] = moved.get_step_failure_events()
    assert failure.step_key == "rl_eval_set" and CHECK in failure.step_failure_data.error.message
    [v1_again] = moved.asset_materializations_for_node("rl_eval_set")  # v1, not frozen again
    assert v1_again.metadata["content_sha256"].value == v1.content_sha256
    problems = failed.metadata["problems"].value
    assert not failed.passed and problems
    frozen_items = {json.loads(line)["item_id"] for line in Path(v1.prompts_path).read_text().splitlines()}
    shared = {p.removeprefix("item_id on both sides: ") for p in problems if p.startswith("item_id")}
    assert shared and shared <= frozen_items
    assert any(p.startswith("doc_id on both sides: ") for p in problems)


def test_a_frozen_prompts_file_edited_after_freezing_is_refused_before_the_check(tmp_path: Path) -> None:
    shipped = tiny_task_settings().held_out_fraction
    with dg.instance_for_test() as instance:
        frozen = _make(tmp_path, instance, shipped)
        assert frozen.success and frozen.get_asset_check_evaluations()[0].passed
        prompts = Path(frozen.output_for_node("rl_eval_set").prompts_path)
        items = [json.loads(line) for line in prompts.read_text().splitlines()]
        items[0]["answer"] = "lambda"  # one answer "corrected" by hand after freezing
        prompts.write_text("".join(json.dumps(i) + "\n" for i in items))

        edited = _make(tmp_path, instance, shipped)
    assert not edited.success and edited.get_asset_check_evaluations() == []
    [failure] = edited.get_step_failure_events()
    message = failure.step_failure_data.user_failure_data.description
    assert "prompts.jsonl changed since it was frozen" in message
