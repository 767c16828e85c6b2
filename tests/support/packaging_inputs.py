"""Packaging inputs the packaging tests share: random chat records, a JSONL file of them, a one-source blend."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from nexa_dagster.core.packaging.blend import BlendSource, DataBlend
from nexa_dagster.core.packaging.sft_dataset import PackagingSettings


def chat_records(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    words = [
        "the",
        "a",
        "tuple",
        "list",
        "dict",
        "set",
        "value",
        "key",
        "index",
        "slice",
        "loop",
        "yield",
        "class",
        "method",
        "return",
    ]
    out = []
    for i in range(n):
        q = " ".join(rng.choice(words, size=int(rng.integers(3, 20))))
        a = " ".join(rng.choice(words, size=int(rng.integers(5, 120))))
        out.append(
            {
                "sample_id": f"s{i:05d}",
                "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
            }
        )
    return out


def write_jsonl(path: Path, records: list) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def one_source_blend(path: str, **kw) -> DataBlend:
    return DataBlend(name="test", sources=[BlendSource(name="chat", path=path, **kw)])


def packaging_settings(**kw) -> PackagingSettings:
    return PackagingSettings(
        **{"pack_size": 256, "validation_fraction": 0.2, "seed": 0, "rows_per_shard": 40, "workers": 1, **kw}
    )


def quiet(_: str) -> None:
    pass
