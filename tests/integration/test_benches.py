"""Every script in ``bench/`` runs here at its smallest size, so a bench cannot rot unseen (issue 47: the serving
switch bench had failed on its default run since its API key became a file, and nothing noticed).

Each bench runs as a subprocess exactly as its docstring says to run it (``.venv/bin/python bench/<name>.py ...``,
from the repository root), with the smallest arguments it takes; its last line must be one JSON object holding the
figures the bench promises. The figures themselves mean nothing at this size (a speed-up over two requests): what
is checked is that every code path the bench takes still runs and still reports. The sizes and each bench's time
at that size (measured one at a time, the command in docs/testing.md) are the reason for each ``slow`` mark.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from nexa_dagster.core.common.config import REPO_ROOT

BENCH = REPO_ROOT / "bench"
WORK = "{work}"  # replaced by the test's own folder: no bench writes into a shared /tmp path here


@dataclass(frozen=True)
class Bench:
    """A bench's smallest run: its arguments, the figures its last line promises, and a time limit (about twice
    what it took on the shared 2-core machine at load 8-17, docs/testing.md: a loaded CI machine does not fail it,
    a hung bench does)."""

    args: tuple[str, ...]
    figures: frozenset[str]
    timeout_s: int
    slow: bool = False
    skip: str = ""  # why it cannot run in the suite, and where what it checks is run instead
    run_by: str = ""  # the test file that runs it instead, when one does
    env: dict[str, str] = field(default_factory=dict)


BENCHES: dict[str, Bench] = {
    "bench_local_batching.py": Bench(
        ("2", "2"),
        frozenset({"batched_tokens_per_s", "one_at_a_time_tokens_per_s", "speedup"}),
        timeout_s=240,
    ),
    "generation.py": Bench(
        ("--requests", "2", "--max-tokens", "2", "--rounds", "1"),
        frozenset({"speedup_c1", "speedup_c8", "speedup_c32", "sequential_tokens_per_s"}),
        timeout_s=400,
        slow=True,  # a `transformers serve` engine (17-25 s): in make test, not test-fast, as the table in docs said
    ),
    "nightly_cost.py": Bench(
        ("--days", "2", "--samples-per-day", "20", "--repeat", "1", "--workdir", WORK),
        frozenset({"night_1_s", "night_30_s", "growth", "baseline_growth", "shards_packed_night_30"}),
        timeout_s=400,
        # each night (both sides) in a fresh process importing the packaging stack (31.5 s in the suite at ad03fc0, the
        # slowest test of make test-fast): in make test, not test-fast
        slow=True,
    ),
    "packaging.py": Bench(
        ("--mb", "0.2", "--procs", "1", "--pack-size", "256", "--workdir", WORK),
        frozenset({"tokens_per_s", "baseline_tokens_per_s", "speedup", "packing_efficiency"}),
        timeout_s=300,
    ),
    "serving_batching.py": Bench(
        ("--clients", "1", "--seconds", "1", "--rounds", "1"),
        frozenset({"batching", "one_at_a_time", "rps_ratio", "p99_ratio", "rss_mb"}),
        timeout_s=300,
        slow=True,  # two `transformers serve` engines (about 25 s in all): in make test, not test-fast
    ),
    "shard_pool.py": Bench(
        ("--sizes", "120", "--repeats", "1"),
        frozenset({"workers", "pool_start_s", "sizes"}),
        timeout_s=240,
        slow=True,  # a pool's start (about 6 s) and the tiny model's build: in make test, not in test-fast
    ),
    "warm_workers.py": Bench(
        ("--rounds", "1", "--engine-rounds", "1"),
        frozenset(
            {
                *("cold_s", "warm_s", "speedup", "warm_python_start_s", "workers_to_pay_back"),
                *("engine_speedup", "model_fork_speedup_cold", "model_fork_speedup_warm"),
            }
        ),
        timeout_s=240,
        slow=True,  # three interpreters importing torch, transformers and DeepSpeed: in make test, not test-fast
    ),
    "rl.py": Bench(
        # --vllm no: the rollout engines are compared by hand (docs/measurements.md); test_vllm_rollouts runs vLLM's
        (
            "--work",
            WORK,
            "--prompts",
            "2",
            "--k",
            "2",
            "--max-new",
            "4",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--vllm",
            "no",
        ),
        frozenset({"rollout", "training", "prompts", "k"}),
        timeout_s=300,
    ),
    "train_throughput.py": Bench(
        (),
        frozenset(),
        timeout_s=0,
        skip="run at this size (--device cpu --seq 64 --micro-batch 1 --baseline-micro-batch 1 --steps 1 "
        "--warmup 0) by bench/gpu_lifecycle.py's throughput stage, which tests/e2e/test_demo.py::"
        "test_the_gpu_lifecycle_check_runs_its_stages_on_cpu runs and checks for every figure the bench promises",
        run_by="tests/e2e/test_demo.py",
    ),
    "preference.py": Bench(
        (
            *("--work", WORK, "--steps", "2", "--throughput-steps", "1", "--train-pairs", "16"),
            *("--val-pairs", "8", "--score-pairs", "8", "--micro", "2"),
        ),
        frozenset({"dpo_tokens_per_s", "sft_tokens_per_s", "trl_tokens_per_s", "heldout_reward_accuracy"}),
        timeout_s=480,
        slow=True,
    ),
    "serving_switch.py": Bench(
        # the canary held to 0.25 limits: decided in tens of requests rather than the defaults' ~1,070; what the
        # default limits cost is measured (docs/measurements.md), not checked here. The client pauses 50 ms after
        # each answer (~20 ms here): the same code paths, an engine a third busy instead of saturated while the
        # next one starts (43.8 against 60.6 CPU-s idle, docs/testing.md); the goal is decided only without pauses
        (
            *("--switches", "1", "--before-s", "1", "--clients", "1", "--max-tokens", "2", "--canaries", "1"),
            *("--canary-limits", "0.25", "--think-s", "0.05"),
        ),
        frozenset({"restrained", "switches", "clients", "canaries_asked"}),
        timeout_s=480,
        slow=True,
    ),
    "learning.py": Bench(
        ("--work", WORK, "--pretrain-steps", "1", "--sft-steps", "1", "--resamples", "100"),
        frozenset({"base_minus_scratch", "base_minus_scratch_ci", "continual_minus_base", "eval_examples"}),
        timeout_s=1000,
        slow=True,
    ),
    "executor_overhead.py": Bench(
        # one run of each executor on the day's first asset and its check: two steps, no model loaded
        ("--runs", "1", "--warmup", "0", "--assets", "raw_documents"),
        frozenset(
            {
                *("multiprocess", "forkserver", "forkserver_bare", "in_process"),
                *("orchestration_cpu_s_saved_per_run", "preload_vs_bare_machine_cpu"),
            }
        ),
        timeout_s=1500,
        slow=True,
    ),
    "threads.py": Bench(
        # every scenario's code runs in pair (several processes released at once) and busy (the hog beside them):
        # alone is pair's path with one process, two fresh torch imports (~13 s) that would check nothing more
        (
            "--prompts",
            "2",
            "--max-new-tokens",
            "2",
            "--batch",
            "2",
            "--rounds",
            "1",
            "--scenarios",
            "pair,busy",
        ),
        frozenset(
            {
                *(f"{s}_speedup" for s in ("pair", "busy")),
                *(f"{s}_cpu_ratio" for s in ("pair", "busy")),
                "pair_policy_threads",
                "pair_default_threads",
            }
        ),
        timeout_s=480,
        slow=True,
    ),
    "gpu_lifecycle.py": Bench(
        (),
        frozenset(),
        timeout_s=0,
        skip="needs the job files of a `make run` data root: tests/e2e/test_demo.py::"
        "test_the_gpu_lifecycle_check_runs_its_stages_on_cpu runs it with --device cpu on its make run world",
        run_by="tests/e2e/test_demo.py",
    ),
    "pipeline_profile.py": Bench(
        (),
        frozenset(),
        timeout_s=0,
        skip="profiles the runs of a `make run` instance: tests/e2e/test_demo.py::"
        "test_the_pipeline_profile_splits_each_make_run_job_into_its_work_and_fixed_costs runs it on its make run "
        "world (its --part data takes a daily_data_job: minutes)",
        run_by="tests/e2e/test_demo.py",
    ),
    "vllm_compile.py": Bench(
        (),
        frozenset(),
        timeout_s=0,
        skip="starts vLLM compiled twice (60-80 s each on 2 cores) for a measurement: the decision it informs, an "
        "eager engine on a CPU host, is tested by tests/integration/test_vllm_rollouts.py (vLLM's own account of "
        "its configuration in the engine's log)",
    ),
    "dagster_lower_bound.py": Bench(
        (),
        frozenset(),
        timeout_s=0,
        skip="installs dagster 1.13.0 from the package index into a venv of its own and runs ~15 test files "
        "under it: a check of a Dagster bump (scripts/check_dagster_lower_bound.sh), not of this code",
    ),
}


def test_every_bench_script_has_its_smallest_run_here() -> None:
    """A new bench is not forgotten: every script in bench/ is in the table above (and nothing else is)."""
    assert sorted(p.name for p in BENCH.glob("*.py")) == sorted(BENCHES)
    for name, bench in BENCHES.items():  # a bench run elsewhere is still run there
        if bench.run_by:
            assert f"bench/{name}" in (REPO_ROOT / bench.run_by).read_text(), (name, bench.run_by)


def test_every_bench_has_a_row_in_the_testing_docs() -> None:
    """docs/testing.md's table of the benches in the suite names each one (its smallest run, its time, its marker):
    four benches added after the table had none (shard_pool, threads, pipeline_profile, vllm_compile)."""
    docs = (REPO_ROOT / "docs" / "testing.md").read_text()
    table = docs.split("## The benches in the suite", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("`")[1] for line in table.splitlines() if line.startswith("| `")}
    assert sorted(set(BENCHES) - rows) == [], "benches without a row in docs/testing.md"


def last_json_line(stdout: str) -> dict[str, object]:
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert lines, "the bench printed nothing"
    figures = json.loads(lines[-1])
    assert isinstance(figures, dict), lines[-1]
    return figures


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            name,
            marks=[
                *([pytest.mark.slow] if bench.slow else []),
                pytest.mark.timeout(bench.timeout_s + 60),  # the subprocess's own limit fails it first
                *([pytest.mark.skip(reason=bench.skip)] if bench.skip else []),
            ],
        )
        for name, bench in BENCHES.items()
    ],
)
def test_a_bench_at_its_smallest_size_ends_with_one_json_object_of_its_figures(
    name: str, tmp_path: Path
) -> None:
    bench = BENCHES[name]
    args = [a.replace(WORK, str(tmp_path / "work")) for a in bench.args]
    # the bench's temporary files in a folder of its own under a short path: pytest's tmp_path is too long for
    # the Unix sockets the serving benches bind there (a socket path has 107 bytes at most: "AF_UNIX path too long")
    scratch = Path(tempfile.mkdtemp(prefix="nexa-bench-"))
    try:
        proc = subprocess.run(
            [sys.executable, str(BENCH / name), *args],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=bench.timeout_s,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(scratch), **bench.env},
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    figures = last_json_line(proc.stdout)
    assert bench.figures <= figures.keys(), (sorted(bench.figures - figures.keys()), figures)
