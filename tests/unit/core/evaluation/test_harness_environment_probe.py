"""lm-evaluation-harness ends every ``simple_evaluate`` by recording the machine through torch's ``collect_env``
(``pip list`` and system probes in subprocesses, ~1 CPU-s a run); both harness paths run it without that probe
(``lm_eval_on_vllm.without_environment_probe``): the record says it was not collected, nothing is started, and
torch's probe is back afterwards."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
import torch.utils.collect_env as collect_env
from lm_eval.loggers.utils import add_env_info

from nexa_dagster.core.evaluation.lm_eval_on_vllm import without_environment_probe


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every subprocess started, by its arguments (the processes themselves still run)."""
    calls: list[Any] = []
    popen = subprocess.Popen

    class Recorded(popen):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            calls.append(args[0] if args else kwargs.get("args"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    return calls


def test_the_harness_records_the_environment_without_probing_the_machine(started: list[Any]) -> None:
    probe = collect_env.get_pretty_env_info
    record: dict[str, Any] = {}
    with without_environment_probe():
        add_env_info(record)  # what simple_evaluate calls last
    assert started == [], started
    assert record["pretty_env_info"].startswith("not collected"), record
    # the harness's own records stay
    assert record["lm_eval_version"] and record["transformers_version"], record
    assert collect_env.get_pretty_env_info is probe


def test_without_it_the_harness_starts_the_probes(started: list[Any]) -> None:
    """The other side of the same measurement: the record the harness makes by itself runs ``pip list``."""
    record: dict[str, Any] = {}
    add_env_info(record)
    assert any("pip" in str(call) for call in started), started
    assert not record["pretty_env_info"].startswith("not collected")
