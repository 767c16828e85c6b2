"""When a pool of spawned shard workers pays: packaging with the size rule (``shards.pool_pays``) against a pool
always and against one process, on the same inputs in the same run.

Run (from the repo root)::

    HF_HUB_OFFLINE=1 .venv/bin/python bench/shard_pool.py

For each input size (chat conversations with log-normal lengths, a fifth of them repeated, ``--rows-per-shard``
rows a shard, so the small sizes are what a demo night packs: a few shards of tens of rows), ``package_sft`` runs
with ``--workers`` workers three ways, in turn, ``--repeats`` times each into fresh folders: ``rule`` (the
default: the first shard here, the rest to a pool only where it pays), ``pool`` (``POOL_START_S = 0``: a pool
whenever there are two shards or more, what the project did before) and ``here`` (one process). Every way gives the
same bytes (checked). The figures are median wall seconds; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# run as a script, bench/ is sys.path[0] and bench/packaging.py would shadow the installed `packaging`
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from nexa_dagster.core.packaging import shards  # noqa: E402
from nexa_dagster.core.packaging.blend import BlendSource, DataBlend  # noqa: E402
from nexa_dagster.core.packaging.sft_dataset import PackagingSettings, package_sft  # noqa: E402
from nexa_dagster.core.tiny.model import build_tiny_causal_lm  # noqa: E402

WORDS = [
    "the",
    "a",
    "list",
    "tuple",
    "dict",
    "set",
    "module",
    "import",
    "class",
    "function",
    "returns",
    "value",
    "default",
    "raises",
    "error",
]


def conversations(n: int, seed: int) -> list[dict[str, Any]]:
    """Chats with log-normal lengths, a fifth of them copies of earlier ones (documents repeat)."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for i in range(n):
        if rows and rng.random() < 0.2:
            rows.append({**rng.choice(rows), "sample_id": f"s{i:07d}"})
            continue
        prompt = " ".join(rng.choices(WORDS, k=max(2, int(rng.lognormvariate(2.5, 0.6)))))
        answer = " ".join(rng.choices(WORDS, k=max(2, int(rng.lognormvariate(3.5, 0.8)))))
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        rows.append({"sample_id": f"s{i:07d}", "messages": messages})
    return rows


def packaged_bytes(root: str) -> str:
    digest = hashlib.sha256()
    for path in sorted(Path(root).rglob("*")):
        if path.is_file() and "receipts" not in path.parts and path.suffix != ".json":
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def run(
    way: str, source: str, tokenizer: Any, out: str, workers: int, rows_per_shard: int
) -> tuple[float, str]:
    saved = shards.POOL_START_S
    if way == "pool":
        shards.POOL_START_S = 0.0
    settings = PackagingSettings(256, 0.2, 0, "raise", rows_per_shard, 1 if way == "here" else workers)
    blend = DataBlend(name="bench", sources=[BlendSource(name="chat", path=source)])
    t0 = time.perf_counter()
    try:
        result = package_sft(blend, tokenizer, out, settings, log=lambda _: None)
    finally:
        shards.POOL_START_S = saved
    return time.perf_counter() - t0, packaged_bytes(result.root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", default="40,120,1000,8000", help="conversations per input, comma-separated"
    )
    parser.add_argument("--rows-per-shard", type=int, default=40)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nexa-bench-shard-pool-") as work:
        figures = measure(args, Path(work))
    print(json.dumps(figures))


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(build_tiny_causal_lm(work / "tiny")))
    figures: dict[str, Any] = {"workers": args.workers, "pool_start_s": shards.POOL_START_S, "sizes": {}}
    for size in (int(s) for s in args.sizes.split(",")):
        source = work / f"chats-{size}.jsonl"
        source.write_text("".join(json.dumps(r) + "\n" for r in conversations(size, seed=size)))
        seconds: dict[str, list[float]] = {"rule": [], "pool": [], "here": []}
        digests = set()
        for repeat in range(args.repeats):
            for way in ("rule", "pool", "here") if repeat % 2 == 0 else ("here", "pool", "rule"):
                took, digest = run(
                    way,
                    str(source),
                    tokenizer,
                    str(work / f"out-{size}-{way}-{repeat}"),
                    args.workers,
                    args.rows_per_shard,
                )
                seconds[way].append(took)
                digests.add(digest)
        assert len(digests) == 1, f"{size} conversations: the three ways wrote different bytes"
        median = {way: round(statistics.median(s), 3) for way, s in seconds.items()}
        shards_n = -(-size // args.rows_per_shard)
        print(
            f"{size:>6} conversations, {shards_n:>4} shards: rule {median['rule']:.2f} s, pool {median['pool']:.2f} s, "
            f"one process {median['here']:.2f} s (medians of {args.repeats})",
            flush=True,
        )
        figures["sizes"][str(size)] = {
            "shards": shards_n,
            **{f"{way}_s": m for way, m in median.items()},
            "rule_over_pool": round(median["rule"] / median["pool"], 3),
        }
    return figures


if __name__ == "__main__":
    main()
