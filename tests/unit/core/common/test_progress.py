"""Long stages say how far they are in the run logs at a steady pace, even when one unit of work is slow."""

import time

from nexa_dagster.core.common.progress import Progress


def test_progress_is_logged_on_a_clock_not_per_item() -> None:
    lines: list[str] = []
    with Progress(lines.append, "teacher answers", every_s=0.2) as progress:
        progress(1, 4)
        time.sleep(0.7)  # one slow item: the heartbeat still reports, several times
        progress(4, 4)
    assert len([line for line in lines if line.startswith("teacher answers: 1/4")]) >= 2, lines
    assert lines[-1].startswith("teacher answers: 4/4"), "the last line gives the final count"


def test_a_failed_stage_does_not_claim_a_final_count() -> None:
    lines: list[str] = []
    try:
        with Progress(lines.append, "gated", every_s=5) as progress:
            progress(2, 9)
            raise RuntimeError("judge went away")
    except RuntimeError:
        pass
    assert lines == []
