"""Serving stage: a checkpoint that passed the promotion gate is brought up behind an OpenAI-compatible server,
smoke-tested, and becomes production (pointer file + MLflow registry alias ``production``)."""

import dagster as dg

from nexa_dagster.assets.common import MODEL_CALL_RETRY
from nexa_dagster.assets.partitions import checkpoint_partitions
from nexa_dagster.core.artifacts import EvalReport
from nexa_dagster.core.promotion import ProductionEntry, ProductionRegistry, load_policy, report_metric
from nexa_dagster.core.serving import DeploymentManifest, deploy_and_smoke
from nexa_dagster.resources.storage import StorageResource
from nexa_dagster.resources.tracking import TrackingResource


@dg.asset(
    group_name="serving",
    partitions_def=checkpoint_partitions,
    retry_policy=MODEL_CALL_RETRY,
    kinds={"vllm", "transformers"},
    description="The checkpoint served by an OpenAI-compatible engine (vllm serve on a GPU host, transformers "
                "serve otherwise): started, health-checked, smoke-tested, stopped, and promoted to production. "
                "Runs only when eval_report's blocking check `beats_production` passed.",
)
def model_deployment(context: dg.AssetExecutionContext, eval_report: EvalReport, storage: StorageResource,
                     tracking: TrackingResource) -> DeploymentManifest:
    checkpoint_id = context.partition_key
    work_dir = storage.deployment_dir(checkpoint_id)
    context.log.info(f"deploying {checkpoint_id} from {eval_report.checkpoint_path}")
    manifest = deploy_and_smoke(eval_report.checkpoint_path, checkpoint_id, work_dir, logger=context.log)
    if manifest.status != "ok":
        raise dg.Failure(f"{checkpoint_id}: the smoke request got no answer ({manifest.status}); not promoting")

    policy = load_policy()
    version = tracking.version_of(policy.registered_model, checkpoint_id) or tracking.register_checkpoint(
        policy.registered_model, checkpoint_id, eval_report.checkpoint_path, None)
    tracking.set_alias(policy.registered_model, "production", version)
    ProductionRegistry(storage.production_pointer()).promote(ProductionEntry(
        checkpoint_id=checkpoint_id, checkpoint_path=eval_report.checkpoint_path, metric=policy.metric,
        value=report_metric(eval_report, policy.metric), mlflow_version=version))
    context.log.info(f"{checkpoint_id} is now production (MLflow {policy.registered_model} v{version})")
    context.add_output_metadata({
        "engine": manifest.engine,
        "status": manifest.status,
        "ready_s": round(manifest.ready_s, 2),
        "smoke_latency_s": round(manifest.smoke_latency_s, 3),
        "smoke_prompt": manifest.smoke_prompt,
        "smoke_response": manifest.smoke_response[:500],
        "manifest": dg.MetadataValue.path(str(work_dir / "deployment.json")),
        "validation_loss": round(eval_report.validation_loss, 4),
        "promoted_to_production": True,
        "mlflow_model_version": f"{policy.registered_model}/{version}",
    })
    return manifest
