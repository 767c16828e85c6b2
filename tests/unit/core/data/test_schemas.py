"""The typed tables at stage boundaries: what each pandera schema lets through and what it stops."""

import pandas as pd
import pandera.errors
import pytest

from nexa_dagster.core.data.schemas import RawDocuments


def _documents(days: list[str]) -> pd.DataFrame:
    n = len(days)
    return pd.DataFrame(
        {
            "doc_id": ["a" * 16] * n,
            "day": days,
            "source": ["notes.jsonl"] * n,
            "title": ["t"] * n,
            "text": ["the same document"] * n,
            "n_chars": [17] * n,
        }
    )


def test_a_document_landed_on_two_days_is_a_row_of_each_in_a_partition_range() -> None:
    """`dagster asset materialize --partition-range` hands raw_documents several days in one frame: the same
    document landed on two days is kept on both (sft_dataset keeps it once, from the earlier day)."""
    RawDocuments.validate(_documents(["2026-11-20", "2026-11-21"]))


def test_a_document_twice_in_one_day_is_refused_naming_the_columns() -> None:
    with pytest.raises(pandera.errors.SchemaError, match=r"\('day', 'doc_id'\).*not unique"):
        RawDocuments.validate(_documents(["2026-11-20", "2026-11-20"]))
