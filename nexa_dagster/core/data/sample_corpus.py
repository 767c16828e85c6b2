"""The sample corpus the project ships for the demo: CPython's documentation topics, three days of arrivals.

Each topic is cut into sections of about one teacher prompt (``SECTION_CHARS``, at paragraph ends), and the
first day holds most of them (``DAY_SHARES``): enough that the first night's frozen eval set has the examples a
promotion decision needs (about 100; tests/e2e check it). Each day lands in a different format so that the demo exercises
every reader of the ingest stage:
JSONL on day one, Parquet plus a plain-text file on day two, a Hugging Face ``datasets`` directory on day three.
``python -m nexa_dagster.core.data.sample_corpus sample_data/landing`` regenerates ``sample_data/`` byte for byte
(with Python 3.11's ``pydoc_data``); ``... tests/data/landing 12`` the test suite's small copy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from pydoc_data.topics import topics

SAMPLE_DAYS = ("2026-11-20", "2026-11-21", "2026-11-22")
_DOCS_URL = "https://docs.python.org/3/reference/"


# The share of the sections that lands on each day. The first day lands most of them: the eval set is frozen on the
# first night from the first day's judged samples (eval_set.fraction of them), and the promotion gate needs about
# 100 examples to see regressions a tenth of the examples hold (docs/stages/evaluation.md, the size table), so the
# first day must carry ~600 documents; the later days land the rest, the new data each later night adds.
DAY_SHARES = (0.75, 0.125, 0.125)
SECTION_CHARS = 650  # about the tiny scale's max_chars_per_doc (600): one section, one teacher prompt
MIN_SECTION_CHARS = 200  # shorter tails join the section before them


def _topics() -> list[tuple[str, str]]:
    """Every documentation topic cut into sections: ``("<topic>", text)`` for a short topic, else
    ``("<topic> (part k)", text)``, in topic order."""
    out = []
    for name in sorted(topics):
        parts = _sections(topics[name])
        out += [(name if len(parts) == 1 else f"{name} (part {k})", text) for k, text in enumerate(parts, 1)]
    return out


def _unwrap(paragraph: str) -> str:
    """A prose paragraph as one line, the way a web page delivers it (pydoc hard-wraps text at 72 columns for a
    terminal); a heading's underline of ``*`` or ``=`` dropped; code and grammar blocks kept as they are.

    Prose is a paragraph whose lines share one indent (a list item's continuation lines may be indented more) and
    run close to the wrap width but for the last. Paragraphs are then joined by one newline, not a blank line.
    Why: the chat template's generation prompt ends with a newline, and in pydoc's text the likeliest token after
    a newline is another one; the tiny base learned exactly that, and the student's greedy answer was nothing but
    newlines, an empty answer the deployment's smoke test refuses."""
    lines = [line for line in paragraph.split("\n") if set(line.strip()) - set("*=-")]
    if not lines:
        return ""
    indent = len(lines[0]) - len(lines[0].lstrip(" "))
    same_indent = all(len(line) - len(line.lstrip(" ")) >= indent for line in lines)
    wrapped = all(50 <= len(line) <= 80 for line in lines[:-1]) and not any(">>>" in line for line in lines)
    if len(lines) > 1 and not (same_indent and wrapped):
        return "\n".join(lines)  # code, a grammar block, a table
    return " " * indent + " ".join(line.strip() for line in lines)


def _sections(text: str) -> list[str]:
    """``text`` cut at paragraph ends (joined again by one newline) into pieces of about ``SECTION_CHARS`` characters (a paragraph longer than
    that stays whole); a piece shorter than ``MIN_SECTION_CHARS`` joins the one before it."""
    pieces: list[str] = []
    current = ""
    for paragraph in (_unwrap(p.strip("\n")) for p in text.split("\n\n")):
        if not paragraph.strip():
            continue
        if current and len(current) + len(paragraph) + 2 > SECTION_CHARS:
            pieces.append(current)
            current = paragraph
        else:
            current = f"{current}\n{paragraph}" if current else paragraph
    if current:
        if pieces and len(current) < MIN_SECTION_CHARS:
            pieces[-1] = f"{pieces[-1]}\n{current}"
        else:
            pieces.append(current)
    return pieces


def write_sample_landing(root: str | Path, docs_per_day: int | None = None) -> list[Path]:
    """The three sample days under ``root``; ``docs_per_day`` keeps only each day's first documents (the test
    suite's small landing, ``tests/data/landing``: the same formats, a dozen documents a day)."""
    import pandas as pd  # seconds to import: SAMPLE_DAYS's readers (the demo, its tests) do not write days

    root = Path(root)
    topics = _topics()
    ends = [round(len(topics) * sum(DAY_SHARES[: i + 1]) / sum(DAY_SHARES)) for i in range(3)]
    starts = [0, *ends[:-1]]
    chunks = [topics[a:b][:docs_per_day] for a, b in zip(starts, ends, strict=True)]
    written: list[Path] = []

    d1 = root / SAMPLE_DAYS[0]
    d1.mkdir(parents=True, exist_ok=True)
    with open(d1 / "python_reference.jsonl", "w", encoding="utf-8") as f:
        for name, text in chunks[0]:
            f.write(
                json.dumps({"title": name, "text": text, "url": _DOCS_URL + name.split(" (part")[0]}) + "\n"
            )
    written.append(d1 / "python_reference.jsonl")

    d2 = root / SAMPLE_DAYS[1]
    d2.mkdir(parents=True, exist_ok=True)
    rows = [{"name": n, "content": t} for n, t in chunks[1][1:]]
    pd.DataFrame(rows).to_parquet(d2 / "python_reference.parquet", index=False)
    name, text = chunks[1][0]
    slug = name.replace(" (part ", "-part-").rstrip(")")
    (d2 / f"{slug}.txt").write_text(text, encoding="utf-8")
    written += [d2 / "python_reference.parquet", d2 / f"{slug}.txt"]

    from datasets import Dataset  # seconds to import, as pandas above

    d3 = root / SAMPLE_DAYS[2] / "python_reference_hf"
    Dataset.from_list([{"topic": n, "body": t} for n, t in chunks[2]]).save_to_disk(str(d3))
    written.append(d3)
    return written


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else "sample_data/landing"
    for p in write_sample_landing(target, int(sys.argv[2]) if len(sys.argv) > 2 else None):
        print(p)
