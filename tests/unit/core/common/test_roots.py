"""A data root that moves (core/common/roots.py, the production pointer): what is stored names files by their place
in the root, and records written before (absolute paths at the root's old place) are read under the new one.

Each test moves a real directory (``os.rename``, what ``mv`` does) and reads what was written before the move.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from nexa_dagster.core.evaluation.promotion import ProductionEntry, ProductionRegistry


def _checkpoint(root: Path, name: str) -> Path:
    ckpt = root / "checkpoints" / name
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text("{}")
    return ckpt


def test_the_production_pointer_follows_a_moved_data_root(tmp_path: Path) -> None:
    old, new = tmp_path / "old" / "data", tmp_path / "new" / "data"
    a, b = _checkpoint(old, "ckpt-a"), _checkpoint(old, "ckpt-b")
    pointer = old / "serving" / "production.json"
    registry = ProductionRegistry(pointer)
    registry.promote(ProductionEntry(checkpoint_id="ckpt-a", checkpoint_path=str(a), metric="eval_loss"))
    registry.promote(ProductionEntry(checkpoint_id="ckpt-b", checkpoint_path=str(b), metric="eval_loss"))
    stored = json.loads(pointer.read_text())
    assert stored["current"]["checkpoint_path"] == "checkpoints/ckpt-b"  # its place in the data root
    assert stored["history"][0]["checkpoint_path"] == "checkpoints/ckpt-a"

    new.parent.mkdir()
    os.rename(old, new)
    moved = ProductionRegistry(new / "serving" / "production.json")
    assert moved.current().checkpoint_path == str(new / "checkpoints" / "ckpt-b")
    assert moved.rollback().current.checkpoint_path == str(new / "checkpoints" / "ckpt-a")
    assert json.loads((new / "serving" / "production.json").read_text())["current"]["checkpoint_path"] == (
        "checkpoints/ckpt-a"
    )
    assert not old.exists()


def test_a_pointer_written_with_absolute_paths_is_read_under_the_moved_root(tmp_path: Path) -> None:
    """A pointer written before paths were stored relative names the checkpoint at the root's old place; after a
    move that path is gone and the checkpoint is found by its place in the root (the path's tail); a checkpoint
    registered from outside the data root keeps its absolute path."""
    old, new = tmp_path / "site" / "data", tmp_path / "elsewhere" / "restored" / "data"
    ckpt = _checkpoint(old, "ckpt-1")
    outside = _checkpoint(tmp_path / "shared", "ckpt-0")
    pointer = old / "serving" / "production.json"
    pointer.parent.mkdir(parents=True)
    entry = {"metric": "eval_loss", "value": 1.5, "eval_set_version": 1, "promoted_at": "2026-11-20T00:00:00"}
    pointer.write_text(
        json.dumps(
            {
                "current": {"checkpoint_id": "ckpt-1", "checkpoint_path": str(ckpt), **entry},
                "history": [{"checkpoint_id": "ckpt-0", "checkpoint_path": str(outside), **entry}],
            }
        )
    )
    new.parent.mkdir(parents=True)
    os.rename(old, new)
    state = ProductionRegistry(new / "serving" / "production.json").state()
    assert state.current.checkpoint_path == str(new / "checkpoints" / "ckpt-1")
    assert state.history[0].checkpoint_path == str(outside)  # not under the data root: as it was
    # the next write stores the relative form
    ProductionRegistry(new / "serving" / "production.json").promote(state.current)
    stored = json.loads((new / "serving" / "production.json").read_text())
    assert stored["current"]["checkpoint_path"] == "checkpoints/ckpt-1"
    assert stored["history"][0]["checkpoint_path"] == str(outside)


def test_records_naming_two_roots_are_read_under_the_roots_as_they_are_now(tmp_path: Path) -> None:
    from nexa_dagster.core.common import roots

    old = {"data_root": str(tmp_path / "a" / "data"), "results_root": str(tmp_path / "a" / "results")}
    new = {"data_root": str(tmp_path / "b" / "data"), "results_root": str(tmp_path / "b" / "results")}
    record = {
        "checkpoint_path": f"{old['data_root']}/checkpoints/c1",
        "report_json": f"{old['results_root']}/evaluation/reports/c1/report.json",
        "interval": (0.1, 0.2),
        "reason": "a sentence that mentions /nowhere/at/all and stays as it is",
        "outside": "/opt/models/teacher",
    }
    stored = roots.portable(record, old)
    assert stored["checkpoint_path"] == "{data_root}/checkpoints/c1"
    assert stored["report_json"] == "{results_root}/evaluation/reports/c1/report.json"
    assert stored["outside"] == "/opt/models/teacher" and stored["reason"] == record["reason"]
    here = roots.localize(stored, new)
    assert here["checkpoint_path"] == f"{new['data_root']}/checkpoints/c1"
    assert here["report_json"] == f"{new['results_root']}/evaluation/reports/c1/report.json"
    # a record written before (absolute, at the old place), the files moved: found by their tail
    (tmp_path / "a" / "data" / "checkpoints" / "c1").mkdir(parents=True)
    os.rename(tmp_path / "a", tmp_path / "b")
    assert roots.localize(record, new)["checkpoint_path"] == f"{new['data_root']}/checkpoints/c1"
    assert roots.localize(record, new)["outside"] == "/opt/models/teacher"  # found nowhere: unchanged
