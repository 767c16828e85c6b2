"""Small helpers shared by the asset modules: retry policy, previews, progress logging, and model errors that no
retry can fix."""

from collections.abc import Iterator
from contextlib import contextmanager

import dagster as dg
import pandas as pd

from nexa_dagster.core.common.progress import Progress
from nexa_dagster.core.llm.base import LLMError

# Every stage that calls a model or a server retries with exponential backoff: endpoints blip, GPUs get preempted.
MODEL_CALL_RETRY = dg.RetryPolicy(
    max_retries=3, delay=2, backoff=dg.Backoff.EXPONENTIAL, jitter=dg.Jitter.PLUS_MINUS
)
SINGLE_RUN_BACKFILL = dg.BackfillPolicy.single_run()
# The op tag of a step that imports torch and transformers in its own process (a tokenizer, a model, a training
# launch's configuration check, the transformers engine's options): a run with two or more forks them from a server
# that imported them once (step_executor.py; which steps import them, recorded: docs/measurements.md, "Step
# processes").
# A wrong tag costs only a run whose tagged steps all import neither. The teacher and judge steps have none: they
# import them for a local model only, and a lab's endpoints make a day's two such steps import nothing.
IMPORTS_MODELS = {"nexa/imports_models": "true"}


def preview(df: pd.DataFrame, columns: list[str], rows: int = 5, width: int = 80) -> dg.MetadataValue:
    """A Markdown table of the first rows, with long text cut, for the asset's page in the UI."""
    if df.empty:
        return dg.MetadataValue.md("*(empty)*")
    cut = df[columns].head(rows).copy()
    for c in cut.columns:
        if cut[c].dtype == object:
            cut[c] = cut[c].map(
                lambda v: (str(v)[:width] + "…") if v is not None and len(str(v)) > width else v
            )
            cut[c] = cut[c].map(
                lambda v: str(v).replace("\n", " ").replace("|", "\\|") if v is not None else ""
            )
    return dg.MetadataValue.md(cut.to_markdown(index=False))


def progress_logger(context: dg.AssetExecutionContext, what: str, every_s: float = 10.0) -> Progress:
    """Progress lines in the run log every ``every_s`` seconds while the stage runs (use it as a context manager)."""
    return Progress(context.log.info, what, every_s)


@contextmanager
def no_retry_on_permanent_llm_errors(what: str) -> Iterator[None]:
    """The HTTP client already retries what is transient (429, 5xx, timeouts, dropped connections); what is left
    when it raises ``LLMError(permanent=True)`` (a bad key, an unknown model, a refused request) fails the same way
    on every attempt, so the step's ``RetryPolicy`` must not see it.

    Re-raise a permanent ``LLMError`` from the block as ``dg.Failure(allow_retries=False)`` naming ``what``."""
    try:
        yield
    except LLMError as e:
        if not e.permanent:
            raise
        raise dg.Failure(
            description=f"{what}: {e} (not retried: a later attempt would fail the same way)",
            metadata={"http_status": e.status or 0},
            allow_retries=False,
        ) from None
