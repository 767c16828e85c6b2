"""A span's log line reads back as what was timed (bench/pipeline_profile.py reads it from the event log)."""

from __future__ import annotations

import pytest

from nexa_dagster.core.common.spans import PATTERN, span, span_line


def test_a_span_line_reads_back_as_its_kind_name_and_seconds() -> None:
    match = PATTERN.match(span_line("fixed", "model_and_deepspeed", 2.3456))
    assert match is not None
    assert (match["kind"], match["name"], float(match["seconds"])) == ("fixed", "model_and_deepspeed", 2.346)
    assert PATTERN.match("span fixed/model_load: 2.3 s, then more") is None  # a line that only looks like one


def test_a_block_says_how_long_it_took_and_one_that_raised_says_nothing() -> None:
    said: list[str] = []
    with span(said.append, "work", "scoring"):
        pass
    with pytest.raises(RuntimeError), span(said.append, "fixed", "model_load"):
        raise RuntimeError("no model")
    assert len(said) == 1
    match = PATTERN.match(said[0])
    assert match is not None and match["name"] == "scoring" and float(match["seconds"]) >= 0
