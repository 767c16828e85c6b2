"""The canary sensor and ``stop_canary_job`` on a real (temporary) Dagster instance, with a stand-in for the serving
service's control API (``ServingServiceClient``): observations of ``model_deployment``'s partition, the cursor a
restarted daemon goes on from, the alias moved once, and no service: a skip. (The real service: the canary tests of
``tests/integration/test_serving_endpoint.py``.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from nexa_dagster.core.evaluation.promotion import ProductionEntry, ProductionRegistry
from nexa_dagster.core.serving.client import ServingServiceClient, SwitchFailed
from nexa_dagster.jobs.canary import stop_canary_job
from nexa_dagster.resources.configs import PromotionResource
from nexa_dagster.resources.storage import StorageResource
from nexa_dagster.sensors.canary import canary_sensor


class FakeService:
    def __init__(self) -> None:
        self.state: dict[str, Any] = {"checkpoint_id": "a", "canary": None, "last_canary": None}
        self.stopped: list[str] = []

    def status(self) -> dict[str, Any]:
        return self.state

    def stop_canary(self, reason: str) -> dict[str, Any]:
        if self.state["canary"] is None:
            raise SwitchFailed("no canary runs: nothing to stop")
        self.stopped.append(reason)
        decided = {"checkpoint_id": "b", "verdict": "roll back", "reason": f"stopped by a person: {reason}"}
        self.state = {"checkpoint_id": "a", "canary": None, "last_canary": {**decided, "decided_at": "t"}}
        return self.state["last_canary"]


class FakeTracking:
    def __init__(self) -> None:
        self.alias: tuple[str, str] | None = ("1", "a")
        self.moves: list[str] = []

    def version_of(self, model_name: str, checkpoint_id: str) -> str | None:
        return {"a": "1", "b": "2"}.get(checkpoint_id)

    def alias_version(self, model_name: str, alias: str) -> tuple[str, str] | None:
        return self.alias

    def set_alias(self, model_name: str, alias: str, version: str) -> None:
        self.moves.append(version)
        self.alias = (version, "b")


@pytest.fixture
def service(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeService]:
    fake = FakeService()
    monkeypatch.setattr(ServingServiceClient, "find", classmethod(lambda cls, serving_dir: fake))
    yield fake


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("checkpoints", ["b"])
        yield instance


def tick(
    instance: dg.DagsterInstance, storage: StorageResource, tracking: FakeTracking, cursor: str | None
) -> tuple[dg.SensorResult, str | None]:
    """One evaluation from a new context (as after a daemon restart) with the cursor Dagster kept."""
    context = dg.build_sensor_context(
        instance=instance,
        cursor=cursor,
        resources={"storage": storage, "tracking": tracking, "promotion_policy": PromotionResource()},
    )
    result = canary_sensor(context)
    assert isinstance(result, dg.SensorResult)
    return result, result.cursor


def running(n: int) -> dict[str, Any]:
    figure = {"status": "undecided", "low": -0.1, "high": 0.1, "limit": 0.2, "n_stable": n, "n_canary": n}
    return {
        "checkpoint_id": "b",
        "colour": "green",
        "share": 0.5,
        "since": "t0",
        "last_check": "undecided after 4 s",
        "canary_verdict": "continue",
        "canary_failed": figure,
    }


def test_a_canary_is_observed_per_new_check_and_its_promotion_moves_the_alias_once(
    service: FakeService, instance: dg.DagsterInstance, tmp_path: Path
) -> None:
    storage, tracking = StorageResource(data_root=str(tmp_path / "data")), FakeTracking()
    service.state["canary"] = running(10)
    result, cursor = tick(instance, storage, tracking, None)
    (seen,) = result.asset_events
    assert isinstance(seen, dg.AssetObservation) and seen.asset_key == dg.AssetKey("model_deployment")
    assert seen.partition == "b" and seen.metadata["n_canary"].value == 10
    assert seen.metadata["figures"].value["failed"]["limit"] == 0.2
    result, cursor = tick(instance, storage, tracking, cursor)  # the same check: nothing new
    assert not result.asset_events and "canary b runs" in (result.skip_reason.skip_message or "")
    # promoted: the service moved the pointer; the deployment's run died before moving the alias
    ProductionRegistry(storage.production_pointer()).promote(
        ProductionEntry(checkpoint_id="b", checkpoint_path="/c/b", metric="eval_loss")
    )
    service.state = {
        "checkpoint_id": "b",
        "canary": None,
        "last_canary": {"checkpoint_id": "b", "verdict": "promote", "reason": "no worse", "decided_at": "t1"},
    }
    result, cursor = tick(instance, storage, tracking, cursor)
    (decided,) = result.asset_events
    assert decided.metadata["verdict"].value == "promote"
    assert "moved to" in decided.metadata["production_alias"].value and tracking.moves == ["2"]
    for _ in range(2):  # a restarted daemon with the kept cursor: reported once, moved once
        result, cursor = tick(instance, storage, tracking, cursor)
        assert not result.asset_events and tracking.moves == ["2"]


def test_a_canary_of_a_checkpoint_that_is_no_partition_is_observed_without_one(
    service: FakeService, instance: dg.DagsterInstance, tmp_path: Path
) -> None:
    service.state["canary"] = {**running(3), "checkpoint_id": "by-hand"}
    result, _ = tick(instance, StorageResource(data_root=str(tmp_path / "data")), FakeTracking(), None)
    (seen,) = result.asset_events
    assert seen.partition is None and "canary by-hand" in (seen.description or "")


def test_no_serving_service_is_a_skip(
    monkeypatch: pytest.MonkeyPatch, instance: dg.DagsterInstance, tmp_path: Path
) -> None:
    monkeypatch.setattr(ServingServiceClient, "find", classmethod(lambda cls, serving_dir: None))
    context = dg.build_sensor_context(
        instance=instance,
        resources={
            "storage": StorageResource(data_root=str(tmp_path / "data")),
            "tracking": FakeTracking(),
            "promotion_policy": PromotionResource(),
        },
    )
    result = canary_sensor(context)
    assert isinstance(result, dg.SkipReason) and "no serving service runs" in (result.skip_message or "")


def test_stop_canary_job_stops_the_running_canary_with_the_reason_and_fails_when_none_runs(
    service: FakeService, tmp_path: Path
) -> None:
    storage = StorageResource(data_root=str(tmp_path / "data"))
    config = {"ops": {"stop_canary": {"config": {"reason": "wrong tokenizer"}}}}
    refused = stop_canary_job.execute_in_process(
        run_config=config, resources={"storage": storage}, raise_on_error=False
    )
    assert not refused.success and service.stopped == []
    (failure,) = [e for e in refused.all_events if e.is_step_failure]
    assert "no canary runs" in str(failure.event_specific_data)
    service.state["canary"] = running(3)
    result = stop_canary_job.execute_in_process(run_config=config, resources={"storage": storage})
    assert result.success and service.stopped == ["wrong tokenizer"]
    assert service.state["last_canary"]["reason"] == "stopped by a person: wrong tokenizer"
