"""Ingest stage: a day's landed documents become the ``raw_documents`` table."""


import dagster as dg
import pandas as pd

from nexa_dagster.assets.common import SINGLE_RUN_BACKFILL, preview
from nexa_dagster.assets.partitions import daily_partitions
from nexa_dagster.assets.types import RawDocumentsType
from nexa_dagster.core.config import load_pipeline_config, load_scale
from nexa_dagster.core.ingest import IngestError, ingest_day
from nexa_dagster.resources.storage import StorageResource


@dg.asset(
    group_name="ingest",
    partitions_def=daily_partitions,
    backfill_policy=SINGLE_RUN_BACKFILL,
    dagster_type=RawDocumentsType,
    kinds={"python", "parquet"},
    description="Documents that landed on a day: read from JSONL/Parquet/text/datasets files, normalised, "
                "given content-hash ids, de-duplicated and capped by the scale preset.",
)
def raw_documents(context: dg.AssetExecutionContext, storage: StorageResource) -> pd.DataFrame:
    scale = load_scale()
    fields = load_pipeline_config()["ingest"]
    frames = []
    for day in context.partition_keys:
        try:
            frame = ingest_day(storage.landing_dir(day), day, max_docs=scale.max_docs_per_day,
                               max_chars=scale.max_chars_per_doc, text_fields=fields["text_field_candidates"],
                               title_fields=fields["title_field_candidates"])
        except IngestError as e:
            raise dg.Failure(description=str(e), allow_retries=False) from e
        context.log.info(f"{day}: {len(frame)} documents from {frame['source'].str.split(':').str[0].nunique()} files")
        frames.append(frame)
    docs = pd.concat(frames, ignore_index=True)
    context.add_output_metadata({
        "dagster/row_count": len(docs),
        "num_characters": int(docs["n_chars"].sum()),
        "days": dg.MetadataValue.json(sorted(docs["day"].unique().tolist())),
        "scale": scale.name,
        "preview": preview(docs, ["doc_id", "day", "source", "title", "text"]),
    })
    return docs
