"""Serving stage: a checkpoint that passed the promotion gate becomes production. With the serving service
running (``make serve``, docker compose), the service switches its endpoint to the checkpoint (blue/green) and
this asset waits for it, or, with a ``canary`` in ``configs/promotion.yaml``, runs it as a canary on a share of the
live requests and follows it until the service's always-valid test decides (promoted: the pointer moved by the
service; rolled back: nothing is materialized, as for a held-back checkpoint); without a service, the checkpoint
is smoke-tested in a temporary engine. Then the pointer file
and the MLflow registry alias ``production`` follow, so that pointer, alias and traffic agree, and a materialization of
``production_model`` records the change (assets/production.py)."""

import sys
from collections.abc import Iterator
from typing import Any

import dagster as dg
from pydantic import ValidationError

from nexa_dagster.assets.common import IMPORTS_MODELS, MODEL_CALL_RETRY
from nexa_dagster.assets.partitions import checkpoint_partitions
from nexa_dagster.assets.production import production_change
from nexa_dagster.core.cluster import warm_python
from nexa_dagster.core.common.artifacts import EvalReport
from nexa_dagster.core.evaluation.promotion import (
    ProductionEntry,
    ProductionRegistry,
    held_back_because,
)
from nexa_dagster.core.evaluation.rl_eval_set import newest_prompts_path
from nexa_dagster.core.serving.canary import CanaryPolicy
from nexa_dagster.core.serving.client import ServingServiceClient, SwitchFailed, SwitchResult
from nexa_dagster.core.serving.outcomes import record_outcome
from nexa_dagster.core.serving.smoke import now_utc, smoke_test_in_temporary_engine
from nexa_dagster.resources.configs import PromotionResource
from nexa_dagster.resources.storage import StorageResource
from nexa_dagster.resources.tracking import TrackingResource


def _smoke_test_without_service(
    context: dg.AssetExecutionContext, eval_report: EvalReport, storage: StorageResource, previous: str | None
) -> SwitchResult:
    checkpoint_id = context.partition_key
    work_dir = storage.deployment_dir(checkpoint_id)
    manifest = smoke_test_in_temporary_engine(
        eval_report.checkpoint_path,
        checkpoint_id,
        work_dir,
        logger=context.log,
        # where this process keeps a warm Python (make run's, for its workers) the engine forks from it
        warm=warm_python.running(sys.executable),
    )
    if manifest.status != "ok":
        raise dg.Failure(
            f"{checkpoint_id} failed its smoke test ({manifest.status}): {manifest.error}; not promoting",
            allow_retries=False,
        )
    return SwitchResult(
        checkpoint_id=checkpoint_id,
        checkpoint_path=eval_report.checkpoint_path,
        previous_checkpoint_id=previous,
        endpoint=None,
        model_name=manifest.model_name,
        switched_at=now_utc(),
        smoke_response=manifest.smoke_response,
        smoke_latency_s=manifest.smoke_latency_s,
        engine=manifest.engine,
    )


@dg.asset(
    op_tags=IMPORTS_MODELS,  # step_executor.py: torch and transformers in its own process
    group_name="serving",
    partitions_def=checkpoint_partitions,
    output_required=False,
    retry_policy=MODEL_CALL_RETRY,
    kinds={"vllm", "transformers", "haproxy"},
    description="The checkpoint in production: the serving service's endpoint switched to it (blue/green behind "
    "HAProxy, smoke-tested before it takes traffic), or, without a running service, smoke-tested in a "
    "temporary engine; then the production pointer and MLflow alias. A checkpoint the promotion gate "
    "held back is not deployed and not materialized: a normal outcome, not a failure.",
)
def model_deployment(
    context: dg.AssetExecutionContext,
    eval_report: EvalReport,
    storage: StorageResource,
    tracking: TrackingResource,
    promotion_policy: PromotionResource,
) -> Iterator[dg.Output[SwitchResult]]:
    checkpoint_id = context.partition_key
    policy = promotion_policy.policy()
    registry = ProductionRegistry(storage.production_pointer())
    production = registry.current()
    outcome_dir = storage.deployment_dir(checkpoint_id)
    previous = production.checkpoint_id if production else None
    held_back = held_back_because(checkpoint_id, eval_report, production)
    if held_back:  # a decision, not a failure: recorded, and nothing is materialized
        context.log.info(
            f"{checkpoint_id} held back: {held_back}; {previous or 'nothing'} stays in production"
        )
        record_outcome(outcome_dir, checkpoint_id, "held back", held_back, previous)
        return

    context.log.info(
        f"deploying {checkpoint_id} from {eval_report.checkpoint_path} (the promotion gate passed)"
    )
    canary = canary_policy(policy.canary)  # a bad canary setting fails here, before anything changes
    try:
        deployed = _deploy(
            context, eval_report, storage, tracking, policy.registered_model, registry, production, canary
        )
    except Exception as error:
        # a failed smoke test or switch: recorded as what happened, then the step fails
        record_outcome(outcome_dir, checkpoint_id, "failed", str(error).splitlines()[0], previous)
        raise
    # the canary was rolled back on live traffic: a decision, like a held-back one
    if isinstance(deployed, str):
        context.log.info(
            f"{checkpoint_id} rolled back by its canary: {deployed}; {previous} stays in production"
        )
        record_outcome(outcome_dir, checkpoint_id, "rolled back", deployed, previous)
        return
    result, service, version = deployed
    record_outcome(outcome_dir, checkpoint_id, "deployed", "the promotion gate passed", checkpoint_id)
    context.log_event(production_event(registry, checkpoint_id, previous))
    context.log.info(
        f"{checkpoint_id} is now production (MLflow {policy.registered_model} v{version})"
        + (f", served at {result.endpoint}" if result.endpoint else "")
    )
    yield dg.Output(
        result,
        metadata=deployment_metadata(
            checkpoint_id, result, eval_report, f"{policy.registered_model}/{version}"
        ),
    )


def _deploy_as_canary(
    context: dg.AssetExecutionContext,
    eval_report: EvalReport,
    service: ServingServiceClient,
    storage: StorageResource,
    tracking: TrackingResource,
    registered_model: str,
    production: ProductionEntry | None,
    canary: CanaryPolicy,
) -> tuple[SwitchResult, ServingServiceClient, str] | str:
    """The checkpoint as a canary beside production, followed until the service decides; promoted, the service has
    moved the pointer (the entry given to it) and the MLflow alias follows here. A run retried after its canary
    was promoted (production is this checkpoint) only moves the alias."""
    checkpoint_id, path = context.partition_key, eval_report.checkpoint_path
    previous = production.checkpoint_id if production else None
    version = model_version(tracking, registered_model, checkpoint_id, path)  # not yet the production alias
    decided_at = now_utc()
    if previous != checkpoint_id:
        entry = ProductionEntry(
            checkpoint_id=checkpoint_id,
            checkpoint_path=path,
            metric="eval_loss",
            value=eval_report.eval_loss,
            eval_set_version=eval_report.eval_set_version,
            mlflow_version=version,
        )
        book = newest_prompts_path(storage.path("rl_eval_sets")) if "quality" in canary.figures() else None
        if book:
            context.log.info(f"live answers to checkable prompts are scored against {book}")
        try:
            started = service.canary(
                path, checkpoint_id, policy=canary.model_dump(), entry=entry.model_dump(), answer_book=book
            )
        except SwitchFailed as e:
            raise dg.Failure(f"the serving service did not start {checkpoint_id} as a canary: {e}") from e
        context.log.info(
            f"{checkpoint_id} is a canary on {canary.share:.0%} of {service.base_url}'s requests beside "
            f"{started['stable']}: it takes all traffic once shown non-inferior on every watched figure"
        )
        decision = service.wait_canary(checkpoint_id, context.log.info, canary.max_duration_s + 600.0)
        if decision["verdict"] != "promote":
            return str(decision["reason"])
        decided_at = str(decision.get("decided_at") or decided_at)
        context.log.info(f"canary {checkpoint_id} promoted: {decision['reason']}")
    tracking.set_alias(registered_model, "production", version)
    status = service.status()
    result = SwitchResult(
        checkpoint_id=checkpoint_id,
        checkpoint_path=path,
        previous_checkpoint_id=previous,
        endpoint=service.base_url,
        model_name=str(status.get("model")),
        colour=status.get("colour"),
        switched_at=decided_at,
        engine=str(status.get("engine") or ""),
    )
    return result, service, version


def deployment_metadata(
    checkpoint_id: str, result: SwitchResult, eval_report: EvalReport, mlflow_version: str
) -> dict[str, object]:
    """What a person reads on a deployment: where it is served, what it replaced, the smoke test, the evaluation it
    passed, the model version."""
    return {
        "endpoint": result.endpoint or "none (no serving service runs; `make serve` serves production)",
        "checkpoint_served": checkpoint_id,
        "previous_checkpoint": result.previous_checkpoint_id,
        "switched_at": result.switched_at,
        "switch_s": round(result.switch_s, 2),
        "engine": result.engine,
        "smoke_response": result.smoke_response[:500],
        "smoke_latency_s": round(result.smoke_latency_s, 3),
        "eval_loss": round(eval_report.eval_loss, 4) if eval_report.eval_loss is not None else None,
        "eval_set_version": eval_report.eval_set_version,
        "eval_loss_difference": eval_report.eval_loss_difference,
        "mlflow_model_version": mlflow_version,
    }


def production_event(
    registry: ProductionRegistry, checkpoint_id: str, previous: str | None
) -> dg.AssetMaterialization:
    """production_model's history: its data version is now ``checkpoint_id`` (what the preference stage goes stale
    on), as the pointer just written says."""
    promoted = registry.current()
    if promoted is None or promoted.checkpoint_id != checkpoint_id:
        raise dg.Failure(
            f"the production pointer {registry.path} does not name {checkpoint_id} after its promotion"
        )
    return production_change(promoted, "promotion", previous)


def model_version(tracking: TrackingResource, registered_model: str, checkpoint_id: str, path: str) -> str:
    """The checkpoint's version of the registered model, registered now if it has none."""
    return tracking.version_of(registered_model, checkpoint_id) or tracking.register_checkpoint(
        registered_model, checkpoint_id, path, None
    )


def canary_policy(setting: dict[str, Any] | None) -> CanaryPolicy | None:
    """``configs/promotion.yaml``'s ``canary``, checked (a share outside (0, 1), a margin or a confidence out of
    range: a failure naming the file and the field, before anything changes)."""
    if setting is None:
        return None
    try:
        return CanaryPolicy.model_validate(setting)
    except ValidationError as e:
        raise dg.Failure(f"configs/promotion.yaml: canary: {e}", allow_retries=False) from None


def _deploy(
    context: dg.AssetExecutionContext,
    eval_report: EvalReport,
    storage: StorageResource,
    tracking: TrackingResource,
    registered_model: str,
    registry: ProductionRegistry,
    production: ProductionEntry | None,
    canary: CanaryPolicy | None = None,
) -> tuple[SwitchResult, ServingServiceClient | None, str] | str:
    """Serve the checkpoint (the service switches, or runs it as a canary, or a temporary engine smoke-tests it),
    then move the MLflow alias and the production pointer; if those fail, traffic goes back to what the pointer
    says. A canary rolled back: its reason."""
    checkpoint_id = context.partition_key
    previous = production.checkpoint_id if production else None
    service = ServingServiceClient.find(storage.serving_dir())
    if service is not None and canary is not None:
        return _deploy_as_canary(
            context, eval_report, service, storage, tracking, registered_model, production, canary
        )
    if service is None:
        context.log.info(
            f"no serving service runs: smoke-testing {checkpoint_id} in a temporary engine"
            + (" (a canary needs live traffic: none without the service)" if canary is not None else "")
        )
        result = _smoke_test_without_service(context, eval_report, storage, previous)
    else:
        context.log.info(f"asking the serving service at {service.base_url} to switch to {checkpoint_id}")
        try:
            result = service.switch(eval_report.checkpoint_path, checkpoint_id)
        except SwitchFailed as e:
            raise dg.Failure(
                f"the serving service did not switch to {checkpoint_id}: {e}", allow_retries=False
            ) from e

    try:
        version = model_version(tracking, registered_model, checkpoint_id, eval_report.checkpoint_path)
        tracking.set_alias(registered_model, "production", version)
        registry.promote(
            ProductionEntry(
                checkpoint_id=checkpoint_id,
                checkpoint_path=eval_report.checkpoint_path,
                metric="eval_loss",
                value=eval_report.eval_loss,
                eval_set_version=eval_report.eval_set_version,
                mlflow_version=version,
            )
        )
    except BaseException:
        if service is not None and production is not None:  # traffic goes back to what the pointer says
            service.switch(production.checkpoint_path, production.checkpoint_id)
        raise
    return result, service, version
