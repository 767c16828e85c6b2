"""Contamination: does a training text contain an eval example or a benchmark item? By n-gram overlap.

As the common decontamination tools do (GPT-3's paper, lm-evaluation-harness's ``decontamination``), texts are
normalised (Unicode NFKC, lower case, words of letters and digits only) and compared by word n-grams (``n`` = 13
by default): a training text that shares one n-gram with a protected item (a frozen eval example, a benchmark
item) is contaminated by it. A protected item shorter than ``n`` words but at least ``min_words`` long is matched
whole (as a run of its words); a shorter one is too generic to check and is counted as unchecked.

``ContaminationIndex`` holds the hashed n-grams of every protected item with the items they came from, sorted, so
a training text is checked with one vectorised lookup; it is built once per set of protected items (its ``key``
hashes them and the settings) and saved beside the data (``save``/``load``). Dagster-free.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nexa_dagster.core.common import storage

WORD = re.compile(r"[^\W_]+")  # letters and digits, any script
FORMAT = "nexa-contamination-index/1"


def normalise(text: str) -> list[str]:
    """The words of ``text`` as compared: NFKC, lower case, punctuation and spacing dropped."""
    return WORD.findall(unicodedata.normalize("NFKC", text).lower())


def _hash(words: Sequence[str]) -> int:
    return int.from_bytes(hashlib.blake2b(" ".join(words).encode("utf-8"), digest_size=8).digest(), "little")


def window_hashes(words: Sequence[str], size: int) -> np.ndarray:
    """The hash of every run of ``size`` consecutive words (none when there are fewer)."""
    return np.fromiter((_hash(words[i : i + size]) for i in range(len(words) - size + 1)), dtype=np.uint64)


@dataclass(frozen=True)
class ProtectedItem:
    """What training must not contain: a frozen eval example or a benchmark item, and the texts that say it."""

    source: str  # "eval_set v<N>" or "benchmark:<task>"
    item_id: str
    texts: tuple[str, ...]


@dataclass
class Hit:
    """A training row that contains protected items: which ones, and the first shared words (an example)."""

    row_id: str
    items: list[int]
    example: str


@dataclass
class ContaminationIndex:
    """Every protected item's n-grams (hash -> item), sorted for lookup; ``sizes`` maps a window size to its
    hashes and owners (``n`` for the long items, each shorter length for items matched whole)."""

    n: int
    min_words: int
    items: list[tuple[str, str]]  # (source, item id) per item index
    sizes: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    unchecked: list[int] = field(default_factory=list)  # items shorter than min_words
    key: str = ""

    @classmethod
    def build(cls, protected: Iterable[ProtectedItem], n: int = 13, min_words: int = 8) -> ContaminationIndex:
        if n < 1 or min_words < 1:
            raise ValueError(f"n ({n}) and min_words ({min_words}) must be positive")
        protected = list(protected)
        items: list[tuple[str, str]] = []
        grams: dict[int, list[tuple[int, int]]] = {}
        unchecked: list[int] = []
        for index, item in enumerate(protected):
            items.append((item.source, item.item_id))
            checkable = False
            for text in item.texts:
                words = normalise(text)
                size = n if len(words) >= n else len(words)
                if size < min_words:
                    continue
                checkable = True
                grams.setdefault(size, []).extend((int(h), index) for h in window_hashes(words, size))
            if not checkable:
                unchecked.append(index)
        sizes = {}
        for size, pairs in grams.items():
            pairs.sort()
            sizes[size] = (
                np.array([h for h, _ in pairs], dtype=np.uint64),
                np.array([i for _, i in pairs], dtype=np.int64),
            )
        return cls(n, min_words, items, sizes, unchecked, index_key(protected, n, min_words))

    def hits(self, texts: Iterable[str]) -> tuple[list[int], str]:
        """The protected items ``texts`` contain (sorted item indices) and the first shared words, or ([], "")."""
        found: set[int] = set()
        example = ""
        for text in texts:
            words = normalise(text)
            for size, (hashes, owners) in self.sizes.items():
                windows = window_hashes(words, size)
                if not len(windows) or not len(hashes):
                    continue
                positions = np.searchsorted(hashes, windows)
                positions = np.minimum(positions, len(hashes) - 1)
                matched = hashes[positions] == windows
                if not matched.any():
                    continue
                for w in np.flatnonzero(matched):
                    start = int(positions[w])
                    while start > 0 and hashes[start - 1] == windows[w]:
                        start -= 1
                    end = start
                    while end < len(hashes) and hashes[end] == windows[w]:
                        found.add(int(owners[end]))
                        end += 1
                    if not example:
                        example = " ".join(words[int(w) : int(w) + size])
        return sorted(found), example

    def share(self, items_hit: Iterable[int], source_prefix: str) -> float | None:
        """The share of the protected items whose source starts with ``source_prefix`` (``"eval_set"``,
        ``"benchmark:<task>"``) among ``items_hit``; None when the index protects none of them."""
        of_source = {i for i, (source, _) in enumerate(self.items) if source.startswith(source_prefix)}
        return len(of_source & set(items_hit)) / len(of_source) if of_source else None

    def describe(self, item: int) -> str:
        source, item_id = self.items[item]
        return f"{source} {item_id}"

    def save(self, directory: str) -> None:
        """``index.json`` (items, settings, key) and one ``.npz`` of hashes and owners per window size, atomically."""
        for size, (hashes, owners) in self.sizes.items():
            with storage.atomic_writer(storage.join(directory, f"ngrams-{size}.npz")) as f:
                np.savez(f, hashes=hashes, owners=owners)
        storage.write_json(
            {
                "format": FORMAT,
                "key": self.key,
                "n": self.n,
                "min_words": self.min_words,
                "items": self.items,
                "sizes": sorted(self.sizes),
                "unchecked": self.unchecked,
            },
            storage.join(directory, "index.json"),
        )

    @classmethod
    def load(cls, directory: str) -> ContaminationIndex:
        meta: dict[str, Any] = storage.read_json(storage.join(directory, "index.json"))
        if meta.get("format") != FORMAT:
            raise ValueError(
                f"{directory}/index.json: not a contamination index (format {meta.get('format')!r})"
            )
        sizes = {}
        for size in meta["sizes"]:
            with storage.open_read(storage.join(directory, f"ngrams-{size}.npz")) as f:
                data = np.load(f)
                sizes[int(size)] = (data["hashes"], data["owners"])
        return cls(
            meta["n"],
            meta["min_words"],
            [tuple(i) for i in meta["items"]],
            sizes,
            meta["unchecked"],
            meta["key"],
        )


def index_key(protected: Sequence[ProtectedItem], n: int, min_words: int) -> str:
    """What names an index: the protected items' texts and the settings (another eval-set version, another key)."""
    digest = hashlib.sha256(f"{FORMAT}:{n}:{min_words}".encode())
    for item in protected:
        digest.update(json.dumps([item.source, item.item_id, list(item.texts)]).encode("utf-8"))
    return digest.hexdigest()[:16]


def load_or_build(
    root: str, protected: Sequence[ProtectedItem], n: int, min_words: int
) -> ContaminationIndex:
    """The index of ``protected`` under ``<root>/<key>/``: built once, then read (a new eval-set version or
    benchmark set has another key, hence its own index)."""
    directory = storage.join(root, index_key(protected, n, min_words))
    if storage.exists(storage.join(directory, "index.json")):
        return ContaminationIndex.load(directory)
    index = ContaminationIndex.build(protected, n, min_words)
    index.save(directory)
    return index
