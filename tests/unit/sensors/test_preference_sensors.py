"""The preference stage's two sensors on a real (temporary) Dagster instance: which days a newly promoted SFT model
answers, when a DPO training is requested, and what each waits for (its skip reasons, its cursor)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest

from nexa_dagster.core.evaluation.promotion import ProductionEntry, ProductionRegistry
from nexa_dagster.resources.scale import ScaleResource
from nexa_dagster.resources.storage import StorageResource
from nexa_dagster.sensors.preference import pairs_after_promotion, preference_training_after_pairs

DAYS = ["2026-01-01", "2026-01-02", "2026-01-03"]


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as instance:
        yield instance


def materialize(instance: dg.DagsterInstance, key: str, day: str) -> None:
    instance.report_runless_asset_event(dg.AssetMaterialization(asset_key=key, partition=day))


def promote(storage: StorageResource, checkpoint_id: str, stage: str) -> None:
    """``checkpoint_id`` in production, a checkpoint directory whose record names its stage."""
    directory = Path(storage.data_root) / "checkpoints" / checkpoint_id
    directory.mkdir(parents=True)
    (directory / "checkpoint.json").write_text(json.dumps({"stage": stage}))
    ProductionRegistry(storage.production_pointer()).promote(
        ProductionEntry(checkpoint_id=checkpoint_id, checkpoint_path=str(directory), metric="win_rate")
    )


def outcome(
    result: dg.SensorResult | dg.SkipReason, cursor: str | None
) -> tuple[dg.SensorResult | dg.SkipReason, str | None]:
    """The tick's result and the cursor the next tick gets (a skip leaves it as it was)."""
    return result, result.cursor if isinstance(result, dg.SensorResult) else cursor


def pairs_tick(
    instance: dg.DagsterInstance, storage: StorageResource, cursor: str | None = None
) -> tuple[dg.SensorResult | dg.SkipReason, str | None]:
    context = dg.build_sensor_context(
        instance=instance,
        cursor=cursor,
        resources={"storage": storage, "scale_preset": ScaleResource(name="tiny")},
    )
    return outcome(pairs_after_promotion(context), cursor)


def test_a_promoted_sft_model_answers_every_judged_day_without_pairs_once(
    instance: dg.DagsterInstance, tmp_path: Path
) -> None:
    storage = StorageResource(data_root=str(tmp_path / "data"))
    for day in DAYS:
        materialize(instance, "filtered_samples", day)
    materialize(instance, "preference_pairs", DAYS[1])

    result, _ = pairs_tick(instance, storage)
    assert isinstance(result, dg.SkipReason) and "production is nothing" in (result.skip_message or "")

    promote(storage, "sft-1", "sft")
    result, cursor = pairs_tick(instance, storage)
    assert isinstance(result, dg.SensorResult) and cursor == "sft-1"
    assert [(r.partition_key, r.run_key) for r in result.run_requests or []] == [
        (DAYS[0], f"pairs-{DAYS[0]}-sft-1"),
        (DAYS[2], f"pairs-{DAYS[2]}-sft-1"),
    ]
    result, _ = pairs_tick(instance, storage, cursor)  # the same model again: nothing more
    assert isinstance(result, dg.SkipReason) and "sft-1 has answered already" in (result.skip_message or "")

    for day in (DAYS[0], DAYS[2]):
        materialize(instance, "preference_pairs", day)
    promote(storage, "sft-2", "sft")  # a new SFT model, but every judged day has pairs
    result, cursor = pairs_tick(instance, storage, cursor)
    assert isinstance(result, dg.SensorResult) and not result.run_requests and cursor == "sft-2"

    promote(
        storage, "pref-1", "preference"
    )  # a DPO model in production does not answer: pairs are on-policy SFT
    materialize(instance, "filtered_samples", "2026-01-04")
    result, _ = pairs_tick(instance, storage, cursor)
    assert isinstance(result, dg.SkipReason) and "pref-1 (preference)" in (result.skip_message or "")


def test_new_pairs_request_one_training_once_no_pairs_run_is_in_flight(instance: dg.DagsterInstance) -> None:
    def tick(cursor: str | None) -> tuple[dg.SensorResult | dg.SkipReason, str | None]:
        context = dg.build_sensor_context(instance=instance, cursor=cursor)
        return outcome(preference_training_after_pairs(context), cursor)

    result, cursor = tick(None)
    assert isinstance(result, dg.SkipReason) and "no preference pairs since" in (result.skip_message or "")

    materialize(instance, "preference_pairs", DAYS[0])
    materialize(instance, "preference_pairs", DAYS[1])
    result, cursor = tick(None)
    assert isinstance(result, dg.SensorResult) and len(result.run_requests or []) == 1
    newest = instance.fetch_materializations(dg.AssetKey("preference_pairs"), limit=1).records[0].storage_id
    assert cursor == str(newest) and result.run_requests[0].run_key == f"dpo-after-{newest}"
    result, _ = tick(cursor)  # nothing new since: no second training
    assert isinstance(result, dg.SkipReason)

    materialize(instance, "preference_pairs", DAYS[2])
    run = dg.DagsterRun(
        job_name="preference_pairs_job", run_id=str(uuid.uuid4()), status=dg.DagsterRunStatus.STARTED
    )
    instance.add_run(run)
    result, waiting = tick(cursor)  # new pairs, but a pairs run still writes: training waits for all of them
    assert (
        isinstance(result, dg.SkipReason) and "in flight" in (result.skip_message or "") and waiting == cursor
    )
    instance.report_run_failed(run)
    result, cursor_after = tick(cursor)
    assert isinstance(result, dg.SensorResult) and len(result.run_requests or []) == 1
    assert int(cursor_after or 0) > int(cursor or 0)


def test_pairs_failing_their_blocking_check_stop_the_run_and_never_feed_dpo(
    instance: dg.DagsterInstance,
) -> None:
    """preference_pairs' spec as the code location defines it (key, partitions, the blocking pairs check), its
    check function on a day with a repeated pair: the run fails, the DPO stand-in in the same run never starts,
    and the training sensor waits, naming the day, until that day's pairs are made again and pass."""
    from support.preference_pairs import judged_pairs

    DAY = "2026-11-20"  # a day of the daily partitions (they start at the sample data's first day)

    from nexa_dagster.assets.preference import pairs_check
    from nexa_dagster.definitions import defs

    spec = next(s for s in defs.resolve_all_asset_specs() if s.key == dg.AssetKey("preference_pairs"))
    check = next(iter(defs.resolve_assets_def(spec.key).check_specs))  # its one check
    assert check.blocking and check.name == "pairs_are_trainable"

    def pairs_run(repeat: bool) -> dg.ExecuteInProcessResult:
        frame = judged_pairs(DAY, 6, 0.2)
        if repeat:
            frame.loc[3, "pair_id"] = frame.loc[2, "pair_id"]

        @dg.multi_asset(
            specs=[spec.replace_attributes(deps=[])], check_specs=[check], partitions_def=spec.partitions_def
        )
        def preference_pairs() -> Iterator[dg.MaterializeResult | dg.AssetCheckResult]:
            yield dg.MaterializeResult(asset_key=spec.key)
            yield pairs_check(frame, min_score_gap=1.0, eval_fraction=0.2)

        @dg.asset(deps=[spec.key], partitions_def=spec.partitions_def)
        def dpo_stand_in() -> None: ...

        return dg.materialize(
            [preference_pairs, dpo_stand_in], instance=instance, partition_key=DAY, raise_on_error=False
        )

    failed = pairs_run(repeat=True)
    assert not failed.success
    assert not instance.get_latest_materialization_event(dg.AssetKey("dpo_stand_in"))
    tick = preference_training_after_pairs(dg.build_sensor_context(instance=instance))
    assert isinstance(tick, dg.SkipReason) and f"pairs of {DAY} failed" in (tick.skip_message or "")

    assert pairs_run(repeat=False).success  # made again, passing: the DPO stand-in ran, and the sensor trains
    assert instance.get_latest_materialization_event(dg.AssetKey("dpo_stand_in"))
    tick = preference_training_after_pairs(dg.build_sensor_context(instance=instance))
    assert isinstance(tick, dg.SensorResult) and len(tick.run_requests or []) == 1
