"""The sample corpus the project ships for the demo: CPython's documentation topics, three days of arrivals.

Each day lands in a different format so that the demo exercises every reader of the ingest stage:
JSONL on day one, Parquet plus a plain-text file on day two, a Hugging Face ``datasets`` directory on day three.
``python -m nexa_dagster.core.data.sample_corpus sample_data/landing`` regenerates ``sample_data/`` byte for byte.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SAMPLE_DAYS = ("2026-11-20", "2026-11-21", "2026-11-22")
_DOCS_URL = "https://docs.python.org/3/reference/"


def _topics() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    return [(k, topics[k]) for k in sorted(topics)]


def write_sample_landing(root: str | Path) -> list[Path]:
    import pandas as pd

    root = Path(root)
    topics = _topics()
    per_day = len(topics) // 3
    chunks = [topics[i * per_day : (i + 1) * per_day] for i in range(3)]
    written: list[Path] = []

    d1 = root / SAMPLE_DAYS[0]
    d1.mkdir(parents=True, exist_ok=True)
    with open(d1 / "python_reference.jsonl", "w", encoding="utf-8") as f:
        for name, text in chunks[0]:
            f.write(json.dumps({"title": name, "text": text, "url": _DOCS_URL + name}) + "\n")
    written.append(d1 / "python_reference.jsonl")

    d2 = root / SAMPLE_DAYS[1]
    d2.mkdir(parents=True, exist_ok=True)
    rows = [{"name": n, "content": t} for n, t in chunks[1][1:]]
    pd.DataFrame(rows).to_parquet(d2 / "python_reference.parquet", index=False)
    name, text = chunks[1][0]
    (d2 / f"{name}.txt").write_text(text, encoding="utf-8")
    written += [d2 / "python_reference.parquet", d2 / f"{name}.txt"]

    from datasets import Dataset

    d3 = root / SAMPLE_DAYS[2] / "python_reference_hf"
    Dataset.from_list([{"topic": n, "body": t} for n, t in chunks[2]]).save_to_disk(str(d3))
    written.append(d3)
    return written


if __name__ == "__main__":
    for p in write_sample_landing(sys.argv[1] if len(sys.argv) > 1 else "sample_data/landing"):
        print(p)
