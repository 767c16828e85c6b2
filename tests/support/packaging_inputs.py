"""Packaging inputs the packaging tests share: random chat records, a JSONL file of them, a one-source blend, and
teacher rows whose prompts are the real teacher template around a given document (the contamination tests)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

from nexa_dagster.core.common.config import read_text
from nexa_dagster.core.distill.teacher import render
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


TEACHER_TEMPLATE = read_text("prompts/teacher.jinja")


def teacher_rows(
    ids_and_docs: list[tuple[str, int]],
    day: str,
    document: Callable[[int], str],
    response: Callable[[int], str] = lambda k: f"an answer about number {k}",
) -> pd.DataFrame:
    """Filtered-sample rows of one day: each ``(sample_id, k)`` asks the teacher template about ``document(k)``
    (so two ids over one ``k`` are the same text under another id, as a planted eval example is)."""
    return pd.DataFrame(
        [
            {
                "sample_id": sid,
                "day": day,
                "system_prompt": "Answer briefly.",
                "prompt": render(TEACHER_TEMPLATE, title=f"title {sid}", text=document(k)),
                "response": response(k),
            }
            for sid, k in ids_and_docs
        ]
    )
