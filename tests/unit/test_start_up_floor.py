"""scripts/start_up_floor.py: which processes of a suite run started fresh and what their start-up cost, on rows
written as ``scripts/suite_cpu_profile.py --processes`` writes them."""

from __future__ import annotations

import json

import pytest
from support.repo_scripts import load_script

floor_script = load_script("scripts/start_up_floor.py")

ENGINE = "/venv/bin/python /repo/nexa_dagster/core/llm/transformers_engine.py serve tiny --device cpu"
WORKER = "/venv/bin/python -m nexa_dagster.core.training.worker --job job.json"
FORKSERVER = "/venv/bin/python -B -c from multiprocessing.forkserver import main; main(6, 7, [...])"
COSTS = {"transformers serve engine": 5.0, "training worker": 7.0, "Dagster process (code location)": 3.0}


def row(pid: int, parent: int, cmdline: str, cpu: float, created: float, kind: str = "") -> dict:
    return {
        "pid": pid,
        "ancestors": [parent, 1],
        "cmdline": cmdline,
        "cpu": cpu,
        "created": created,
        "kind": kind,
    }


def test_a_fork_pays_no_start_up_a_fresh_start_its_classs_at_most_its_own_cpu_and_a_server_all_of_it() -> (
    None
):
    rows = [
        row(10, 2, ENGINE, 6.5, 1.0),  # an engine: its class's 5.0
        row(11, 10, ENGINE, 40.0, 2.0),  # its model process, forked from it: none, however long it served
        # a second engine beside the first, the same command line: a fresh start, capped at its 4.0
        row(12, 2, ENGINE, 4.0, 3.0),
        row(13, 2, WORKER, 3.0, 4.0),  # a worker that failed early: at most the 3.0 it spent
        row(14, 2, FORKSERVER, 2.5, 5.0),  # a forkserver: importing is all it does
        row(15, 14, FORKSERVER, 9.0, 6.0),  # a step forked from it: none
        row(16, 2, "/bin/bash -c make", 1.0, 7.0),  # not a class: none
        # an install: an interpreter at work, not starting: none
        row(17, 2, "/venv/bin/python -m pip install x", 8.0, 8.0, kind=floor_script.INSTALL),
    ]
    result = floor_script.floor(rows, COSTS)
    assert result["start_up_cpu_s"] == pytest.approx(5.0 + 4.0 + 3.0 + 2.5)
    assert result["cpu_s"] == pytest.approx(74.0)
    classes = result["classes"]
    assert classes["transformers serve engine"]["started"] == 2
    assert classes["forked (inherits its imports)"] == {
        "started": 0,
        "forked": 2,
        "cpu_s": 49.0,
        "start_up_s": 0.0,
    }
    assert classes["other (none counted)"]["start_up_s"] == 0.0


def test_a_reused_pid_is_the_parent_that_held_it_when_the_child_started() -> None:
    rows = [
        row(20, 2, WORKER, 8.0, 1.0),  # a worker, gone by 2.0; its pid taken by an engine at 2.0
        row(20, 2, ENGINE, 6.0, 2.0),
        row(21, 20, ENGINE, 1.0, 3.0),  # the engine's model process: forked
        row(22, 20, WORKER, 8.0, 4.0),  # started by pid 20 after the engine took it: not a fork of the worker
    ]
    result = floor_script.floor(rows, COSTS)
    assert result["classes"]["forked (inherits its imports)"]["forked"] == 1
    assert result["classes"]["training worker"]["started"] == 2


def test_a_class_whose_imports_were_not_measured_counts_none() -> None:
    """Costs measured where vLLM is not installed have no vLLM figure: its processes count no start-up."""
    vllm = "/cache/vllm-0.32.0-cpu/bin/python -m vllm.entrypoints.openai.api_server --model m"
    result = floor_script.floor([row(30, 2, vllm, 12.0, 1.0), row(31, 2, ENGINE, 6.0, 2.0)], COSTS)
    assert result["classes"]["vLLM process"] == {"started": 1, "forked": 0, "cpu_s": 12.0, "start_up_s": 0.0}
    assert result["start_up_cpu_s"] == 5.0


def test_rows_without_pids_take_a_child_by_its_parent_s_ancestry() -> None:
    rows = [
        {k: v for k, v in r.items() if k != "pid"}
        for r in (row(10, 2, ENGINE, 6.0, 1.0), row(11, 10, ENGINE, 2.0, 2.0))
    ]
    rows[1]["ancestors"] = [10, 2, 1]
    assert floor_script.forked(rows) == {1}


def test_the_command_measures_a_class_s_imports_and_ends_with_one_json_object(tmp_path, capsys) -> None:
    classes = [
        floor_script.StartClass("json", "x", "import json"),
        floor_script.StartClass("gone", "y", "import nx_"),
    ]
    costs = floor_script.measure(classes, repeats=1)
    assert set(costs) == {"json"} and 0.0 < costs["json"] < 2.0  # an import that fails here is left out
    processes = tmp_path / "processes.jsonl"
    processes.write_text(
        "".join(json.dumps(r) + "\n" for r in (row(10, 2, ENGINE, 6.5, 1.0), row(11, 10, ENGINE, 1.0, 2.0)))
    )
    (tmp_path / "costs.json").write_text(json.dumps(COSTS))
    assert floor_script.main(["--processes", str(processes), "--costs", str(tmp_path / "costs.json")]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["start_up_cpu_s"] == 5.0 and last["costs"] == COSTS
    # without a processes file: the costs alone, what clean_clone_times.py records of a machine kind
    assert floor_script.main(["--costs", str(tmp_path / "costs.json")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"costs": COSTS}
