"""Turn a model error that no retry can fix into a Dagster failure that is not retried.

The HTTP client already retries what is transient (429, 5xx, timeouts, dropped connections). What is left when it
raises ``LLMError(permanent=True)`` (a bad key, an unknown model, a request the engine refuses) fails the same way
on every attempt, so the step's ``RetryPolicy`` must not see it: re-running it would only repeat the failure three
times. Transient errors propagate unchanged, and the step retry policy handles them.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import dagster as dg

from nexa_dagster.core.llm.base import LLMError


@contextmanager
def no_retry_on_permanent_llm_errors(what: str) -> Iterator[None]:
    """Re-raise a permanent ``LLMError`` from the block as ``dg.Failure(allow_retries=False)`` naming ``what``."""
    try:
        yield
    except LLMError as e:
        if not e.permanent:
            raise
        raise dg.Failure(description=f"{what}: {e} (not retried: a later attempt would fail the same way)",
                         metadata={"http_status": e.status or 0}, allow_retries=False) from None
