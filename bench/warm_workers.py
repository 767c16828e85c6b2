"""A worker's start from a fresh interpreter against one forked from the warm Python (``core/cluster/warm_python.py``,
``LocalGPUCluster.warm_start``, what ``make run`` does), on the same work in the same run.

Run (from the repo root)::

    HF_HUB_OFFLINE=1 DS_ACCELERATOR=cpu .venv/bin/python bench/warm_workers.py

Each launch runs a probe module as ``python -m`` runs a worker: it imports the training and the evaluation worker's
modules (and with them torch, transformers, DeepSpeed's loop), loads the shipped-recipe tiny model with the
evaluation worker's client and scores one batch, then exits: what every worker does before its first line of its
own work. ``--rounds`` launches each way, in turn (cold, warm, cold, ...), with the same environment and folder; the
figures are wall seconds from launch to exit (medians), the warm Python's own start once (a launcher pays it once,
beside other work), and after how many workers it has paid for itself.

``--engine-rounds`` then does the same for a deployment's smoke engine (``smoke_test_in_temporary_engine``, what
``model_deployment`` runs without a serving service): a ``transformers serve`` of the tiny model on a Unix socket,
started cold and forked from the same warm Python, each with the model's own process spawned (transformers' own
start: a fresh interpreter) and forked from the server (``core/llm/transformers_engine.py``, the default), the four
in turn; the figure is its start to healthy (``ready_s``, the span ``fixed/smoke_engine_start`` of the pipeline
profile), medians. Both sides run under the environment
``make run``'s local backend gives its workers (``LocalGPUCluster.worker_env``). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# run as a script, bench/ is sys.path[0] and bench/packaging.py would shadow the installed `packaging`
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from nexa_dagster.core.cluster import warm_python  # noqa: E402
from nexa_dagster.core.serving.smoke import smoke_test_in_temporary_engine  # noqa: E402
from nexa_dagster.core.tiny.model import build_tiny_causal_lm  # noqa: E402
from nexa_dagster.resources.gpu_cluster.local import WARM_PRELOAD, LocalGPUCluster  # noqa: E402

PROBE = """
import sys
import nexa_dagster.core.training.worker
import nexa_dagster.core.evaluation.worker
from nexa_dagster.core.llm.local import LocalTransformersClient
from nexa_dagster.core.llm.base import SamplingParams

with LocalTransformersClient(sys.argv[1], batch_size=4, device="cpu") as client:
    client.chat_many([[{"role": "user", "content": "What does a list do?"}]] * 4, SamplingParams(max_tokens=4))
"""


def cold(python: str, folder: Path, checkpoint: Path, env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run([python, "-m", "warm_probe", str(checkpoint)], cwd=folder, env=env, check=True)
    return time.perf_counter() - started


def warm(pool: warm_python.WarmPython, folder: Path, checkpoint: Path, env: dict[str, str]) -> float:
    started = time.perf_counter()
    code = pool.spawn("warm_probe", [str(checkpoint)], folder, env).wait()
    if code != 0:
        raise SystemExit(f"the forked probe exited with {code}")
    return time.perf_counter() - started


class Said(logging.Handler):
    """What the smoke test's engine said in the log (whether it forked, or why it started cold)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def engine_ready_s(
    folder: Path, checkpoint: Path, pool: warm_python.WarmPython | None, model_process: str, i: int
) -> float:
    """One smoke test in a temporary engine (forked from ``pool``, or cold; its model's process started by
    ``model_process``): its start to healthy, in seconds. Each side checks from the logs that it ran as named."""
    said, logger = Said(), logging.getLogger(f"warm-bench-engine-{i}")
    logger.addHandler(said)
    logger.setLevel(logging.INFO)
    manifest = smoke_test_in_temporary_engine(
        checkpoint,
        "bench",
        folder / f"engine-{i}",
        max_tokens=4,
        logger=logger,
        warm=pool,
        model_process=model_process,
    )
    if manifest.status != "ok":
        raise SystemExit(f"the smoke engine failed: {manifest.error}")
    forked = any("engine forked from the warm Python" in line for line in said.lines)
    if forked != (pool is not None):
        raise SystemExit(f"the engine was to fork: {pool is not None}; it said: {said.lines}")
    engine_log = "".join(p.read_text() for p in (folder / f"engine-{i}").glob("*-serve-*.log"))
    if ("model process forked from the engine" in engine_log) != (model_process == "fork"):
        raise SystemExit(
            f"the model's process was to start by {model_process}; the engine's log:\n{engine_log}"
        )
    return manifest.ready_s


def in_turn(
    what: str, rounds: int, cold_s: Callable[[], float], warm_s: Callable[[], float]
) -> tuple[float, float]:
    """``rounds`` measurements each way, in turn (cold, warm, cold, ...: a machine's drift falls on both), each
    round printed; their medians (cold, warm)."""
    times: dict[str, list[float]] = {"cold": [], "warm": []}
    for i in range(rounds):
        times["cold"].append(cold_s())
        times["warm"].append(warm_s())
        print(
            f"{what} round {i + 1}: cold {times['cold'][-1]:.2f} s, warm {times['warm'][-1]:.2f} s",
            flush=True,
        )
    return statistics.median(times["cold"]), statistics.median(times["warm"])


def engine_rounds(
    folder: Path, checkpoint: Path, pool: warm_python.WarmPython, rounds: int
) -> dict[str, float]:
    """The smoke engine four ways, in turn: its server cold or forked from ``pool``, and the model's process it
    starts spawned (transformers' own start, the project's before) or forked from the server (its default)."""
    engines = iter(range(4 * rounds))  # each engine its own folder
    times: dict[str, list[float]] = {}
    for i in range(rounds):
        for server, start in (("cold", "spawn"), ("cold", "fork"), ("warm", "spawn"), ("warm", "fork")):
            ready_s = engine_ready_s(
                folder, checkpoint, pool if server == "warm" else None, start, next(engines)
            )
            times.setdefault(f"{server}_{start}", []).append(ready_s)
        print(
            f"engine round {i + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True
        )
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        **{f"engine_{k}_s": round(v, 3) for k, v in med.items()},
        "engine_cold_s": round(med["cold_fork"], 3),  # the defaults: the model's process forked
        "engine_warm_s": round(med["warm_fork"], 3),
        "engine_speedup": round(med["cold_fork"] / med["warm_fork"], 2),
        # what forking the model's process saves, the server started either way
        "model_fork_speedup_cold": round(med["cold_spawn"] / med["cold_fork"], 2),
        "model_fork_speedup_warm": round(med["warm_spawn"] / med["warm_fork"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--engine-rounds", type=int, default=3, help="smoke engines each way (0: none)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="warm-bench-") as tmp:
        folder = Path(tmp)
        (folder / "warm_probe.py").write_text(PROBE)
        checkpoint = build_tiny_causal_lm(folder / "tiny", seed=0)
        # what the local backend hands a worker (its kind's threads, WORKER_ENV), the probe's folder on the path of
        # every side (set here, so the engine's environment, which the settings build, has it too)
        os.environ["PYTHONPATH"] = str(folder)
        cluster = LocalGPUCluster()
        env = cluster.worker_env("evaluation", cluster.launch_env())
        python = sys.executable
        started = time.perf_counter()
        pool = warm_python.WarmPython(python, warm_python.import_time_environment(env), WARM_PRELOAD).start()
        if not pool.ready():
            raise SystemExit("the warm Python did not start")
        warm_start_s = time.perf_counter() - started
        try:
            if pool.differs(env):
                raise SystemExit(
                    f"the probe's environment differs from the warm Python's: {pool.differs(env)}"
                )
            cold_s, warm_s = in_turn(
                "worker",
                args.rounds,
                lambda: cold(python, folder, checkpoint, env),
                lambda: warm(pool, folder, checkpoint, env),
            )
            engines = (
                engine_rounds(folder, checkpoint, pool, args.engine_rounds) if args.engine_rounds else {}
            )
        finally:
            pool.close()
    saved = cold_s - warm_s
    result = {
        "rounds": args.rounds,
        "cold_s": round(cold_s, 3),
        "warm_s": round(warm_s, 3),
        "speedup": round(cold_s / warm_s, 2),
        "warm_python_start_s": round(warm_start_s, 3),
        # the warm Python's start is paid once; each forked worker saves cold - warm
        "workers_to_pay_back": round(warm_start_s / saved, 2) if saved > 0 else None,
        "engine_rounds": args.engine_rounds,
        **engines,
        "cpus": os.cpu_count(),
        "load_after": round(os.getloadavg()[0], 2),
    }
    print(
        f"median of {args.rounds}: cold {cold_s:.2f} s, warm {warm_s:.2f} s ({result['speedup']}x); the warm "
        f"Python's own start {warm_start_s:.2f} s, paid back after {result['workers_to_pay_back']} workers"
    )
    if engines:
        print(
            f"smoke engine to healthy, median of {args.engine_rounds}: cold {engines['engine_cold_s']:.2f} s, "
            f"forked {engines['engine_warm_s']:.2f} s ({engines['engine_speedup']}x); with the model's process "
            f"spawned as transformers does: cold {engines['engine_cold_spawn_s']:.2f} s, forked "
            f"{engines['engine_warm_spawn_s']:.2f} s"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
