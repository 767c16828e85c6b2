"""What the asset checks of the data stages look for in a table, as plain functions (``assets/checks.py`` turns
each into a Dagster asset check): each returns what is wrong, an empty result when nothing is."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd


def day_problems(documents: pd.DataFrame, days: Sequence[str], cap: int | None) -> list[str]:
    """A day's ``raw_documents`` against the run's days: no row of another day, each day at least one document and
    at most ``cap`` (the scale preset's ``max_docs_per_day``; None: uncapped)."""
    problems = []
    counts = documents["day"].value_counts() if len(documents) else pd.Series(dtype=int)
    stray = sorted(set(counts.index) - set(days))
    if stray:
        problems.append(f"{int(counts[stray].sum())} rows of days outside the run's {list(days)}: {stray}")
    for day in days:
        n = int(counts.get(day, 0))
        if n == 0:
            problems.append(f"{day}: no documents")
        elif cap is not None and n > cap:
            problems.append(f"{day}: {n} documents, above the preset's cap of {cap}")
    return problems


def unanswered(samples: pd.DataFrame) -> pd.DataFrame:
    """Samples the judge let through with no answer: an empty or blank ``response``, or a generation ``error``."""
    blank = samples["response"].fillna("").str.strip() == ""
    errored = samples["error"].notna() & (samples["error"].fillna("") != "")
    return samples[blank | errored]
