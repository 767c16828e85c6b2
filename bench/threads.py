"""transformers ``generate`` under torch's default threads against the project's thread policy, in one run.

Run: .venv/bin/python bench/threads.py [--prompts 64] [--max-new-tokens 32] [--batch 16] [--rounds 2]
     [--model DIR] [--greedy] [--scenarios alone,pair,busy]

The same prompts (documents of the sample days cut to varied lengths, in the chat template), the same model (the
tiny pretrained model the repository ships, or ``--model``), the same number of new tokens, each configuration in
fresh processes (libgomp reads its wait policy once, when torch loads it):

* ``default``: what torch does unasked, the thread variables removed: a thread per core, libgomp's spinning wait;
* ``policy``: ``settings.thread_policy("evaluation", alongside=<processes of the scenario>)``'s variables (the
  share of the cores and sleeping idle threads every process the project starts gets; NEXA_THREADS and
  NEXA_OMP_WAIT_POLICY apply as in the product).

Scenarios: ``alone`` (one generating process), ``pair`` (two at once, as the suite's two workers' processes or two
steps side by side; the policy knows of the other: ``alongside=2``), ``busy`` (one beside a process that keeps one
core busy, load the policy does not know of: a mutation run, another engineer). Every process loads the model and
warms up, then all of a scenario start generating at one signal. Each configuration runs ``--rounds`` times,
interleaved; the median round counts. Figures: generated tokens per wall second (all processes of the scenario
together, over the longest one's time) and CPU seconds per token (user + system of every thread). Last line: one
JSON object with them and ``<scenario>_speedup`` (policy tokens/s over default) and ``<scenario>_cpu_ratio``
(default CPU per token over the policy's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# run as a script, bench/ is sys.path[0] and its other scripts (bench/packaging.py) would shadow installed modules
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from nexa_dagster import settings  # noqa: E402
from nexa_dagster.core.common.config import REPO_ROOT  # noqa: E402

SHIPPED_MODEL = next((REPO_ROOT / "nexa_dagster" / "core" / "tiny" / "weights").glob("tiny-pretrained-*"))
SCENARIOS = {"alone": 1, "pair": 2, "busy": 1}  # generating processes in each
CONFIGS = ("default", "policy")
HOG = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end:\n    pass\n"


def prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` questions on the sample days' documents, each quoting a stretch of 5 to 150 words: varied lengths."""
    docs = [
        json.loads(line)["text"]
        for path in sorted((REPO_ROOT / "sample_data" / "landing").glob("*/*.jsonl"))
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
    rng = random.Random(seed)
    asks = (
        "Explain this to a junior engineer",
        "Summarise this",
        "What does this mean in practice",
        "Give an example",
    )
    out = []
    for i in range(n):
        words = rng.choice(docs).split()
        start = rng.randrange(max(1, len(words) - 5))
        out.append(f"{asks[i % len(asks)]}:\n{' '.join(words[start : start + rng.randint(5, 150)])}")
    return out


def thread_free_environ() -> dict[str, str]:
    """This process's environment for a child (``settings.environ``) without any thread variable: torch's own."""
    thread_vars = set(settings.ThreadPolicy("step", 1, "PASSIVE").env())
    return {k: v for k, v in settings.environ().items() if k not in thread_vars}


def child_env(config: str, processes: int) -> dict[str, str]:
    env = {
        **thread_free_environ(),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TQDM_DISABLE": "1",
    }
    if config == "policy":
        env.update(settings.thread_policy("evaluation", alongside=processes).env())
    return env


# -- the generating process ---------------------------------------------------------------------------------------
def generate_child(args: argparse.Namespace) -> None:
    """Load, warm up, say ``ready``, wait for ``go`` on stdin, generate every prompt, print one JSON line."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in prompts(args.prompts)
    ]
    batches = [texts[i : i + args.batch] for i in range(0, len(texts), args.batch)]

    def run(batch: list[str], new_tokens: int) -> int:
        enc = tokenizer(batch, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(
                **enc,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,  # the same work in every configuration: no early end of sequence
                do_sample=not args.greedy,
                pad_token_id=tokenizer.pad_token_id,
            )
        return int(out.shape[0] * (out.shape[1] - enc["input_ids"].shape[1]))

    torch.manual_seed(0)
    run(batches[0][:2], 2)  # warm-up: first calls pay for lazy initialisation
    print("ready", flush=True)
    sys.stdin.readline()
    usage0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    tokens = sum(run(batch, args.max_new_tokens) for batch in batches)
    wall, usage = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    cpu = (usage.ru_utime - usage0.ru_utime) + (usage.ru_stime - usage0.ru_stime)
    print(json.dumps({"tokens": tokens, "wall_s": wall, "cpu_s": cpu, "threads": torch.get_num_threads()}))


# -- the driver ---------------------------------------------------------------------------------------------------
def scenario_round(args: argparse.Namespace, scenario: str, config: str) -> dict[str, float]:
    """One round of ``scenario`` under ``config``: its processes started, released together, their figures."""
    n = SCENARIOS[scenario]
    argv = [sys.executable, __file__, "--child", "--model", args.model, "--prompts", str(args.prompts)]
    argv += ["--max-new-tokens", str(args.max_new_tokens), "--batch", str(args.batch)]
    argv += ["--greedy"] if args.greedy else []
    env = child_env(config, n)
    kids = [
        subprocess.Popen(
            argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT
        )
        for _ in range(n)
    ]
    hog = None
    try:
        for kid in kids:
            assert kid.stdout is not None
            if kid.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a generating process of {scenario}/{config} failed to start")
        if scenario == "busy":
            hog = subprocess.Popen([sys.executable, "-c", HOG.format(s=3600)], env=thread_free_environ())
        for kid in kids:
            assert kid.stdin is not None
            kid.stdin.write("go\n")
            kid.stdin.flush()
        results = [json.loads(kid.communicate(timeout=args.timeout_s)[0].splitlines()[-1]) for kid in kids]
    finally:
        for proc in [*kids, *([hog] if hog else [])]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    tokens = sum(r["tokens"] for r in results)
    return {
        "tokens_per_s": tokens / max(r["wall_s"] for r in results),
        "cpu_s_per_token": sum(r["cpu_s"] for r in results) / tokens,
        "threads": results[0]["threads"],
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every scenario under both configurations, ``--rounds`` interleaved rounds; the median round of each."""
    rounds: dict[tuple[str, str], list[dict[str, float]]] = {}
    load0 = os.getloadavg()[0]
    for _ in range(args.rounds):
        for scenario in args.scenarios:
            for config in CONFIGS:
                rounds.setdefault((scenario, config), []).append(scenario_round(args, scenario, config))
    figures: dict[str, Any] = {
        "model": str(args.model),
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "batch": args.batch,
        "sampling": "greedy" if args.greedy else "sampled",
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "load_before": round(load0, 2),
        "load_after": round(os.getloadavg()[0], 2),
    }
    print(f"{'scenario':>8} {'config':>8} {'threads':>7} {'wait':>8} {'tokens/s':>9} {'CPU s/token':>12}")
    for (scenario, config), runs in rounds.items():
        speed = statistics.median(r["tokens_per_s"] for r in runs)
        cpu = statistics.median(r["cpu_s_per_token"] for r in runs)
        figures[f"{scenario}_{config}_tokens_per_s"] = round(speed, 1)
        figures[f"{scenario}_{config}_cpu_ms_per_token"] = round(cpu * 1000, 3)
        figures[f"{scenario}_{config}_threads"] = int(runs[0]["threads"])
        wait = child_env(config, SCENARIOS[scenario]).get("OMP_WAIT_POLICY", "(libgomp's)")
        print(
            f"{scenario:>8} {config:>8} {int(runs[0]['threads']):>7} {wait:>8} {speed:9.1f} {cpu * 1000:12.3f}"
        )
    for scenario in args.scenarios:
        speedup = figures[f"{scenario}_policy_tokens_per_s"] / figures[f"{scenario}_default_tokens_per_s"]
        cpu_ratio = (
            figures[f"{scenario}_default_cpu_ms_per_token"] / figures[f"{scenario}_policy_cpu_ms_per_token"]
        )
        figures[f"{scenario}_speedup"], figures[f"{scenario}_cpu_ratio"] = (
            round(speedup, 2),
            round(cpu_ratio, 2),
        )
        print(
            f"{scenario}: the policy {speedup:.2f}x the tokens/s of the default, {cpu_ratio:.2f}x less CPU a token"
        )
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default=str(SHIPPED_MODEL))
    parser.add_argument(
        "--greedy", action="store_true", help="greedy decoding (default: sampled, as rollouts)"
    )
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), type=lambda s: s.split(","))
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        generate_child(args)
        return 0
    unknown = sorted(set(args.scenarios) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenarios {unknown}: of {', '.join(SCENARIOS)}")
    print(json.dumps(measure(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
