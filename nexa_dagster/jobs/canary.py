"""``stop_canary_job``: a person stops the serving service's running canary from the Launchpad (issue 50).

The service routes every new request back to the stable model (the canary's in flight finish), records the canary as
rolled back with the reason "stopped by a person: <reason>" and stops its engine; ``canary_sensor`` then shows the
decision on ``model_deployment``'s partition. No canary running, or one decided before the stop: the run fails with
the service's reason, and nothing changes.
"""

# no ``from __future__ import annotations``: Dagster reads the op's config class from its annotation
import dagster as dg
from pydantic import Field

from nexa_dagster.core.serving.client import ServingServiceClient, SwitchFailed
from nexa_dagster.resources.storage import StorageResource


class StopCanaryConfig(dg.Config):
    reason: str = Field(
        description="Why it is stopped: the canary's recorded reason, 'stopped by a person: <reason>'."
    )


@dg.op(description="Rolls the serving service's running canary back now, with the person's reason.")
def stop_canary(context: dg.OpExecutionContext, config: StopCanaryConfig, storage: StorageResource) -> None:
    if not config.reason.strip():
        raise dg.Failure("stop_canary_job: give a reason (run config ops.stop_canary.config.reason)")
    service = ServingServiceClient.find(storage.serving_dir())
    if service is None:
        raise dg.Failure(f"no serving service runs for {storage.serving_dir()}: no canary to stop")
    try:
        decided = service.stop_canary(config.reason.strip())
    except SwitchFailed as e:
        raise dg.Failure(f"the canary was not stopped: {e}", allow_retries=False) from e
    context.log.info(f"canary {decided['checkpoint_id']}: {decided['verdict']}: {decided['reason']}")


@dg.job(
    description="Stop the serving service's running canary: every new request goes back to the production model, "
    "the canary is recorded as rolled back with your reason and its engine stops.",
)
def stop_canary_job() -> None:
    stop_canary()
