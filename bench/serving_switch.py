"""The serving endpoint through repeated blue/green switches: throughput, latency and failures before vs during.

Run: .venv/bin/python bench/serving_switch.py [--switches 10] [--before-s 6] [--clients 2] [--max-tokens 8]
     [--think-s 0] [--compare] [--canaries 2] [--engines transformers,vllm]

Builds two tiny models (other seeds, other answers), puts the first in production and starts the serving service
(`nexa-dagster serve`: HAProxy in front of `transformers serve`, with an API key every request sends) on a temporary
data root. Then, with ``--clients`` clients sending chat requests without pause (plain httpx, no retry: a failure
counts; ``--think-s``: each client waits that long after an answer before its next request), it switches
``--switches`` times, promotion and rollback in turn (a -> b -> a ...). Each cycle has:

- ``before``: ``--before-s`` seconds on the serving engine, after a settling second (the baseline, measured between
  the switches of the same run, so a machine whose load drifts moves both);
- ``during``: from the switch request to its answer (the new engine starts, answers its smoke request, takes the
  traffic while the old one drains and stops).

A request belongs to the window it was sent in. Per window over all cycles: requests (n), failed, requests/s (n over
the windows' summed length), latency p50 and p99 (nearest rank over the n latencies). The goal (issue 35): during
>= 0.7x the requests/s before, p99 during <= 2x before, 0 failed, decided only on >= 300 requests during.
``--compare`` runs the same cycles first with the loading engine unrestrained (`--loading-nice 0 --loading-threads
0`: the behaviour before the change), then restrained (the defaults), on one machine, one after the other.

``--canaries N`` (issue 50): after the switches, the same service runs N canaries in turn (b beside a, then a beside
b ...; ``POST /canary`` with ``--canary-share``, failures and slow requests watched at their default limits, or
both at ``--canary-limits``: the suite's smallest run, which only checks the bench), each
until its runner decides, under the same clients. Per canary: its verdict, how many requests it counted (stable and
canary) and took in seconds; over all canaries the same window figures as a switch's (``canary``), against the
same run's ``before`` baseline: what a canary costs the endpoint, and how many requests a healthy one needs here.

``--engines transformers,vllm`` (issue 48) runs the same cycles once per serving engine, one after the other, on the
same two models: the tiny models with their heads widened 16 -> 32 (``core/llm/widen_heads``, the same function;
vLLM's CPU attention has no 16), served with ``nexa-dagster serve --engine <name>``. The default,
``transformers``, serves the tiny models as they are.

The load average (``os.getloadavg``, what `uptime` says) is read at each configuration's start and end: the
machine is shared. Last line: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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

API_KEY = "bench-serving-switch-key-7Qv2Lp9xWm4K"  # 222 bits by the service's count (128 required)
MIN_DURING = 300  # requests during the switches below which the goal is not decided


class Load:
    """``clients`` threads sending requests one after another to ``base_url`` until stopped, each waiting
    ``think_s`` after an answer (0: a closed loop that keeps the engine saturated, what the goals were measured
    under; more: users who read an answer before asking again, an engine partly idle)."""

    def __init__(self, base_url: str, clients: int, max_tokens: int, think_s: float = 0.0) -> None:
        self.base_url, self.max_tokens, self.think_s = base_url, max_tokens, think_s
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
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.Client(timeout=120.0, headers=headers) as http:
            while not self._stop.is_set():
                sent = time.monotonic()
                try:
                    ok = http.post(f"{self.base_url}/chat/completions", json=body).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.records.append((sent, time.monotonic() - sent, ok))
                if self.think_s:
                    self._stop.wait(self.think_s)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=180)

    def windows(self, spans: list[tuple[float, float]]) -> dict[str, float | int | None]:
        """The figures of the requests sent within any of ``spans``."""
        rows = [r for r in self.records if any(start <= r[0] < end for start, end in spans)]
        seconds = sum(end - start for start, end in spans)
        latencies = sorted(r[1] for r in rows)

        def rank(q: float) -> float | None:  # nearest rank
            return (
                round(latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000, 1) if rows else None
            )

        return {
            "requests": len(rows),
            "failed": sum(1 for r in rows if not r[2]),
            "seconds": round(seconds, 2),
            "requests_per_s": round(len(rows) / seconds, 2) if seconds else None,
            "p50_ms": rank(0.50),
            "p99_ms": rank(0.99),
        }


def verdict(before: dict, during: dict, think_s: float = 0.0) -> dict[str, object]:
    """The ratios and whether they meet the goal; undecided on fewer than ``MIN_DURING`` requests during, and
    with clients that pause (``think_s``): the throughput goal is about an engine kept busy, and paused clients'
    rate is set by their pauses."""
    throughput = during["requests_per_s"] / before["requests_per_s"] if before["requests_per_s"] else None
    p99 = during["p99_ms"] / before["p99_ms"] if before["p99_ms"] and during["p99_ms"] else None
    out: dict[str, object] = {
        "throughput_during_over_before": round(throughput, 3) if throughput is not None else None,
        "p99_during_over_before": round(p99, 3) if p99 is not None else None,
        "failed": during["failed"] + before["failed"],
    }
    if think_s:
        out["goal_met"] = None
        out["why"] = f"clients pausing {think_s} s between requests: the goal is decided with --think-s 0"
    elif during["requests"] < MIN_DURING or throughput is None or p99 is None:
        out["goal_met"] = None
        out["why"] = f"{during['requests']} requests during the switches, {MIN_DURING} needed: not decided"
    else:
        out["goal_met"] = throughput >= 0.7 and p99 <= 2.0 and out["failed"] == 0
    return out


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _key_file(root: Path) -> Path:
    """The endpoint's key in a file of mode 600 under ``root`` (made here: it is each configuration's own folder,
    which nothing has created yet): a secret is a file, never a value (docs/security.md)."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / "api-key"
    path.touch(mode=0o600)  # 600 before the key is in it, not after
    path.write_text(API_KEY + "\n")
    return path


def run_configuration(args: argparse.Namespace, root: Path, a: Path, b: Path, extra: list[str]) -> dict:
    """One service (with ``extra`` arguments to `nexa-dagster serve`) through ``args.switches`` switches."""
    data = root / "data"
    env = {
        **os.environ,
        "NEXA_DATA_ROOT": str(data),
        "NEXA_RESULTS_ROOT": str(root / "results"),
        "NEXA_SERVING_API_KEY_FILE": str(_key_file(root)),
        "NEXA_SERVING_CHECKPOINT_ROOTS": str(a.parent),
    }
    serving_dir = data / "serving"
    serving_dir.mkdir(parents=True)
    ProductionRegistry(serving_dir / "production.json").promote(
        ProductionEntry(checkpoint_id="a", checkpoint_path=str(a), metric="eval_loss", value=5.0)
    )
    port = free_port()
    log_path = root / "service.log"
    with open(log_path, "wb") as log:
        service = subprocess.Popen(
            [sys.executable, "-m", "nexa_dagster.cli", "serve", "--port", str(port), *extra],
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
                raise SystemExit(f"the serving service did not come up:\n{log_path.read_text()}")
            time.sleep(0.5)
        endpoint = f"http://127.0.0.1:{port}/v1"
        load_at_start = load_average()
        befores, durings, switch_s = [], [], []
        with Load(endpoint, args.clients, args.max_tokens, args.think_s) as load:
            for i in range(args.switches):
                time.sleep(1.0)  # settling: the engine that just took the traffic answers its first requests
                t0 = time.monotonic()
                time.sleep(args.before_s)
                t1 = time.monotonic()
                target, checkpoint_id = (b, "b") if i % 2 == 0 else (a, "a")
                result = client.switch(str(target), checkpoint_id)
                t2 = time.monotonic()
                befores.append((t0, t1))
                durings.append((t1, t2))
                switch_s.append(round(result.switch_s, 2))
                print(f"  switch {i + 1}: to {checkpoint_id} in {result.switch_s:.2f} s", flush=True)
            served = "b" if args.switches % 2 else "a"
            canaries, canary_spans = [], []
            for j in range(args.canaries):
                target, checkpoint_id = (a, "a") if served == "b" else (b, "b")
                entry = ProductionEntry(
                    checkpoint_id=checkpoint_id, checkpoint_path=str(target), metric="eval_loss"
                )
                t1 = time.monotonic()
                # failures and slow requests (quality is not scored on live requests yet); undecided after
                # --canary-max-s: "not enough traffic", rolled back
                policy = {
                    "share": args.canary_share,
                    "max_quality_drop": None,
                    "max_duration_s": args.canary_max_s,
                    **(
                        {"max_failure_increase": args.canary_limits, "max_slow_increase": args.canary_limits}
                        if args.canary_limits is not None
                        else {}
                    ),
                }
                client.canary(str(target), checkpoint_id, policy, entry.model_dump())
                while (status := client.status())["canary"] is not None or not status["last_canary"]:
                    time.sleep(0.5)
                t2 = time.monotonic()
                state = json.loads((serving_dir / "canary.json").read_text())["state"]["sequences"]
                counted = {arm: state[arm]["failed"]["n"] for arm in ("stable", "canary")}
                verdict_ = status["last_canary"]["verdict"]
                canaries.append(
                    {
                        "verdict": verdict_,
                        "requests": counted,
                        "seconds": round(t2 - t1, 1),
                        "reason": status["last_canary"]["reason"],
                    }
                )
                canary_spans.append((t1, t2))
                served = checkpoint_id if verdict_ == "promote" else served
                print(
                    f"  canary {j + 1}: {checkpoint_id} {verdict_} after {counted} requests in {t2 - t1:.1f} s: "
                    + status["last_canary"]["reason"],
                    flush=True,
                )
        before, during = load.windows(befores), load.windows(durings)
        return {
            "serve_args": extra,
            "engine": client.status()["engine"],  # what served, as the service says
            "before": before,
            "during": during,
            # per switch, to see a drift (the machine is shared) apart from the switches' own effect
            "before_requests_per_s_each": [load.windows([w])["requests_per_s"] for w in befores],
            "during_requests_per_s_each": [load.windows([w])["requests_per_s"] for w in durings],
            "switch_s": switch_s,
            "failed_requests_total": sum(1 for r in load.records if not r[2]),
            "canaries": canaries,
            "canary": load.windows(canary_spans) if canary_spans else None,
            "load_average_start": load_at_start,
            "load_average_end": load_average(),
            **verdict(before, during, args.think_s),
        }
    finally:
        service.terminate()
        service.wait(timeout=120)


def main() -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--switches", type=int, default=10, help="promotions and rollbacks in turn")
    ap.add_argument("--before-s", type=float, default=6.0, help="seconds of baseline before each switch")
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument(
        "--think-s",
        type=float,
        default=0.0,
        help="seconds each client waits after an answer (default 0: the engine saturated, as the goals were measured)",
    )
    ap.add_argument("--compare", action="store_true", help="first with the loading engine unrestrained")
    ap.add_argument("--canaries", type=int, default=0, help="canaries after the switches, each until decided")
    ap.add_argument("--canary-share", type=float, default=0.5, help="the share of requests a canary serves")
    ap.add_argument(
        "--canary-max-s", type=float, default=300.0, help="a canary's time limit (max_duration_s)"
    )
    ap.add_argument(
        "--canary-limits",
        type=float,
        default=None,
        help="the canaries' failure and slow-request limits (default: serving.yaml's, 0.02 and 0.1, which a healthy "
        "canary meets after ~540 requests a side); wider ones decide in tens of requests: a run that checks the "
        "bench, not what a canary costs",
    )
    ap.add_argument(
        "--engines", default="transformers", help="serving engines, comma-separated: transformers, vllm"
    )
    args = ap.parse_args()
    engines = [e for e in args.engines.split(",") if e]
    if set(engines) - {"transformers", "vllm"}:
        ap.error(f"--engines: transformers and/or vllm, not {args.engines}")
    configurations = {"restrained": []}
    if args.compare:
        configurations = {"unrestrained": ["--loading-nice", "0", "--loading-threads", "0"], **configurations}
    if engines != ["transformers"]:  # one configuration per engine, each engine's name first
        configurations = {
            f"{engine}" + (f"/{name}" if len(configurations) > 1 else ""): [*extra, "--engine", engine]
            for engine in engines
            for name, extra in configurations.items()
        }
    figures: dict[str, object] = {
        "switches": args.switches,
        "clients": args.clients,
        "max_tokens": args.max_tokens,
        "think_s": args.think_s,
        "before_s": args.before_s,
        "canaries_asked": args.canaries,
        "engines": engines,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
    }
    with tempfile.TemporaryDirectory(prefix="serving-switch-") as tmp:
        models = Path(tmp) / "models"
        a = build_tiny_causal_lm(models / "tiny-a", seed=0)
        b = build_tiny_causal_lm(models / "tiny-b", seed=1)
        if engines != ["transformers"]:  # heads vLLM's CPU attention takes, on both engines alike
            from nexa_dagster.core.llm.widen_heads import widen_checkpoint

            a, b = (widen_checkpoint(m, models / f"{m.name}-h32", 32) for m in (a, b))
        for name, extra in configurations.items():
            print(f"{name}: nexa-dagster serve {' '.join(extra)}", flush=True)
            figures[name] = run_configuration(args, Path(tmp) / name, a, b, extra)
    for name in configurations:
        f = figures[name]
        assert isinstance(f, dict)
        print(f"{name} on {f['engine']} (load average {f['load_average_start']} -> {f['load_average_end']}):")
        for window in ("before", "during"):
            w = f[window]
            print(
                f"  {window:>6}: {w['requests']:5d} requests in {w['seconds']:7.1f} s, {w['requests_per_s']}/s, "
                f"p50 {w['p50_ms']} ms, p99 {w['p99_ms']} ms, failed {w['failed']}"
            )
        print(
            f"  during/before: throughput {f['throughput_during_over_before']}x, p99 {f['p99_during_over_before']}x, "
            f"failed {f['failed']}; goal met: {f['goal_met']}; switches {min(f['switch_s'])}-{max(f['switch_s'])} s"
        )
        if f["canary"]:
            w = f["canary"]
            print(
                f"  canary: {w['requests']:5d} requests in {w['seconds']:7.1f} s, {w['requests_per_s']}/s, "
                f"p50 {w['p50_ms']} ms, p99 {w['p99_ms']} ms, failed {w['failed']}; "
                + "; ".join(f"{c['verdict']} after {sum(c['requests'].values())}" for c in f["canaries"])
            )
    return figures


if __name__ == "__main__":
    print(json.dumps(main()))
