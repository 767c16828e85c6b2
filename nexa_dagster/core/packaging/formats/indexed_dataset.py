"""Megatron-Core indexed datasets (``.bin`` + ``.idx``): the pretraining format Megatron reads with ``IndexedDataset``.

The layout is Megatron-Core's ``_IndexWriter`` / ``_IndexReader`` (``megatron/core/datasets/indexed_dataset.py``),
so a prefix written here can be handed to Megatron's ``--data-path`` unchanged:

``.bin``: the tokens of every sequence, back to back, in the dataset's dtype, nothing else.

``.idx`` (little-endian):

==========================  =====================================================================
``b"MMIDIDX\\x00\\x00"``     9-byte magic
version                     ``<Q``, always 1
dtype code                  ``<B``: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
sequence count              ``<Q``
document count              ``<Q``: number of entries in the document index (documents + 1)
sequence lengths            int32 x sequence count (elements per sequence)
sequence pointers           int64 x sequence count (byte offset of each sequence in ``.bin``)
document indices            int64 x document count: ``[0, end of doc 1, end of doc 2, ...]`` in sequences
==========================  =====================================================================

Writes are streaming (tokens go to disk as they come; only the per-sequence lengths stay in memory) and atomic
(both files appear under their names only when the writer is closed without an error).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any

import numpy as np

from nexa_dagster.core.common import roots, storage

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
DTYPE_CODES: dict[type, int] = {
    np.uint8: 1,
    np.int8: 2,
    np.int16: 3,
    np.int32: 4,
    np.int64: 5,
    np.float64: 6,
    np.float32: 7,
    np.uint16: 8,
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class IndexedDatasetError(ValueError):
    """A ``.idx``/``.bin`` pair that does not follow the layout; the message names the file and the field."""


def best_fitting_dtype(vocab_size: int | None) -> type:
    """Megatron's rule: uint16 when every token id fits (vocabularies under 65500), int32 otherwise."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def data_file_path(prefix: str) -> str:
    return f"{prefix}.bin"


def index_file_path(prefix: str) -> str:
    return f"{prefix}.idx"


def encode_index(sequence_lengths: np.ndarray, document_indices: np.ndarray, dtype: Any) -> bytes:
    """The ``.idx`` bytes for these sequences (pointers are derived: each sequence follows the previous one)."""
    dtype = np.dtype(dtype).type
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    docs = np.asarray(document_indices, dtype=np.int64)
    return b"".join(
        [
            INDEX_HEADER,
            struct.pack("<Q", INDEX_VERSION),
            struct.pack("<B", DTYPE_CODES[dtype]),
            struct.pack("<Q", len(lengths)),
            struct.pack("<Q", len(docs)),
            lengths.astype("<i4").tobytes(order="C"),
            pointers.astype("<i8").tobytes(order="C"),
            docs.astype("<i8").tobytes(order="C"),
        ]
    )


class IndexedDatasetWriter:
    """Write one ``.bin``/``.idx`` pair, document by document (Megatron's ``IndexedDatasetBuilder``).

    ``add_document(tokens)`` writes one sequence and closes a document (the pretraining case: a document is one
    sequence); ``add_item`` + ``end_document`` build documents of several sequences.
    """

    def __init__(self, prefix: str, dtype: Any = np.int32) -> None:
        dtype = np.dtype(dtype).type
        if dtype not in DTYPE_CODES:
            raise IndexedDatasetError(
                f"{prefix}: dtype {dtype} has no Megatron code; use one of {list(DTYPE_CODES)}"
            )
        self.prefix = prefix
        self.dtype = dtype
        self._bin = storage.atomic_writer(data_file_path(prefix))
        self._file = self._bin.__enter__()
        self._lengths: list[int] = []
        self._documents: list[int] = [0]
        self.num_tokens = 0
        self._closed = False

    def add_item(self, tokens: Iterable[int] | np.ndarray) -> None:
        array = np.asarray(tokens, dtype=self.dtype)
        self._file.write(array.tobytes(order="C"))
        self._lengths.append(int(array.size))
        self.num_tokens += int(array.size)

    def end_document(self) -> None:
        self._documents.append(len(self._lengths))

    def add_document(self, tokens: Iterable[int] | np.ndarray) -> None:
        self.add_item(tokens)
        self.end_document()

    @property
    def num_documents(self) -> int:
        return len(self._documents) - 1

    def close(self) -> None:
        """Put ``.bin`` in place, then ``.idx``: a prefix whose ``.idx`` exists is complete."""
        if self._closed:
            return
        self._closed = True
        self._bin.__exit__(None, None, None)
        index = encode_index(
            np.asarray(self._lengths, dtype=np.int32), np.asarray(self._documents), self.dtype
        )
        with storage.atomic_writer(index_file_path(self.prefix)) as f:
            f.write(index)

    def abort(self) -> None:
        """Drop what was written (nothing appears under the prefix)."""
        if not self._closed:
            self._closed = True
            self._bin.__exit__(RuntimeError, RuntimeError("aborted"), None)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class IndexedDataset:
    """Read a ``.bin``/``.idx`` pair: ``len(ds)`` sequences, ``ds[i]`` the tokens of sequence ``i``.

    Local files are memory-mapped (constant memory whatever the size); other fsspec URLs are read per sequence
    with ranged reads.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        idx_path = index_file_path(prefix)
        with storage.open_read(idx_path) as f:
            raw = f.read()
        self._parse_index(raw, idx_path)
        self._local = "://" not in prefix or prefix.startswith("file://")
        bin_path = data_file_path(prefix)
        expected = (
            int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.itemsize
            if len(self.sequence_lengths)
            else 0
        )
        actual = storage.size(bin_path)
        if actual != expected:
            raise IndexedDatasetError(f"{bin_path}: {actual} bytes but {idx_path} describes {expected}")
        self._bin: Any = (
            np.memmap(bin_path.removeprefix("file://"), dtype=self.dtype, mode="r")
            if self._local and expected
            else None
        )

    def _parse_index(self, raw: bytes, where: str) -> None:
        header_len = len(INDEX_HEADER) + 8 + 1 + 8 + 8
        if len(raw) < header_len:
            raise IndexedDatasetError(f"{where}: {len(raw)} bytes, shorter than the {header_len}-byte header")
        if raw[:9] != INDEX_HEADER:
            raise IndexedDatasetError(f"{where}: magic is {raw[:9]!r}, expected {INDEX_HEADER!r}")
        (version,) = struct.unpack_from("<Q", raw, 9)
        if version != INDEX_VERSION:
            raise IndexedDatasetError(f"{where}: version {version}, expected {INDEX_VERSION}")
        (code,) = struct.unpack_from("<B", raw, 17)
        if code not in CODE_DTYPES:
            raise IndexedDatasetError(f"{where}: unknown dtype code {code}")
        self.dtype = CODE_DTYPES[code]
        self.itemsize = np.dtype(self.dtype).itemsize
        n_seq, n_doc = struct.unpack_from("<QQ", raw, 18)
        expected = header_len + n_seq * 4 + n_seq * 8 + n_doc * 8
        if len(raw) < expected:
            raise IndexedDatasetError(f"{where}: {len(raw)} bytes, the header promises {expected}")
        offset = header_len
        self.sequence_lengths = np.frombuffer(raw, dtype="<i4", count=n_seq, offset=offset)
        offset += n_seq * 4
        self.sequence_pointers = np.frombuffer(raw, dtype="<i8", count=n_seq, offset=offset)
        offset += n_seq * 8
        self.document_indices = np.frombuffer(raw, dtype="<i8", count=n_doc, offset=offset)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return max(len(self.document_indices) - 1, 0)

    def __getitem__(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(f"{self.prefix}: sequence {i} out of range ({len(self)} sequences)")
        i %= len(self)
        start = int(self.sequence_pointers[i]) // self.itemsize
        n = int(self.sequence_lengths[i])
        if self._bin is not None:
            return np.asarray(self._bin[start : start + n])
        with storage.open_read(data_file_path(self.prefix)) as f:
            f.seek(int(self.sequence_pointers[i]))
            return np.frombuffer(f.read(n * self.itemsize), dtype=self.dtype)

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(len(self)):
            yield self[i]

    def document(self, d: int) -> list[np.ndarray]:
        """The sequences of document ``d``."""
        lo, hi = int(self.document_indices[d]), int(self.document_indices[d + 1])
        return [self[i] for i in range(lo, hi)]


# -- a corpus: the prefixes megatron_blend.json lists, and its documents -------------------------------------------
def document_id(tokens: np.ndarray) -> str:
    """A content id for a tokenized document: the same tokens give the same id in any shard or dtype."""
    return hashlib.sha256(np.asarray(tokens, dtype="<i8").tobytes()).hexdigest()


def corpus_prefixes(path: str) -> list[str]:
    """The bin/idx prefixes of a corpus given as ``megatron_blend.json``, a corpus root (which holds one), or
    one prefix (``<prefix>.idx`` exists)."""
    if storage.exists(f"{path}.idx"):
        return [path]
    blend = path if path.endswith(".json") else storage.join(path, "megatron_blend.json")
    if not storage.exists(blend):
        raise FileNotFoundError(
            f"pretraining corpus not found: {path} (neither a megatron_blend.json, a corpus "
            "directory holding one, nor a bin/idx prefix)"
        )
    data_paths = storage.read_json(blend).get("data_paths")
    if not isinstance(data_paths, list) or len(data_paths) % 2:
        raise ValueError(f"{blend}: data_paths must be a list of [weight, prefix, ...] pairs")
    prefixes = [_prefix_here(str(p), blend) for p in data_paths[1::2]]
    if not prefixes:
        raise ValueError(f"pretraining corpus {blend} lists no non-empty shard")
    return prefixes


def _prefix_here(prefix: str, blend: str) -> str:
    """A prefix as the blend lists it (absolute, for Megatron's ``--data-path``), or, when the corpus has moved
    since (a moved data root), the same shard under the corpus's root as it is now (``core.common.roots``)."""
    if storage.exists(f"{prefix}.idx") or not prefix.startswith("/"):
        return prefix
    corpus_root = blend.rsplit("/", 2)[0]  # <corpus root>/<run hash>/megatron_blend.json
    found = roots.found_under(f"{prefix}.idx", [corpus_root])
    return found.removesuffix(".idx") if found else prefix


def read_documents(prefixes: list[str]) -> list[np.ndarray]:
    """Every document of the corpus, each as one token array (a document's sequences joined), in corpus order."""
    documents: list[np.ndarray] = []
    for prefix in prefixes:
        dataset = IndexedDataset(prefix)
        for d in range(dataset.num_documents):
            parts = dataset.document(d)
            if parts:
                documents.append(np.concatenate(parts).astype(np.int64))
    return documents
