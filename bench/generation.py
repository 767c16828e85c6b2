"""Teacher-stage client at concurrency 1, 8 and 32 vs. the same requests sent one by one with plain httpx.

Run: .venv/bin/python bench/generation.py [--requests 48] [--max-tokens 32] [--model DIR ... | --url URL --name NAME]
     [--engine transformers[:THREADS] --engine vllm[:THREADS] ...]

Without --model/--url (or with --model tiny) it builds the project's tiny model and starts a local `transformers serve` on it
(continuous batching on, as the teacher's managed backend does). The concurrent figures come from the client the
teacher stage uses (``OpenAICompatibleClient.stream_chat``: async ``openai`` client, bounded in-flight requests);
the baseline is a plain ``httpx.Client`` loop over the same requests, one at a time, against the same server, in
the same run. Each configuration runs ``--rounds`` times (interleaved) and the best round counts, since the
machine may be shared. Last line: one JSON object with the figures, including ``speedup_c8`` (generated tokens/s
at concurrency 8 over the sequential baseline's); with several --model or --engine, ``{"runs": [one such object per
model and engine]}``, and with both engines on a model, ``vllm_over_transformers`` (c8 tokens/s of vLLM's best
thread setting over transformers' best) per model.

``--engine`` (repeatable; default ``auto``): ``transformers`` (``transformers serve``), ``vllm`` (vLLM from its own
environment, ``make vllm``) or ``auto``, each optionally with ``:THREADS``, its compute threads (OpenMP threads,
``OMP_NUM_THREADS``). On a CPU the project runs vLLM's model in the engine core's process
(``managed_server.vllm_device_args``); ``vllm@mp`` runs it as ``vllm serve`` does by default there, in a worker
process of its own (``--distributed-executor-backend mp``), whose OpenMP threads vLLM binds to cores: its default
binds one thread a physical core and keeps a core for its scheduler (one thread on 2 cores), ``vllm@mp:THREADS``
binds ``0..THREADS-1`` with no core reserved (``VLLM_CPU_OMP_THREADS_BIND``, ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``).
Give an engine several times with different settings to compare them in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

# run as a script, bench/ is sys.path[0] and its other scripts (bench/packaging.py) would shadow installed modules
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import httpx  # noqa: E402

from nexa_dagster.core.llm.base import ChatRequest, SamplingParams  # noqa: E402
from nexa_dagster.core.llm.openai_compat import OpenAICompatibleClient  # noqa: E402

CONCURRENCY = (1, 8, 32)


def _messages(i: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You are a careful senior engineer who teaches."},
        {
            "role": "user",
            "content": f"Explain topic number {i} of the Python reference to a junior engineer.",
        },
    ]


def sequential_baseline(base_url: str, model: str, n: int, params: SamplingParams) -> tuple[float, int]:
    """Plain httpx, one request after the other: (seconds, generated tokens)."""
    tokens = 0
    with httpx.Client(timeout=300, trust_env=False) as http:
        t0 = time.perf_counter()
        for i in range(n):
            body = {
                "model": model,
                "messages": _messages(i),
                "max_tokens": params.max_tokens,
                "temperature": params.temperature,
                "top_p": params.top_p,
            }
            resp = http.post(f"{base_url}/chat/completions", json=body)
            resp.raise_for_status()
            tokens += resp.json()["usage"]["completion_tokens"]
        return time.perf_counter() - t0, tokens


def client_run(
    base_url: str, model: str, n: int, params: SamplingParams, concurrency: int
) -> tuple[float, int]:
    """The teacher stage's client at ``concurrency`` in-flight requests: (seconds, generated tokens)."""
    requests = [ChatRequest(_messages(i), params) for i in range(n)]
    with OpenAICompatibleClient(base_url, model, max_concurrency=concurrency, max_retries=2) as client:
        t0 = time.perf_counter()
        answers = [c for _, c in client.stream_chat(requests)]
        elapsed = time.perf_counter() - t0
    failed = [c.error for c in answers if c.error]
    if failed:
        raise RuntimeError(f"{len(failed)} of {n} requests failed at concurrency {concurrency}: {failed[0]}")
    return elapsed, sum(c.completion_tokens for c in answers)


MULTIPROCESS = ["--distributed-executor-backend", "mp"]  # vllm@mp: the model in a worker process of its own


def thread_env(threads: int | None, executor: str = "") -> dict[str, str]:
    """The environment that gives an engine ``threads`` compute threads (``None``: the engine's default)."""
    if threads is None:
        return {}
    if executor == "mp":  # vLLM's worker process binds its threads to cores (parse_engine: vllm only)
        return {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    return {"OMP_NUM_THREADS": str(threads)}


ENGINES = ("transformers", "vllm", "auto")


def parse_engine(spec: str) -> tuple[str, str, int | None]:
    """``ENGINE[@mp][:THREADS]`` as (engine, executor, threads). The ``--engine`` option's type: a wrong spec is
    refused when the arguments are parsed, not after the engines before it in the run have been measured."""
    head, _, threads_text = spec.partition(":")
    engine, _, executor = head.partition("@")
    if engine not in ENGINES:
        raise argparse.ArgumentTypeError(f"{spec}: the engine is one of {', '.join(ENGINES)}")
    if executor not in ("", "mp") or (executor and engine != "vllm"):
        raise argparse.ArgumentTypeError(f"{spec}: the executor suffix is @mp, and only for vllm")
    if threads_text and not (threads_text.isdigit() and int(threads_text) > 0):
        raise argparse.ArgumentTypeError(f"{spec}: THREADS is a whole number of threads, at least 1")
    return engine, executor, int(threads_text) if threads_text else None


def measure(
    args: argparse.Namespace,
    model_arg: str | None,
    engine_spec: tuple[str, str, int | None] = ("auto", "", None),
) -> dict[str, object]:
    """The sequential baseline and the client at each concurrency against one engine (``parse_engine``'s tuple),
    best of ``--rounds``."""
    engine_name, executor, threads = engine_spec
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.95)
    with ExitStack() as stack:
        if args.url:
            base_url, model, engine, served = args.url.rstrip("/"), args.name, "external", args.url
            ready_s = None
            if not model:
                with OpenAICompatibleClient(base_url) as probe:
                    model = probe.model_id
        else:
            from nexa_dagster.core.llm.managed_server import ManagedServer
            from nexa_dagster.core.tiny.model import build_tiny_causal_lm

            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            # the engine's idle OpenMP threads sleep instead of spinning (ManagedServer gives it the engine's thread
            # policy, settings.thread_policy): with the default, a 2-thread SmolLM2 engine on a shared 2-core host
            # slowed from 1.4 s to 20-60 s a request once other work took the cores (docs/measurements.md)
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="nexa-bench-")))
            model_dir = (
                Path(model_arg)
                if model_arg and model_arg != "tiny"
                else build_tiny_causal_lm(work / "models" / "tiny-bench")
            )
            server = stack.enter_context(
                ManagedServer(
                    model_dir,
                    work / "logs",
                    engine=engine_name,
                    continuous_batching=not args.no_continuous_batching,
                    startup_timeout_s=900,  # vLLM on a loaded 2-core CPU: minutes
                    extra_env=thread_env(threads, executor),
                    extra_args=MULTIPROCESS if executor else (),
                )
            )
            base_url, model, served = server.base_url, server.model_name, str(model_dir)
            engine = f"{server.engine} serve" + (
                " --continuous-batching" if server.continuous_batching else ""
            )
            engine += " (its model in a worker process)" if executor else ""
            engine += f" ({threads} threads)" if threads else " (its default threads)"
            ready_s = round(server.ready_s, 1)
            print(f"{engine} on {model_dir}: healthy after {ready_s} s")
        client_run(base_url, model, 8, params, 8)  # warm-up (first requests pay for lazy initialisation)
        best: dict[str, tuple[float, int]] = {}
        for _ in range(args.rounds):
            runs = {"sequential": sequential_baseline(base_url, model, args.requests, params)}
            for c in CONCURRENCY:
                runs[f"c{c}"] = client_run(base_url, model, args.requests, params, c)
            for name, (secs, toks) in runs.items():
                if name not in best or toks / secs > best[name][1] / best[name][0]:
                    best[name] = (secs, toks)
    figures = report(args, engine, served, best)
    figures["threads"] = threads or "default"
    figures["executor"] = executor or "default"
    figures["engine_kind"] = engine.split()[0]
    figures["ready_s"] = ready_s  # the engine's start, to its first healthy answer
    return figures


def report(
    args: argparse.Namespace, engine: str, served: str, best: dict[str, tuple[float, int]]
) -> dict[str, object]:
    """The figures of one engine, printed as a table and returned for the JSON line."""
    figures: dict[str, object] = {
        "engine": engine,
        "model": served,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
    }
    print(f"{served}\n{'run':>12} {'seconds':>8} {'req/s':>8} {'tokens/s':>9}")
    for name, (secs, toks) in best.items():
        figures[f"{name}_requests_per_s"] = round(args.requests / secs, 2)
        figures[f"{name}_tokens_per_s"] = round(toks / secs, 1)
        print(f"{name:>12} {secs:8.2f} {args.requests / secs:8.2f} {toks / secs:9.1f}")
    base = best["sequential"][1] / best["sequential"][0]
    for c in CONCURRENCY:
        secs, toks = best[f"c{c}"]
        figures[f"speedup_c{c}"] = round(toks / secs / base, 2)
    print(
        f"speed-up over the sequential baseline: c1 {figures['speedup_c1']}x, c8 {figures['speedup_c8']}x, "
        f"c32 {figures['speedup_c32']}x"
    )
    return figures


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--model",
        action="append",
        help="local model directory to serve, or 'tiny' (default: the tiny model); repeat it to measure several "
        "models one after the other in one run (e.g. --model tiny --model data/models/smollm2-135m-instruct)",
    )
    parser.add_argument("--url", help="an OpenAI-compatible base URL already serving (instead of --model)")
    parser.add_argument("--name", default="", help="model name for --url (default: the first it lists)")
    parser.add_argument("--no-continuous-batching", action="store_true")
    parser.add_argument(
        "--engine",
        action="append",
        type=parse_engine,
        help="transformers, vllm or auto (default), optionally :THREADS; repeat it to compare engines, or thread "
        "settings of one, in one run (e.g. --engine transformers:1 --engine transformers:2 --engine vllm:2)",
    )
    args = parser.parse_args(argv)
    models = [None] if args.url else (args.model or ["tiny"])
    runs = [measure(args, m, e) for m in models for e in (args.engine or [parse_engine("auto")])]
    if len(runs) == 1:
        return runs[0]
    return {"runs": runs, "vllm_over_transformers": engine_ratios(runs)}


def engine_ratios(runs: list[dict[str, object]]) -> dict[str, float]:
    """Per model: vLLM's best c8 tokens/s over transformers', each engine at its best thread setting of the run."""
    best: dict[tuple[str, str], float] = {}
    for run in runs:
        key = (str(run["model"]), str(run["engine_kind"]))
        best[key] = max(best.get(key, 0.0), float(run["c8_tokens_per_s"]))  # type: ignore[arg-type]
    return {
        model: round(best[(model, "vllm")] / best[(model, "transformers")], 2)
        for model, kind in best
        if kind == "vllm" and (model, "transformers") in best
    }


if __name__ == "__main__":
    print(json.dumps(main()))
