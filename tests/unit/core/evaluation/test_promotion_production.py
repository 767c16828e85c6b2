"""The production pointer (``ProductionRegistry``: promote, history, rollback, paths relative to the data root) and
what serving may deploy (``held_back_because``, ``trained_from_scratch_without_base``)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from nexa_dagster.core.common.artifacts import EvalReport
from nexa_dagster.core.evaluation.promotion import (
    ProductionEntry,
    ProductionRegistry,
    ProductionState,
    held_back_because,
    trained_from_scratch_without_base,
)


def _entry(checkpoint_id: str, root: Path) -> ProductionEntry:
    return ProductionEntry(
        checkpoint_id=checkpoint_id,
        checkpoint_path=str(root / "checkpoints" / checkpoint_id),
        metric="eval_loss",
    )


def test_promotions_keep_the_earlier_models_and_rollback_restores_them(tmp_path: Path) -> None:
    data = tmp_path / "data"
    pointer = data / "serving" / "production.json"
    assert (
        ProductionRegistry(pointer).state() == ProductionState()
        and ProductionRegistry(pointer).current() is None
    )
    first = ProductionRegistry(pointer).promote(_entry("ckpt-a", data))
    assert first.current.checkpoint_id == "ckpt-a" and first.history == []
    ProductionRegistry(pointer).promote(_entry("ckpt-b", data))
    again = ProductionRegistry(pointer).promote(
        _entry("ckpt-b", data)
    )  # re-promoting production: no new history
    assert again.current.checkpoint_id == "ckpt-b" and [h.checkpoint_id for h in again.history] == ["ckpt-a"]

    state = ProductionRegistry(pointer).state()  # read back: the paths where the checkpoints are now
    assert state.current.checkpoint_path == str(data / "checkpoints" / "ckpt-b")
    assert [h.checkpoint_path for h in state.history] == [str(data / "checkpoints" / "ckpt-a")]
    stored = json.loads(pointer.read_text())  # stored: their places in the data root
    assert stored["current"]["checkpoint_id"] == "ckpt-b"
    assert stored["current"]["checkpoint_path"] == "checkpoints/ckpt-b"
    assert [h["checkpoint_path"] for h in stored["history"]] == ["checkpoints/ckpt-a"]

    back = ProductionRegistry(pointer).rollback()
    assert back.current.checkpoint_id == "ckpt-a" and back.history == []
    assert ProductionRegistry(pointer).current() == _entry("ckpt-a", data).model_copy(
        update={"promoted_at": back.current.promoted_at}
    )
    with pytest.raises(RuntimeError) as nothing:
        ProductionRegistry(pointer).rollback()
    assert str(nothing.value) == f"nothing to roll back to: {pointer} has no earlier production model"


def test_a_pointer_kept_apart_from_its_data_root_names_checkpoints_relative_to_that_root(
    tmp_path: Path,
) -> None:
    models, pointer = tmp_path / "models", tmp_path / "elsewhere" / "serving" / "production.json"
    registry = ProductionRegistry(pointer, data_root=models)
    registry.promote(_entry("ckpt-a", models))
    assert json.loads(pointer.read_text())["current"]["checkpoint_path"] == "checkpoints/ckpt-a"
    assert registry.current().checkpoint_path == str(models / "checkpoints" / "ckpt-a")


def test_a_pointer_with_history_but_no_current_model_reads_as_none_in_production(tmp_path: Path) -> None:
    data = tmp_path / "data"
    pointer = data / "serving" / "production.json"
    pointer.parent.mkdir(parents=True)
    earlier = {"checkpoint_id": "ckpt-a", "checkpoint_path": "checkpoints/ckpt-a", "metric": "eval_loss"}
    pointer.write_text(json.dumps({"current": None, "history": [earlier]}))
    state = ProductionRegistry(pointer).state()
    assert state.current is None and state.history[0].checkpoint_path == str(data / "checkpoints" / "ckpt-a")
    assert ProductionRegistry(pointer).rollback().current.checkpoint_id == "ckpt-a"


def _report(
    decision: str | None = "promote",
    against: str | None = "p",
    reason: str | None = "why",
    parent: str | None = "p",
    asked: str | None = "production",
) -> EvalReport:
    return EvalReport(
        checkpoint_id="c",
        checkpoint_path="/c",
        perplexity=2.0,
        num_heldout_prompts=0,
        gate_decision=decision,
        gate_reason=reason,
        production_checkpoint_id=against,
        report_json="-",
        report_markdown="-",
        parent=parent,
        init_requested=asked,
    )


PROD = ProductionEntry(checkpoint_id="p", checkpoint_path="/p", metric="eval_loss")


def test_serving_deploys_a_promotion_made_against_the_current_production_model() -> None:
    assert held_back_because("c", _report(), PROD) is None
    assert held_back_because("c", _report(against=None), None) is None  # the first model
    assert held_back_because("c", _report(against="p"), None) is None  # production since removed
    now_c = ProductionEntry(checkpoint_id="c", checkpoint_path="/c", metric="eval_loss")
    assert held_back_because("c", _report(against="p"), now_c) is None  # it is production already


def test_serving_says_why_it_does_not_deploy_a_checkpoint() -> None:
    assert held_back_because("c", _report(decision=None), PROD) == (
        "its evaluation predates the paired promotion gate; evaluate it again"
    )
    assert (
        held_back_because("c", _report(decision="hold back"), PROD) == "the promotion gate held it back (why)"
    )
    assert held_back_because("c", _report(decision="insufficient evidence", reason=None), PROD) == (
        "the promotion gate held it back (insufficient evidence)"
    )
    assert held_back_because("c", _report(against="q"), PROD) == (
        "production is now p, not q as when it was evaluated; evaluate it again to compare it with the current "
        "production model"
    )
    assert held_back_because("c", _report(against=None), PROD).startswith("production is now p, not none as ")
    scratch = _report(parent="scratch", asked="base")
    assert held_back_because("c", scratch, PROD) == trained_from_scratch_without_base(scratch)


@pytest.mark.parametrize("asked", ["base", "production"])
def test_a_checkpoint_that_fell_back_to_random_weights_is_not_served(asked: str) -> None:
    assert trained_from_scratch_without_base(SimpleNamespace(parent="scratch", init_requested=asked)) == (
        f"trained from scratch: no base model yet (init_from: {asked}, but neither a production nor a base model "
        "existed when it trained); pretrain one with pretraining_job, then train again"
    )


@pytest.mark.parametrize(
    "report",
    [
        SimpleNamespace(parent="scratch", init_requested="scratch"),  # asked to start from scratch
        SimpleNamespace(parent="base", init_requested="base"),  # started from what it asked for
        SimpleNamespace(parent="p", init_requested="production"),
        SimpleNamespace(),  # a record that says neither
    ],
)
def test_a_checkpoint_that_started_where_it_asked_is_not_refused_for_it(report: SimpleNamespace) -> None:
    assert trained_from_scratch_without_base(report) is None
