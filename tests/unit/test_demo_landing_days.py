"""`make run` (nexa_dagster/demo.py) on a landing root holding a folder Dagster has no partition for: a day after
today (the daily partitions end today) and a day before NEXA_PARTITIONS_START. Each gets one line naming the folder
and what to do; the other days still run (they are what the demo processes)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from nexa_dagster.assets.partitions import daily_partitions
from nexa_dagster.core.data.ingest import landed_days
from nexa_dagster.demo import days_dagster_knows


def test_a_day_after_today_and_one_before_the_partitions_are_named_and_the_others_kept(
    tmp_path: Path,
) -> None:
    today = dt.datetime.now(dt.UTC).date()
    first = daily_partitions.get_first_partition_key()
    before = (dt.date.fromisoformat(first) - dt.timedelta(days=1)).isoformat()
    days = [before, first, today.isoformat(), (today + dt.timedelta(days=1)).isoformat()]
    for day in days:
        (tmp_path / day).mkdir()
        (tmp_path / day / "docs.jsonl").write_text('{"text": "a document"}\n')
    landed = landed_days(tmp_path)
    assert landed == days

    known, lines = days_dagster_knows(landed, tmp_path)
    assert known == [first, today.isoformat()]
    tomorrow = days[-1]
    assert lines == [
        f"skipped {tmp_path / before}: before the first daily partition {first}; set "
        f"NEXA_PARTITIONS_START={before} (or earlier) to process it",
        f"skipped {tmp_path / tomorrow}: dated after today (the last daily partition is {today.isoformat()}); run "
        f"again on {tomorrow} or later, or move its files to the folder of the day they landed",
    ]
