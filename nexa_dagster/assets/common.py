"""Small helpers shared by the asset modules (retry policy, previews, progress logging)."""


from collections.abc import Callable

import dagster as dg
import pandas as pd

# Every stage that calls a model or a server retries with exponential backoff: endpoints blip, GPUs get preempted.
MODEL_CALL_RETRY = dg.RetryPolicy(max_retries=3, delay=2, backoff=dg.Backoff.EXPONENTIAL, jitter=dg.Jitter.PLUS_MINUS)
SINGLE_RUN_BACKFILL = dg.BackfillPolicy.single_run()


def preview(df: pd.DataFrame, columns: list[str], rows: int = 5, width: int = 80) -> dg.MetadataValue:
    """A Markdown table of the first rows, with long text cut, for the asset's page in the UI."""
    if df.empty:
        return dg.MetadataValue.md("*(empty)*")
    cut = df[columns].head(rows).copy()
    for c in cut.columns:
        if cut[c].dtype == object:
            cut[c] = cut[c].map(lambda v: (str(v)[:width] + "…") if v is not None and len(str(v)) > width else v)
            cut[c] = cut[c].map(lambda v: str(v).replace("\n", " ").replace("|", "\\|") if v is not None else "")
    return dg.MetadataValue.md(cut.to_markdown(index=False))


def progress_logger(context: dg.AssetExecutionContext, what: str) -> Callable[[int, int], None]:
    def log(done: int, total: int) -> None:
        context.log.info(f"{what}: {done}/{total}")

    return log
