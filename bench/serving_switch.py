"""The serving endpoint through a blue/green switch: throughput, latency and failures before, during and after.

Run: .venv/bin/python bench/serving_switch.py [--phase-s 20] [--clients 2] [--max-tokens 8]

Builds two tiny models (other seeds, other answers), puts the first in production and starts the serving service
(`nexa-dagster serve`: HAProxy in front of `transformers serve`) on a temporary data root. Then, with ``--clients``
clients sending chat requests without pause (plain httpx, no retry: a failure counts):

- ``direct``: the serving engine reached directly, bypassing HAProxy (the baseline, same run, same engine);
- ``before``: the same through the stable endpoint;
- ``during``: from the switch request to its answer (the new engine starts, answers its smoke request, takes
  traffic while the old one drains and stops);
- ``after``: through the endpoint, on the new engine.

Each phase reports requests/s, latency p50/p99 and failed requests; ``switch_s`` is the switch's own duration.
Last line: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# run as a script, bench/ is sys.path[0] and its other scripts (bench/packaging.py) would shadow installed modules
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import httpx  # noqa: E402

from nexa_dagster.core.common.config import REPO_ROOT  # noqa: E402
from nexa_dagster.core.common.net import free_port  # noqa: E402
from nexa_dagster.core.evaluation.promotion import ProductionEntry, ProductionRegistry  # noqa: E402
from nexa_dagster.core.serving.client import ServingServiceClient  # noqa: E402
from nexa_dagster.core.tiny.model import build_tiny_causal_lm  # noqa: E402


class Load:
    """``clients`` threads sending requests one after another to ``base_url`` until stopped."""

    def __init__(self, base_url: str, clients: int, max_tokens: int) -> None:
        self.base_url, self.max_tokens = base_url, max_tokens
        self.records: list[tuple[float, float, bool]] = []  # (sent, latency, ok)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def _run(self) -> None:
        body = {
            "model": "nexa-moe",
            "messages": [{"role": "user", "content": "What is a list?"}],
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
        }
        with httpx.Client(timeout=120.0) as http:
            while not self._stop.is_set():
                sent = time.monotonic()
                try:
                    ok = http.post(f"{self.base_url}/chat/completions", json=body).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.records.append((sent, time.monotonic() - sent, ok))

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=180)

    def phase(self, start: float, end: float) -> dict[str, float | int]:
        rows = [r for r in self.records if start <= r[0] < end]
        latencies = sorted(r[1] for r in rows)
        p = (
            (lambda q: round(latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000, 1))
            if latencies
            else (lambda q: None)
        )
        return {
            "requests": len(rows),
            "failed": sum(1 for r in rows if not r[2]),
            "requests_per_s": round(len(rows) / (end - start), 2),
            "p50_ms": p(0.50),
            "p99_ms": p(0.99),
            "mean_ms": round(statistics.fmean(latencies) * 1000, 1) if latencies else None,
        }


def measure(base_url: str, clients: int, max_tokens: int, seconds: float) -> dict[str, float | int]:
    with Load(base_url, clients, max_tokens) as load:
        t0 = time.monotonic()
        time.sleep(seconds)
        t1 = time.monotonic()
    return load.phase(t0, t1)


def main() -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase-s", type=float, default=20.0, help="seconds of load per steady phase")
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="serving-switch-") as tmp:
        root = Path(tmp)
        a = build_tiny_causal_lm(root / "models" / "tiny-a", seed=0)
        b = build_tiny_causal_lm(root / "models" / "tiny-b", seed=1)
        env = {**os.environ, "NEXA_DATA_ROOT": str(root / "data"), "NEXA_RESULTS_ROOT": str(root / "results")}
        serving_dir = root / "data" / "serving"
        serving_dir.mkdir(parents=True)
        ProductionRegistry(serving_dir / "production.json").promote(
            ProductionEntry(checkpoint_id="a", checkpoint_path=str(a), metric="eval_loss", value=5.0)
        )
        port = free_port()
        with open(root / "service.log", "wb") as log:
            service = subprocess.Popen(
                [sys.executable, "-m", "nexa_dagster.cli", "serve", "--port", str(port)],
                env=env,
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            deadline = time.monotonic() + 600
            while (client := ServingServiceClient.find(serving_dir)) is None or client.status()[
                "checkpoint_id"
            ] != "a":
                if service.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(
                        f"the serving service did not come up:\n{(root / 'service.log').read_text()}"
                    )
                time.sleep(0.5)
            endpoint = f"http://127.0.0.1:{port}/v1"
            figures: dict[str, object] = {
                "clients": args.clients,
                "max_tokens": args.max_tokens,
                "phase_s": args.phase_s,
                "cpus": os.cpu_count(),
                "machine": platform.machine(),
            }
            figures["direct"] = measure(
                client.status()["engine_url"], args.clients, args.max_tokens, args.phase_s
            )
            figures["before"] = measure(endpoint, args.clients, args.max_tokens, args.phase_s)
            with Load(endpoint, args.clients, args.max_tokens) as load:
                t0 = time.monotonic()
                result = client.switch(str(b), "b")
                t1 = time.monotonic()
                time.sleep(args.phase_s)
                t2 = time.monotonic()
            figures["during"] = load.phase(t0, t1)
            figures["after"] = load.phase(t1, t2)
            figures["switch_s"] = round(result.switch_s, 2)
            figures["drain_s"] = round(result.drain_s, 3)
            figures["failed_requests_total"] = sum(1 for r in load.records if not r[2])
            before, during = figures["before"], figures["during"]
            assert isinstance(before, dict) and isinstance(during, dict)
            if before["p99_ms"] and during["p99_ms"]:
                figures["p99_during_over_before"] = round(during["p99_ms"] / before["p99_ms"], 2)
        finally:
            service.terminate()
            service.wait(timeout=120)
    for phase in ("direct", "before", "during", "after"):
        f = figures[phase]
        assert isinstance(f, dict)
        print(
            f"{phase:>7}: {f['requests']:5d} requests, {f['requests_per_s']:6.2f}/s, p50 {f['p50_ms']} ms, "
            f"p99 {f['p99_ms']} ms, failed {f['failed']}"
        )
    print(f"switch: {figures['switch_s']} s (drain {figures['drain_s']} s)")
    return figures


if __name__ == "__main__":
    print(json.dumps(main()))
