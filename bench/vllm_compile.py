"""vLLM on a CPU host, eager or compiled: what torch.compile costs at an engine start and saves in generation.

    .venv/bin/python bench/vllm_compile.py [--model DIR] [--prompts 32] [--max-tokens 32] [--rounds 3]

Why: the rollout and sampling engine (``core/llm/vllm_engine.py``) runs eager on a CPU host, as the served engines
do, and this is the measurement that decides it. Three engines in turn, each a fresh process of the vLLM
environment's interpreter (``make vllm``), offline ``vllm.LLM`` as the rollout worker builds it (float32, one
process, whole prefills): eager (``enforce_eager``), compiled with empty compile caches (a clean machine, or a new
model or vLLM), and compiled again on the caches the cold one filled. Each: seconds to a ready engine (wall and CPU),
then the same prompts generated ``--rounds`` times, greedy, the median. The prompts are chat-like questions of 8
to ~120 words, two asked twice (as documents repeat). The model: ``--model``, else the packaged SmolLM2-135M-Instruct
(``nexa-dagster real-model``).

``compile_s`` is the compiled start minus the eager one; ``tokens_to_repay`` how many generated tokens at the
compiled speed make that up. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORDS = [
    "the",
    "engine",
    "samples",
    "every",
    "rollout",
    "of",
    "a",
    "group",
    "and",
    "the",
    "trainer",
    "scores",
    "each",
    "completion",
    "it",
    "returns",
]


def prompts(n: int) -> list[str]:
    """``n`` prompts of 8 to ~120 words; the 5th and the 9th repeat the 1st and the 2nd."""
    out = []
    for i in range(n):
        length = 8 + (i * 37) % 113
        out.append(f"Question {i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(length)) + "?")
    for copy, original in ((4, 0), (8, 1)):
        if copy < n:
            out[copy] = out[original]
    return out


def child(mode: str, model: str, n_prompts: int, max_tokens: int, rounds: int) -> dict[str, Any]:
    """Run by the vLLM interpreter: one engine, its start and its generation."""
    import resource

    def cpu() -> float:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    started = time.monotonic()
    import vllm

    llm = vllm.LLM(
        model=model,
        dtype="float32",
        max_model_len=1024,
        seed=0,
        enable_chunked_prefill=False,
        distributed_executor_backend="uni",
        enforce_eager=mode == "eager",
    )
    ready_s, ready_cpu_s = time.monotonic() - started, cpu()
    params = vllm.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    texts, times = prompts(n_prompts), []
    tokens = 0
    for _ in range(rounds):
        t = time.monotonic()
        outputs = llm.generate(texts, params, use_tqdm=False)
        times.append(time.monotonic() - t)
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    generate_s = statistics.median(times)
    return {
        "mode": mode,
        "ready_s": round(ready_s, 1),
        "ready_cpu_s": round(ready_cpu_s, 1),
        "generate_s": round(generate_s, 3),
        "tokens": tokens,
        "tokens_per_s": round(tokens / generate_s, 1),
        "vllm": vllm.__version__,
    }


def run_side(python: Path, mode: str, args: argparse.Namespace, caches: Path) -> dict[str, Any]:
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # as the rollout engine runs (vllm_engine.py says why)
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(caches / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
    }
    # -I: not this folder on the path (bench/packaging.py would shadow the `packaging` library vLLM imports)
    cmd = [
        str(python),
        "-I",
        __file__,
        "--child",
        mode,
        "--model",
        args.model,
        "--prompts",
        str(args.prompts),
    ]
    cmd += ["--max-tokens", str(args.max_tokens), "--rounds", str(args.rounds)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"the {mode} engine failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="", help="a Hugging Face model directory vLLM runs (default: SmolLM2)"
    )
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model, args.prompts, args.max_tokens, args.rounds)))
        return
    from nexa_dagster.core.llm.packaged_model import install_packaged_model
    from nexa_dagster.core.llm.vllm_env import require_vllm

    python = require_vllm()
    args.model = args.model or str(install_packaged_model())
    with tempfile.TemporaryDirectory(prefix="vllm-compile-") as tmp:
        caches = Path(tmp)
        sides = {
            "eager": run_side(python, "eager", args, caches / "eager"),
            "compiled_cold": run_side(python, "compiled", args, caches / "compiled"),
            "compiled_warm": run_side(python, "compiled", args, caches / "compiled"),
        }
    eager, warm = sides["eager"], sides["compiled_warm"]
    print(f"{'engine':<15} {'ready s':>8} {'ready CPU s':>12} {'generate s':>11} {'tokens/s':>9}")
    for name, side in sides.items():
        print(
            f"{name:<15} {side['ready_s']:8.1f} {side['ready_cpu_s']:12.1f} {side['generate_s']:11.3f} "
            f"{side['tokens_per_s']:9.1f}"
        )
    compile_s = warm["ready_s"] - eager["ready_s"]
    saved_per_token = 1 / eager["tokens_per_s"] - 1 / warm["tokens_per_s"]
    repay = round(compile_s / saved_per_token) if saved_per_token > 0 and compile_s > 0 else None
    print(
        f"compiled: {compile_s:.1f} s more at a start (warm caches), generation {warm['tokens_per_s'] / eager['tokens_per_s']:.2f}x "
        f"eager's: repaid after {repay if repay is not None else 'never'} generated tokens"
    )
    print(
        json.dumps(
            {
                **{f"{name}_{k}": v for name, side in sides.items() for k, v in side.items() if k != "mode"},
                "compile_s": round(compile_s, 1),
                "compiled_speedup": round(warm["tokens_per_s"] / eager["tokens_per_s"], 3),
                "tokens_to_repay": repay,
                "model": args.model,
                "prompts": args.prompts,
                "max_tokens": args.max_tokens,
            }
        )
    )


if __name__ == "__main__":
    sys.exit(main())
