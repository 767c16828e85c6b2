"""Local backend: batched generation vs. the same requests one at a time (the baseline), in one run.

Run: .venv/bin/python bench/bench_local_batching.py [n_conversations] [max_tokens]
Uses the project's tiny model on one thread (on a 2-core machine shared with other work, OpenMP threads waiting
for each other swamp the effect). Last line: one JSON object with the figures.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

# run as a script, bench/ is sys.path[0]: bench/packaging.py would shadow the installed `packaging` module
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

from nexa_dagster.core.llm.base import SamplingParams  # noqa: E402
from nexa_dagster.core.llm.local import LocalTransformersClient  # noqa: E402
from nexa_dagster.core.tiny.model import build_tiny_causal_lm  # noqa: E402


def main(n: int, max_tokens: int) -> dict[str, float]:
    torch.set_num_threads(1)
    model_dir = build_tiny_causal_lm(Path(tempfile.mkdtemp()) / "models" / "tiny-bench")
    client = LocalTransformersClient(model_dir, batch_size=n)
    convs = [[{"role": "user", "content": f"Explain topic {i} in detail."}] for i in range(n)]
    params = SamplingParams(max_tokens=max_tokens)
    client.chat_many(convs[:2], params)  # warm-up
    batched, sequential = [], []
    for _ in range(3):  # best of three interleaved rounds
        t0 = time.perf_counter()
        client.chat_many(convs, params)
        batched.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for m in convs:
            client.chat(m, params)
        sequential.append(time.perf_counter() - t0)
    figures = {
        "conversations": n,
        "max_tokens": max_tokens,
        "batched_s": round(min(batched), 4),
        "one_at_a_time_s": round(min(sequential), 4),
        "speedup": round(min(sequential) / min(batched), 2),
    }
    for k, v in figures.items():
        print(f"{k:>16}: {v}")
    return figures


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:3]]
    print(json.dumps(main(*(args + [16, 16][len(args) :]))))
