"""A serving engine with and without continuous batching, under the same clients: what `nexa-dagster serve
--continuous-batching` (the default) buys a CPU host.

Run: .venv/bin/python bench/serving_batching.py [--model tiny | --model DIR] [--clients 1,2,4] [--seconds 20]
     [--rounds 2]

The engine is started as the serving service starts one (``ManagedServer``: ``transformers serve`` through the
project's engine script, on a Unix socket, with the engine's thread policy), once with ``--continuous-batching`` and
once without, in turns (``--rounds``: on/off, then off/on, ...), so that a machine whose load drifts moves both.
Against each, for each ``--clients`` count, that many clients send chat requests without pause for ``--seconds``:
prompts drawn from a fixed list of different lengths, ``max_tokens`` 8, 16 or 32 at random, greedy (the same
requests on both sides: each client's draws are seeded by its number). Per side and client count, over the rounds:
requests answered (n), failed, requests/s, latency p50 and p99 (nearest rank), the engine's CPU-s per request (its
whole process tree, psutil) and its resident memory (the KV cache batching reserves: 5 % of a CPU host's memory).
``--model tiny`` (the default) builds the project's tiny model; a real one (SmolLM2-135M-Instruct: ``nexa-dagster
real-model``) is what the figures in docs/measurements.md are for.

The load average (what `uptime` says) is read at the start and the end. Last line: one JSON object with the figures,
including ``rps_ratio`` and ``p99_ratio`` (batching over one at a time) at the largest client count.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# run as a script, bench/ is sys.path[0] and its other scripts (bench/packaging.py) would shadow installed modules
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import httpx  # noqa: E402
import psutil  # noqa: E402

from nexa_dagster.core.llm.managed_server import ManagedServer  # noqa: E402

PROMPTS = [
    "Hello!",
    "What is the capital of France?",
    "Name a prime number larger than ten.",
    "Why is the sky blue?",
    "Write one sentence about rivers and the towns that grew beside them.",
    "Explain photosynthesis briefly, in a few words, for a child who is seven years old and likes plants.",
]
MAX_TOKENS = (8, 16, 32)


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def engine_cpu_s(pid: int) -> float:
    total = 0.0
    for proc in _tree(pid):
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def engine_rss_mb(pid: int) -> int:
    total = 0
    for proc in _tree(pid):
        with contextlib.suppress(psutil.Error):
            total += proc.memory_info().rss
    return total // 2**20


def drive(socket_path: str, clients: int, seconds: float) -> tuple[list[float], int, float]:
    """``clients`` clients without pause for ``seconds``: the latencies of the answered requests, the failures, the
    wall time."""
    latencies: list[float] = []
    failed = [0]
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def client(k: int) -> None:
        draw = random.Random(k)
        with httpx.Client(transport=httpx.HTTPTransport(uds=socket_path), timeout=300) as http:
            while time.monotonic() < stop:
                body = {
                    "model": "m",
                    "messages": [{"role": "user", "content": draw.choice(PROMPTS)}],
                    "max_tokens": draw.choice(MAX_TOKENS),
                    "temperature": 0,
                }
                t0 = time.monotonic()
                try:
                    ok = http.post("http://engine/v1/chat/completions", json=body).status_code == 200
                except httpx.HTTPError:
                    ok = False
                with lock:
                    if ok:
                        latencies.append(time.monotonic() - t0)
                    else:
                        failed[0] += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, failed[0], time.monotonic() - t0


def nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.999999) - 1))]


def one_side(model: Path, batching: bool, clients: list[int], seconds: float, work: Path) -> dict[int, Any]:
    """One engine (batching or not) under each client count: the raw figures per count."""
    with tempfile.TemporaryDirectory(
        prefix="nexa-sock-"
    ) as short:  # a socket's path has ~100 characters at most
        return _under_load(model, batching, clients, seconds, work, Path(short) / "engine.sock")


def _under_load(
    model: Path, batching: bool, clients: list[int], seconds: float, work: Path, socket: Path
) -> dict[int, Any]:
    server = ManagedServer(
        model,
        work / f"engine-{'on' if batching else 'off'}",
        engine="transformers",
        socket_path=socket,
        continuous_batching=batching,
        served_model_name="m",
    )
    server.start(attempts=1)
    try:
        drive(str(socket), 1, 1.0)  # a settling second: the first requests warm the engine up
        out = {}
        for k in clients:
            cpu0 = engine_cpu_s(server.process.pid)
            latencies, failed, wall = drive(str(socket), k, seconds)
            cpu = engine_cpu_s(server.process.pid) - cpu0
            out[k] = {
                "latencies": latencies,
                "failed": failed,
                "wall_s": wall,
                "cpu_s": cpu,
                "rss_mb": engine_rss_mb(server.process.pid),
            }
            print(
                f"  batching {'on ' if batching else 'off'} clients {k}: {len(latencies)} answered, "
                f"{len(latencies) / wall:.2f}/s",
                flush=True,
            )
        return out
    finally:
        server.stop()


def summarise(runs: list[dict[int, Any]]) -> dict[str, Any]:
    """The rounds of one side and client count together."""
    latencies = [x for r in runs for x in r["latencies"]]
    n = len(latencies)
    return {
        "n": n,
        "failed": sum(r["failed"] for r in runs),
        "rps": round(n / sum(r["wall_s"] for r in runs), 3),
        "p50_s": round(nearest_rank(latencies, 0.5), 4) if n else None,
        "p99_s": round(nearest_rank(latencies, 0.99), 4) if n else None,
        "cpu_s_per_request": round(sum(r["cpu_s"] for r in runs) / max(n, 1), 4),
        "rss_mb": max(r["rss_mb"] for r in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny (built here) or a Hugging Face model directory")
    parser.add_argument("--clients", default="1,2,4", help="client counts, comma-separated")
    parser.add_argument(
        "--seconds", type=float, default=20.0, help="how long each client count runs, per side"
    )
    parser.add_argument("--rounds", type=int, default=2, help="on/off pairs, the order alternating")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    clients = [int(c) for c in args.clients.split(",")]
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="nexa-bench-batching-") as tmp:
        work = Path(tmp)
        if args.model == "tiny":
            from nexa_dagster.core.tiny.model import build_tiny_causal_lm  # only for the default model

            model = build_tiny_causal_lm(work / "models" / "tiny-bench")
        else:
            model = Path(args.model)
        sides: dict[bool, list[dict[int, Any]]] = {True: [], False: []}
        for r in range(args.rounds):
            for batching in (True, False) if r % 2 == 0 else (False, True):
                print(f"round {r + 1}/{args.rounds}, batching {'on' if batching else 'off'}", flush=True)
                sides[batching].append(one_side(model, batching, clients, args.seconds, work / f"r{r}"))
    figures = {
        side: {str(k): summarise([run[k] for run in sides[batching]]) for k in clients}
        for side, batching in (("batching", True), ("one_at_a_time", False))
    }
    top = str(max(clients))
    print(
        f"{'clients':>7} {'side':>13} {'n':>5} {'failed':>6} {'req/s':>7} {'p50 s':>7} {'p99 s':>7} {'CPU-s/req':>9}"
    )
    for k in clients:
        for side in ("batching", "one_at_a_time"):
            f = figures[side][str(k)]
            print(
                f"{k:>7} {side:>13} {f['n']:>5} {f['failed']:>6} {f['rps']:>7.2f} {f['p50_s'] or 0:>7.3f} "
                f"{f['p99_s'] or 0:>7.3f} {f['cpu_s_per_request']:>9.3f}"
            )
    on, off = figures["batching"][top], figures["one_at_a_time"][top]
    result = {
        "model": args.model,
        "clients": clients,
        "seconds": args.seconds,
        "rounds": args.rounds,
        **figures,
        "rps_ratio": round(on["rps"] / off["rps"], 3) if off["rps"] else None,
        "p99_ratio": round(on["p99_s"] / off["p99_s"], 3) if on["p99_s"] and off["p99_s"] else None,
        "rss_mb": {"batching": on["rss_mb"], "one_at_a_time": off["rss_mb"]},
        "load": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
