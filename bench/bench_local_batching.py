"""Local backend: batched generation vs. the same requests one at a time (the baseline), in one run.

Run: .venv/bin/python bench/bench_local_batching.py [n_conversations] [max_tokens] [MODEL_DIR ...]
Uses the project's tiny model, and each MODEL_DIR after it in the same run (e.g. the real SmolLM2-135M-Instruct of
`nexa-dagster real-model`), on one thread (on a 2-core machine shared with other work, OpenMP threads waiting
for each other swamp the effect). Generated tokens/s counts the tokens each answer really got (a model may stop
early). Last line: one JSON object with the figures (one per model under "models" when several).
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


def measure(model_dir: Path, n: int, max_tokens: int) -> dict[str, object]:
    """Best of three interleaved rounds of ``n`` conversations batched and the same one at a time."""
    client = LocalTransformersClient(model_dir, batch_size=n)
    convs = [
        [{"role": "user", "content": f"Explain topic {i} of the Python reference in detail."}]
        for i in range(n)
    ]
    params = SamplingParams(max_tokens=max_tokens)
    client.chat_many(convs[:2], params)  # warm-up
    batched, sequential = [], []
    for _ in range(3):  # best of three interleaved rounds: (seconds, generated tokens)
        t0 = time.perf_counter()
        answers = client.chat_many(convs, params)
        batched.append((time.perf_counter() - t0, sum(a.completion_tokens for a in answers)))
        t0 = time.perf_counter()
        tokens = sum(client.chat(m, params).completion_tokens for m in convs)
        sequential.append((time.perf_counter() - t0, tokens))
    (b_s, b_tok), (s_s, s_tok) = min(batched), min(sequential)
    figures = {
        "model": str(model_dir),
        "conversations": n,
        "max_tokens": max_tokens,
        "batched_s": round(b_s, 4),
        "one_at_a_time_s": round(s_s, 4),
        "batched_tokens_per_s": round(b_tok / b_s, 1),
        "one_at_a_time_tokens_per_s": round(s_tok / s_s, 1),
        "speedup": round(s_s / b_s, 2),
    }
    for k, v in figures.items():
        print(f"{k:>28}: {v}")
    return figures


def main(n: int, max_tokens: int, models: list[str]) -> dict[str, object]:
    torch.set_num_threads(1)
    tiny = build_tiny_causal_lm(Path(tempfile.mkdtemp()) / "models" / "tiny-bench")
    runs = [measure(p, n, max_tokens) for p in [tiny, *map(Path, models)]]
    return runs[0] if len(runs) == 1 else {"models": runs}


if __name__ == "__main__":
    numbers = [int(a) for a in sys.argv[1:3]]
    n, max_tokens = numbers + [16, 16][len(numbers) :]
    print(json.dumps(main(n, max_tokens, sys.argv[3:])))
