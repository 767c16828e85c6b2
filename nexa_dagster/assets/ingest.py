"""Ingest stage: a day's landed documents become the ``raw_documents`` table."""

import dagster as dg
import pandas as pd

from nexa_dagster.assets.common import SINGLE_RUN_BACKFILL, preview
from nexa_dagster.assets.partitions import daily_partitions
from nexa_dagster.assets.types import RawDocumentsType
from nexa_dagster.core.common import storage as io
from nexa_dagster.core.data.ingest import IngestError, read_day
from nexa_dagster.resources.configs import IngestResource
from nexa_dagster.resources.scale import ScaleResource
from nexa_dagster.resources.storage import StorageResource


def quarantine_path(storage: StorageResource, day: str) -> str:
    """Where a day's bad input lines go with ``ingest.on_error: quarantine`` (one JSON object per bad line)."""
    return storage.path("quarantine", "raw_documents", f"{day}.jsonl")


@dg.asset(
    group_name="ingest",
    partitions_def=daily_partitions,
    backfill_policy=SINGLE_RUN_BACKFILL,
    dagster_type=RawDocumentsType,
    kinds={"python", "parquet"},
    description="Documents that landed on a day: read from JSONL/Parquet/text/datasets files, normalised, "
    "given content-hash ids, de-duplicated and capped by the scale preset. Bad lines fail the day, or "
    "with ingest.on_error: quarantine are set aside in data/quarantine/raw_documents/<day>.jsonl.",
)
def raw_documents(
    context: dg.AssetExecutionContext,
    storage: StorageResource,
    scale_preset: ScaleResource,
    ingest_config: IngestResource,
) -> pd.DataFrame:
    scale = scale_preset.load()
    frames, quarantined, quarantine_paths = [], 0, []
    for day in context.partition_keys:
        try:
            ingested = read_day(
                storage.landing_dir(day),
                day,
                max_docs=scale.max_docs_per_day,
                max_chars=scale.max_chars_per_doc,
                text_fields=ingest_config.text_field_candidates,
                title_fields=ingest_config.title_field_candidates,
                on_error=ingest_config.on_error,
            )
        except IngestError as e:
            raise dg.Failure(description=str(e), allow_retries=False) from e
        frame = ingested.documents
        context.log.info(f"{day}: {len(frame)} documents from {ingested.files} files")
        path = quarantine_path(storage, day)
        if ingested.quarantined:
            io.write_jsonl((b.to_json() for b in ingested.quarantined), path)
            quarantined += len(ingested.quarantined)
            quarantine_paths.append(path)
            context.log.warning(
                f"{day}: {len(ingested.quarantined)} bad lines set aside in {path} (first: "
                f"{ingested.quarantined[0].where}: {ingested.quarantined[0].reason})"
            )
        elif io.exists(path):
            io.remove(path)  # from an earlier run of the day whose bad lines have since been fixed
        frames.append(frame)
    docs = pd.concat(frames, ignore_index=True)
    context.add_output_metadata(
        {
            "dagster/row_count": len(docs),
            "quarantined_rows": quarantined,
            "quarantine_paths": dg.MetadataValue.json(quarantine_paths),
            "num_characters": int(docs["n_chars"].sum()),
            "days": dg.MetadataValue.json(sorted(docs["day"].unique().tolist())),
            "scale": scale.name,
            "preview": preview(docs, ["doc_id", "day", "source", "title", "text"]),
        }
    )
    return docs
