"""Serving stage: start an OpenAI-compatible server on the checkpoint, prove it answers, record a manifest."""


import dagster as dg

from nexa_dagster.assets.common import MODEL_CALL_RETRY
from nexa_dagster.assets.partitions import checkpoint_partitions
from nexa_dagster.core.artifacts import EvalReport
from nexa_dagster.core.serving import DeploymentManifest, deploy_and_smoke
from nexa_dagster.resources.storage import StorageResource


@dg.asset(
    group_name="serving",
    partitions_def=checkpoint_partitions,
    retry_policy=MODEL_CALL_RETRY,
    kinds={"vllm", "transformers"},
    description="The checkpoint served by an OpenAI-compatible engine (vllm serve on a GPU host, transformers "
                "serve otherwise): started, health-checked, smoke-tested, stopped; the deployment manifest records "
                "engine, readiness time and smoke-request latency.",
)
def model_deployment(context: dg.AssetExecutionContext, eval_report: EvalReport,
                     storage: StorageResource) -> DeploymentManifest:
    checkpoint_id = context.partition_key
    work_dir = storage.deployment_dir(checkpoint_id)
    context.log.info(f"deploying {checkpoint_id} from {eval_report.checkpoint_path}")
    manifest = deploy_and_smoke(eval_report.checkpoint_path, checkpoint_id, work_dir)
    context.add_output_metadata({
        "engine": manifest.engine,
        "status": manifest.status,
        "ready_s": round(manifest.ready_s, 2),
        "smoke_latency_s": round(manifest.smoke_latency_s, 3),
        "smoke_prompt": manifest.smoke_prompt,
        "smoke_response": manifest.smoke_response[:500],
        "manifest": dg.MetadataValue.path(str(work_dir / "deployment.json")),
        "validation_loss": round(eval_report.validation_loss, 4),
    })
    return manifest
