"""What the asset checks of the data stages look for in a table, as plain functions (``assets/checks.py`` turns
each into a Dagster asset check): each returns what is wrong, an empty result when nothing is."""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd


def redelivered_days(documents: pd.DataFrame, earlier: Mapping[str, set[str]]) -> list[str]:
    """Each day of ``documents`` (``raw_documents`` rows) whose every document was already ingested on an earlier
    day (``earlier``: day -> its doc_ids, the run's own earlier days added): a day re-delivered under a new date,
    which brings nothing new to answer or train on. Ids are content hashes, so a repeated document repeats its id.
    Some repeated documents are normal (documents repeat); only a day with none new is reported."""
    seen = {day: set(ids) for day, ids in earlier.items()}
    problems = []
    for day, ids in sorted((str(d), set(g["doc_id"])) for d, g in documents.groupby("day")):
        before = {d: s for d, s in seen.items() if d < day}
        if ids and ids <= set().union(*before.values()):
            holders = sorted(d for d, s in before.items() if ids & s)
            problems.append(
                f"{day}: all {len(ids)} documents were ingested before (on {', '.join(holders)}): a re-delivered "
                "day; remove its landing folder, or land the new documents it should hold"
            )
        seen[day] = ids
    return problems
