"""Training inputs checked against the protected items (frozen eval set, frozen RL eval set, benchmark items) before
they are packed.

A night checks only its new day: each day's input file (content-addressed JSONL, ``sft_dataset``'s or
``pretrain_corpus``'s) gets a receipt per index (``<out_root>/decontamination/<index key>/<file>.json``) listing
its contaminated rows, which items they hold and an example of the shared words; a file already checked against
this index costs one read of its receipt. With ``on_overlap: remove`` a day with contaminated rows is replaced by a
content-addressed copy without them (the shards downstream follow the bytes, as for any changed input); with
``report`` the rows stay and are counted. The report says how many rows were checked and removed, which protected
items training data contains, how many rows hold each source's items, and a few examples of what matched.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from nexa_dagster.core.common import storage
from nexa_dagster.core.data.contamination import ContaminationIndex

OnOverlap = Literal["remove", "report"]
TextsOf = Callable[[dict[str, Any]], list[str]]
EXAMPLES_KEPT = 5
INPUTS_FILE = "inputs.json"  # in a snapshot folder: the day files it was packed from and what the check found


@dataclass
class DecontaminationReport:
    """What the check of a set of day inputs found (``items_hit``: indices into the index's items)."""

    index_key: str
    on_overlap: str
    rows_checked: int = 0
    rows_checked_now: int = 0  # not read from a receipt: the new days of this night
    contaminated_rows: int = 0
    removed_rows: int = 0
    # protected items found in the training data that is KEPT, and the kept rows that hold them (file -> rows)
    items_hit: set[int] = field(default_factory=set)
    rows_hit: dict[str, list[int]] = field(default_factory=dict)
    items_by_row: dict[str, dict[int, list[int]]] = field(default_factory=dict)  # file -> kept row -> items
    examples: list[dict[str, Any]] = field(default_factory=list)
    # contaminated rows (kept or removed) per protected source ("eval_set v1", "rl_eval_set v1", "benchmark:<task>"):
    # a row is counted once for each source whose items it holds
    rows_by_source: dict[str, int] = field(default_factory=dict)

    def count_sources(self, hits: Sequence[dict[str, Any]], index: ContaminationIndex) -> None:
        for hit in hits:
            for source in {index.items[i][0] for i in hit["items"]}:
                self.rows_by_source[source] = self.rows_by_source.get(source, 0) + 1

    def summary(self) -> str:
        """One log line: how many rows hold protected text, per source, and the first example."""
        if not self.contaminated_rows:
            return (
                f"contamination check (index {self.index_key}): none of {self.rows_checked} rows holds eval-set, "
                f"RL eval-set or benchmark text ({self.rows_checked_now} checked now)"
            )
        return (
            f"contamination check (index {self.index_key}): {self.contaminated_rows} of {self.rows_checked} rows "
            f"hold protected text ({self.removed_rows} removed; by source {self.rows_by_source}); first: "
            f"{self.examples[0]}"
        )

    def metadata(self, index: ContaminationIndex) -> dict[str, Any]:
        return {
            "contamination_index": self.index_key,
            "contamination_on_overlap": self.on_overlap,
            "contamination_rows_checked": self.rows_checked,
            "contamination_rows_checked_now": self.rows_checked_now,
            "contaminated_rows": self.contaminated_rows,
            "contaminated_rows_removed": self.removed_rows,
            "protected_items_in_training_data": len(self.items_hit),
            "contaminated_rows_by_source": dict(sorted(self.rows_by_source.items())),
            "contamination_examples": self.examples,
        }


def template_segments(template: str) -> Callable[[str], list[str]]:
    """A function cutting a rendered prompt into what its template did NOT write: a teacher prompt shares the
    template's own words with every other prompt, and a 13-gram of boilerplate is no evidence of anything."""
    literals = [part.strip() for part in re.split(r"{{.*?}}|{%.*?%}", template, flags=re.S) if part.strip()]
    pattern = (
        re.compile("|".join(re.escape(p) for p in sorted(literals, key=len, reverse=True)))
        if literals
        else None
    )

    def segments(text: str) -> list[str]:
        return [s for s in (pattern.split(text) if pattern else [text]) if s.strip()]

    return segments


def chat_texts(prompt_segments: Callable[[str], list[str]]) -> TextsOf:
    """The texts of a chat record (``{"messages": [...]}``) that are checked: each user turn without its
    template's words, and each assistant turn (system prompts are configuration, shared by every sample)."""

    def texts(record: dict[str, Any]) -> list[str]:
        out: list[str] = []
        for message in record.get("messages", []):
            if message.get("role") == "user":
                out += prompt_segments(str(message.get("content", "")))
            elif message.get("role") == "assistant":
                out.append(str(message.get("content", "")))
        return out

    return texts


def document_texts(record: dict[str, Any]) -> list[str]:
    """A pretraining document's text."""
    return [str(record.get("text", ""))]


def check_file(path: str, index: ContaminationIndex, texts_of: TextsOf, id_field: str) -> dict[str, Any]:
    """Every row of a JSONL input checked: ``{"rows": n, "hits": [{"row", "id", "items", "example"}]}``."""
    hits, rows = [], 0
    with storage.open_read(path) as f:
        for row, line in enumerate(f):
            rows += 1
            record = json.loads(line)
            items, example = index.hits(texts_of(record))
            if items:
                hits.append(
                    {"row": row, "id": str(record.get(id_field, row)), "items": items, "example": example}
                )
    return {"file": path.rsplit("/", 1)[-1], "rows": rows, "hits": hits}


def decontaminate(
    days: Sequence[Any],
    index: ContaminationIndex,
    out_root: str,
    on_overlap: OnOverlap,
    texts_of: TextsOf,
    id_field: str,
    log: Callable[[str], None] = print,
) -> tuple[list[Any], DecontaminationReport]:
    """``days`` (objects with ``path`` and ``rows``, e.g. ``DayInput``) checked against ``index``; with
    ``remove``, the days with contaminated rows replaced by copies without them (``dataclasses.replace`` of
    ``path`` and ``rows``)."""
    receipts = storage.join(out_root, "decontamination", index.key)
    report = DecontaminationReport(index.key, on_overlap)
    kept: list[Any] = []
    for day in days:
        name = day.path.rsplit("/", 1)[-1]
        receipt_path = storage.join(receipts, f"{name}.json")
        if storage.exists(receipt_path):
            receipt = storage.read_json(receipt_path)
        else:
            receipt = check_file(day.path, index, texts_of, id_field)
            storage.write_json(receipt, receipt_path)
            report.rows_checked_now += receipt["rows"]
        report.rows_checked += receipt["rows"]
        report.contaminated_rows += len(receipt["hits"])
        report.count_sources(receipt["hits"], index)
        for hit in receipt["hits"][: max(0, EXAMPLES_KEPT - len(report.examples))]:
            report.examples.append(
                {
                    "file": name,
                    "id": hit["id"],
                    "matches": index.describe(hit["items"][0]),
                    "shared_words": hit["example"],
                }
            )
        if not receipt["hits"]:
            kept.append(day)
        elif on_overlap == "report":
            report.items_hit.update(i for hit in receipt["hits"] for i in hit["items"])
            report.rows_hit[day.path] = [hit["row"] for hit in receipt["hits"]]
            report.items_by_row[day.path] = {hit["row"]: hit["items"] for hit in receipt["hits"]}
            kept.append(day)
        else:
            report.removed_rows += len(receipt["hits"])
            # the cleaned copy is named in the receipt once made: a later night reuses it without reading the day
            # again (the receipt and the copy are both named by content, so the name stays right)
            clean_dir = storage.join(out_root, "inputs", "decontaminated")
            made = receipt.get("without_hits")
            if made and storage.exists(storage.join(clean_dir, made)):
                clean = storage.join(clean_dir, made)
            else:
                clean = _without_rows(day.path, {hit["row"] for hit in receipt["hits"]}, out_root)
                storage.write_json({**receipt, "without_hits": clean.rsplit("/", 1)[-1]}, receipt_path)
            if day.rows - len(receipt["hits"]):
                kept.append(replace(day, path=clean, rows=day.rows - len(receipt["hits"])))
    log(report.summary())
    return kept, report


@dataclass(frozen=True)
class InputFile:
    """A day input as a snapshot's ``inputs.json`` lists it (what ``decontaminate`` needs of a ``DayInput``)."""

    path: str
    rows: int


def recorded_inputs(snapshot: str, out_root: str) -> list[InputFile] | None:
    """The day files ``<snapshot>/inputs.json`` lists (``None`` for a snapshot packed before it was written)."""
    path = storage.join(snapshot, INPUTS_FILE)
    if not storage.exists(path):
        return None
    return [
        InputFile(storage.join(out_root, f["path"]), int(f["rows"])) for f in storage.read_json(path)["files"]
    ]


def record_inputs(
    snapshot: str,
    out_root: str,
    days: Sequence[Any],
    report: DecontaminationReport,
    index: ContaminationIndex,
) -> None:
    """``<snapshot>/inputs.json``: the day files the snapshot was packed from (paths relative to ``out_root``)
    and what the contamination check found, so an evaluation can say what a checkpoint's training data holds
    without re-reading every night's history."""
    prefix = out_root.rstrip("/") + "/"
    storage.write_json(
        {
            "files": [{"path": d.path.removeprefix(prefix), "rows": d.rows} for d in days],
            "contamination_index": index.key,
            "on_overlap": report.on_overlap,
            "contaminated_rows": report.contaminated_rows,
            "removed_rows": report.removed_rows,
            "items_in_training_data": sorted(index.describe(i) for i in report.items_hit),
        },
        storage.join(snapshot, INPUTS_FILE),
    )


def rows_of(path: str, rows: Sequence[int]) -> list[dict[str, Any]]:
    """The given rows of a JSONL input, parsed."""
    wanted = set(rows)
    with storage.open_read(path) as f:
        return [json.loads(line) for row, line in enumerate(f) if row in wanted]


def _without_rows(path: str, rows: set[int], out_root: str) -> str:
    """``path`` without the given rows, as a content-addressed file (the same rows removed give the same file)."""
    with storage.open_read(path) as f:
        body = b"".join(line for row, line in enumerate(f) if row not in rows)
    stem = path.rsplit("/", 1)[-1].rsplit("-", 1)[0]
    return storage.write_content_addressed(storage.join(out_root, "inputs", "decontaminated"), stem, body)
