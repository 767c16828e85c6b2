"""The Dagster beta and preview APIs this project uses on purpose, and why: their warnings are filtered here, in one
place, by exact message, so that every other warning (a new beta API, a deprecation) still reaches the user.

Imported by ``nexa_dagster.assets`` (the package every asset module, the code location, the CLI and the tests import
before any decorator runs). A filter here is a decision: add one only with the API it silences and the reason.
"""

from __future__ import annotations

import warnings

import dagster as dg

# (the API, the start of its warning's message, why the project uses it); all BetaWarnings but the last
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

# preview: may change in a patch release (pyproject pins dagster to 1.13.x; tests/unit/assets/test_checks.py runs them)
KNOWN_PREVIEW_APIS: list[tuple[str, str, str]] = [
    (
        "asset_check(partitions_def=...)",
        r"Specifying a partitions_def on an AssetCheckSpec is currently in preview",
        "a daily asset's check reads the run's days, not every day ever ingested (assets/checks.py: "
        "raw_documents_are_new)",
    ),
    (
        "PipesMessageReader.expected_writer_count (Dagster's own call)",
        r"Function `PipesMessageReader.expected_writer_count` is currently in preview",
        "Dagster Pipes calls its own preview function in every open_pipes_session (dagster/_core/pipes/"
        "context.py): training and evaluation run through Pipes, and no project code calls it",
    ),
]


def known_warnings() -> list[tuple[str, type[Warning]]]:
    """(message, category) of every warning filtered here."""
    return [(m, dg.BetaWarning) for _, m, _ in KNOWN_BETA_APIS] + [
        (m, dg.PreviewWarning) for _, m, _ in KNOWN_PREVIEW_APIS
    ]


def filter_known_beta_warnings() -> None:
    """Silence exactly the warnings listed here (idempotent: ``filterwarnings`` drops duplicates)."""
    for message, category in known_warnings():
        warnings.filterwarnings("ignore", message=message, category=category)


filter_known_beta_warnings()
