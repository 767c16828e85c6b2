"""The canary's state on disk: saved and resumed as it was, never two canaries at once, and a lost, unreadable or
wrong file a named error (the file and what is wrong), never a guess."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nexa_dagster.core.serving.canary import CanaryDecision, CanaryPolicy, CanaryState, decide
from nexa_dagster.core.serving.canary_store import CANARY_FILE, Canary, CanaryStateError, begin, load, save

POLICY = CanaryPolicy(share=0.2, max_quality_drop=None)


def _canary() -> Canary:
    state = CanaryState.start("ckpt-stable", "ckpt-new", POLICY, now=100.0)
    for i in range(40):
        state.record("stable" if i % 5 else "canary", POLICY, failed=i % 13 == 0, latency_s=0.1 + i / 100)
    return Canary("blue", "green", POLICY, state)


def test_a_canary_is_resumed_from_its_file_as_it_was(tmp_path: Path) -> None:
    canary = _canary()
    save(canary, tmp_path)
    again = load(tmp_path)
    assert again is not None and again.running and again.policy == POLICY
    assert (again.stable_colour, again.canary_colour) == ("blue", "green")
    assert decide(again.state, again.policy, 200.0) == decide(canary.state, POLICY, 200.0)
    assert again.state.thresholds == canary.state.thresholds
    assert load(tmp_path / "never") is None


def test_the_pointer_entry_a_promotion_writes_survives_a_restart_relative_to_the_data_root(
    tmp_path: Path,
) -> None:
    """A promoted canary whose pointer move a restart cut short gets it then (``_settle_canary``): that needs the
    entry back from the file. Stored relative to the data root (the folder's parent), as production.json does, so
    a moved data root still finds the checkpoint; a path outside it stays as it was."""
    data_root = tmp_path / "data"
    folder = data_root / "serving"
    checkpoint = data_root / "checkpoints" / "ckpt-new"
    checkpoint.mkdir(parents=True)
    entry = {
        "checkpoint_id": "ckpt-new",
        "checkpoint_path": str(checkpoint),
        "metric": "eval_loss",
        "value": 1.0,
    }
    canary = _canary()
    canary.entry = entry
    canary.conclude(CanaryDecision("promote", "non-inferior on every figure", ()))
    save(canary, folder)
    stored = json.loads((folder / CANARY_FILE).read_text())["entry"]
    assert stored["checkpoint_path"] == "checkpoints/ckpt-new"
    again = load(folder)
    assert again is not None and again.entry == entry and again.verdict == "promote"
    moved = tmp_path / "moved"
    data_root.rename(moved)
    assert load(moved / "serving").entry["checkpoint_path"] == str(moved / "checkpoints" / "ckpt-new")
    outside = {**entry, "checkpoint_path": "/elsewhere/ckpt-new"}
    canary.entry = outside
    save(canary, moved / "serving")
    assert load(moved / "serving").entry == outside
    raw = json.loads((moved / "serving" / CANARY_FILE).read_text())
    (moved / "serving" / CANARY_FILE).write_text(json.dumps({**raw, "entry": [1]}))
    with pytest.raises(CanaryStateError, match="entry must be an object"):
        load(moved / "serving")


def test_a_second_canary_is_refused_while_one_runs_and_allowed_once_it_is_decided(tmp_path: Path) -> None:
    begin(_canary(), tmp_path)
    before = (tmp_path / CANARY_FILE).read_text()
    with pytest.raises(CanaryStateError, match="a canary of ckpt-new against ckpt-stable is running"):
        begin(_canary(), tmp_path)
    assert (tmp_path / CANARY_FILE).read_text() == before
    decided = load(tmp_path)
    decided.conclude(CanaryDecision("roll back", "canary worse: failed", ()))
    save(decided, tmp_path)
    assert load(tmp_path).verdict == "roll back"
    begin(_canary(), tmp_path)  # the next canary
    assert load(tmp_path).running


def test_continue_does_not_conclude_a_canary() -> None:
    with pytest.raises(ValueError, match="not 'continue'"):
        _canary().conclude(CanaryDecision("continue", "undecided", ()))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "cannot read the canary's state"),
        ("[1, 2]", "is not an object"),
        ('{"stable_colour": "blue"}', "lacks canary_colour, policy, state, verdict, reason"),
    ],
)
def test_a_corrupt_state_file_is_a_named_error(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / CANARY_FILE).write_text(content)
    with pytest.raises(CanaryStateError, match=message) as e:
        load(tmp_path)
    assert str(tmp_path / CANARY_FILE) in str(e.value)


def test_a_state_file_with_a_bad_policy_names_it(tmp_path: Path) -> None:
    save(_canary(), tmp_path)
    data = json.loads((tmp_path / CANARY_FILE).read_text())
    data["policy"]["share"] = 1.5
    (tmp_path / CANARY_FILE).write_text(json.dumps(data))
    with pytest.raises(CanaryStateError, match=r"(?s)bad policy or state: .*share"):
        load(tmp_path)
