"""scripts/clean_clone_times.py: issue 49's figures from clean clones, read from the outputs the commands print and
held against the goals of the machine kind they ran on (the whole script runs for minutes to an hour: what is
tested here is what it reads and decides; test_demo.py holds its reading against a real `make run` summary)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from support.repo_scripts import load_script

from nexa_dagster.core.common.config import REPO_ROOT


@pytest.fixture(scope="module")
def script() -> ModuleType:
    return load_script("scripts/clean_clone_times.py")


FLAGS = "fpu sse sse2 avx avx2 fma bmi2"
AVX512 = " avx512f avx512dq avx512cd avx512bw avx512vl"


def cpuinfo(name: str, family: int, model: int, flags: str, cores: int = 2) -> str:
    """/proc/cpuinfo as Linux writes it: one block per logical CPU, tab-aligned keys."""
    block = f"processor\t: {{i}}\nvendor_id\t: x\ncpu family\t: {family}\nmodel\t\t: {model}\nmodel name\t: {name}\n"
    return "\n".join(block.format(i=i) + f"flags\t\t: {flags}\n" for i in range(cores))


def test_the_amd_epyc_kinds_are_told_apart_by_avx512_and_the_xeon_by_its_name(script: ModuleType) -> None:
    avx2 = script.machine_kind(cpuinfo("AMD EPYC 7B12", 23, 49, FLAGS))
    assert avx2["kind"] == script.AVX2_AMD and not avx2["avx512f"] and avx2["cores"] == 2, avx2
    avx512 = script.machine_kind(cpuinfo("AMD EPYC", 25, 17, FLAGS + AVX512))
    assert avx512["kind"] == script.AVX512_AMD and avx512["model"] == "17", avx512
    xeon = script.machine_kind(cpuinfo("Intel(R) Xeon(R) Processor", 6, 207, FLAGS + AVX512))
    assert xeon["kind"] == script.XEON, xeon
    assert script.machine_kind(Path("/proc/cpuinfo").read_text())["cores"] == os.cpu_count()


def test_a_figure_over_its_kind_s_goal_is_not_met_and_a_kind_without_goals_has_none(
    script: ModuleType,
) -> None:
    figures = {"make_run_pipeline_s": 481, "suite_s": 1800.0, "test_fast_s": None, "fixed_share": 0.31}
    verdicts = script.against_goals(script.AVX2_AMD, figures)
    assert verdicts["make_run_pipeline_s"] == {"value": 481, "goal": 480, "met": False}
    assert verdicts["suite_s"]["met"]  # at the goal is within it
    assert not verdicts["test_fast_s"]["met"]  # not measured is not met
    assert not verdicts["fixed_share"]["met"]
    assert script.against_goals(script.XEON, figures) == {
        "make_run_pipeline_s": {"value": 481, "goal": 300, "met": False}
    }
    assert script.against_goals(script.AVX512_AMD, figures) == {}


def test_pytest_s_last_line_gives_the_suite_s_seconds_and_counts(script: ModuleType) -> None:
    # the end of the clean-clone suite of 2026-12-07 (a --durations table and a warnings summary before it)
    output = (
        "============================= slowest 25 durations =============================\n"
        "135.12s call     tests/e2e/test_real_teacher_day.py::test_a_day_with_smollm2_as_teacher_and_judge\n"
        "=============================== warnings summary ===============================\n"
        "========== 1077 passed, 5 skipped, 11 warnings in 1857.26s (0:30:57) ===========\n"
    )
    assert script.pytest_figures(output) == {
        "seconds": 1857.26,
        "counts": {"passed": 1077, "skipped": 5, "warning": 11},
    }
    failed = "==== 2 failed, 951 passed, 5 skipped, 1 error in 250.03s (0:04:10) ====\n"
    assert script.pytest_figures(output + failed)["counts"] == {
        "failed": 2,
        "passed": 951,
        "skipped": 5,
        "error": 1,
    }
    # killed before its end: no figure rather than the durations table's
    assert script.pytest_figures(output.rsplit("==========", 2)[0]) is None


def test_the_caches_start_empty_in_a_new_folder_as_ci_s_do(script: ModuleType) -> None:
    env, caches = script.clean_environment(REPO_ROOT)
    _, other = script.clean_environment(REPO_ROOT)
    try:
        assert caches.is_dir() and not any(caches.iterdir()) and other != caches
        names = ("XDG_CACHE_HOME", "NEXA_CACHE_DIR", "NEXA_MODEL_CACHE", "HF_HOME", "TORCH_EXTENSIONS_DIR")
        assert all(env[name].startswith(f"{caches}/") for name in (*names, "MPLCONFIGDIR")), env
        assert env["PATH"] == os.environ["PATH"]  # the rest of the environment is this process's
    finally:
        caches.rmdir(), other.rmdir()
    # one list of the caches: .ci/run sources the same file
    ci = subprocess.run(
        ["bash", "-c", "grep -c '^source .ci/empty_caches.sh$' .ci/run"], cwd=REPO_ROOT, capture_output=True
    )
    assert ci.stdout.strip() == b"1", ci


def test_a_step_is_timed_with_its_output_logged_and_its_exit_code_kept(
    script: ModuleType, tmp_path: Path
) -> None:
    step = script.run_step(
        script.Step("fails", "echo written; sleep 0.3; exit 3"), tmp_path, dict(os.environ), tmp_path
    )
    assert step.returncode == 3 and step.wall_s >= 0.3
    assert Path(step.log).read_text() == "written\n"
    assert 0.0 <= step.idle_share <= 1.0 and step.load_before >= 0.0


def test_make_run_s_summary_gives_the_pipeline_s_seconds_and_its_decisions(script: ModuleType) -> None:
    output = (
        "==> rl_training_job\n"
        + "=" * 78
        + "\nnexa-dagster tiny pipeline finished in 190 s (3 nights)\n"
        + "  daily_data_job 2026-11-20                  20.1 s\n"
        + "  production        c-20261122-0a1b\n"
    )
    figures = script.make_run_figures(output)
    assert (figures["pipeline_s"], figures["nights"]) == (190, 3)
    assert figures["summary"][-1] == "  production        c-20261122-0a1b"
    assert script.make_run_figures(output.replace("finished in", "failed after")) is None


def test_the_command_with_nothing_to_time_still_ends_with_its_machine_and_commit(tmp_path: Path) -> None:
    """The command line itself (arguments, the commit resolved, the machine read, the table, the JSON line), with
    every costly step left out: what a person on another machine kind runs first."""
    proc = subprocess.run(
        [sys.executable, "scripts/clean_clone_times.py", "--no-run", "--work", str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True).stdout
    assert report["commit"] == head.strip() and report["steps"] == [] and report["start_up_costs"] == {}
    assert report["machine"]["cores"] == os.cpu_count() and report["machine"]["kind"]
    assert set(report["figures"]) == {
        "make_run_pipeline_s",
        "clone_to_summary_s",
        "fixed_share",
        "suite_s",
        "test_fast_s",
    }
    assert "no goal on this kind" in proc.stdout or "NOT met" in proc.stdout  # nothing measured meets a goal
