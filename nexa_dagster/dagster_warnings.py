"""The Dagster beta and preview APIs this project uses on purpose, and why: their warnings are filtered here, in one
place, by exact message, so that every other warning (a new beta API, a deprecation) still reaches the user.

Imported by ``nexa_dagster.assets`` (the package every asset module, the code location, the CLI and the tests import
before any decorator runs). A filter here is a decision: add one only with the API it silences and the reason.
"""

from __future__ import annotations

import warnings

import dagster as dg

# (the API, the start of its warning's message, why the project uses it)
KNOWN_BETA_APIS: list[tuple[str, str, str]] = [
    (
        "BackfillPolicy (asset(backfill_policy=...))",
        r"Parameter `backfill_policy` of function `asset` is currently in beta",
        "a partition range runs as one run (`dagster asset materialize --partition-range`, a multi-day backfill): "
        "the daily assets read a range of days at once (assets/common.py SINGLE_RUN_BACKFILL)",
    ),
    (
        "dagster_pandera.pandera_schema_to_dagster_type",
        r"Function `pandera_schema_to_dagster_type` is currently in beta",
        "the tables crossing a stage boundary are typed by their pandera models (assets/types.py): a bad frame "
        "fails at the boundary naming the column and the rows",
    ),
]


def filter_known_beta_warnings() -> None:
    """Silence exactly the warnings of ``KNOWN_BETA_APIS`` (idempotent: ``filterwarnings`` drops duplicates)."""
    for _api, message, _why in KNOWN_BETA_APIS:
        warnings.filterwarnings("ignore", message=message, category=dg.BetaWarning)


filter_known_beta_warnings()
