"""Megatron-Core bin/idx: the .idx layout checked field by field against the published format, and reading back."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from nexa_dagster.core.packaging.formats.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
    best_fitting_dtype,
)

# Megatron-Core's DType codes (megatron/core/datasets/indexed_dataset.py), written out here on purpose: the test
# must fail if the module's table drifts from the published one.
MEGATRON_CODES = {
    np.uint8: 1,
    np.int8: 2,
    np.int16: 3,
    np.int32: 4,
    np.int64: 5,
    np.float64: 6,
    np.float32: 7,
    np.uint16: 8,
}


def _write(prefix: str, docs: list[list[list[int]]], dtype: type) -> None:
    with IndexedDatasetWriter(prefix, dtype) as w:
        for doc in docs:
            for seq in doc:
                w.add_item(seq)
            w.end_document()


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_idx_layout_field_by_field(tmp_path: Path, dtype: type) -> None:
    docs = [[[5, 6, 7]], [[1], [2, 3]], [[9, 9, 9, 9, 9]]]  # doc 2 has two sequences
    prefix = str(tmp_path / "corpus")
    _write(prefix, docs, dtype)
    raw = (tmp_path / "corpus.idx").read_bytes()
    itemsize = np.dtype(dtype).itemsize
    lengths = [3, 1, 2, 5]

    assert raw[0:9] == b"MMIDIDX\x00\x00"  # magic
    assert struct.unpack("<Q", raw[9:17]) == (1,)  # version
    assert struct.unpack("<B", raw[17:18]) == (MEGATRON_CODES[dtype],)  # dtype code
    assert struct.unpack("<Q", raw[18:26]) == (4,)  # sequence count
    assert struct.unpack("<Q", raw[26:34]) == (4,)  # document count = documents + 1
    off = 34
    assert list(struct.unpack("<4i", raw[off : off + 16])) == lengths  # sizes, int32
    off += 16
    assert list(struct.unpack("<4q", raw[off : off + 32])) == [
        0,
        3 * itemsize,
        4 * itemsize,
        6 * itemsize,
    ]  # bytes
    off += 32
    assert list(struct.unpack("<4q", raw[off : off + 32])) == [0, 1, 3, 4]  # document indices, int64
    off += 32
    assert off == len(raw)  # nothing else (no sequence modes)

    data = (tmp_path / "corpus.bin").read_bytes()
    assert data == np.array([5, 6, 7, 1, 2, 3, 9, 9, 9, 9, 9], dtype=dtype).tobytes()

    ds = IndexedDataset(prefix)
    assert len(ds) == 4 and ds.num_documents == 3 and ds.dtype is dtype
    assert [x.tolist() for x in ds] == [[5, 6, 7], [1], [2, 3], [9, 9, 9, 9, 9]]
    assert [x.tolist() for x in ds.document(1)] == [[1], [2, 3]]


def test_dtype_follows_megatron_rule() -> None:
    assert best_fitting_dtype(2048) is np.uint16 and best_fitting_dtype(65500) is np.int32
    assert best_fitting_dtype(None) is np.int32


def test_memory_filesystem_and_empty_dataset() -> None:
    prefix = "memory://nexa-idx-test/c"
    _write(prefix, [[[1, 2]], [[3]]], np.int32)
    ds = IndexedDataset(prefix)
    assert [x.tolist() for x in ds] == [[1, 2], [3]]
    _write("memory://nexa-idx-test/empty", [], np.uint16)
    assert len(IndexedDataset("memory://nexa-idx-test/empty")) == 0


def test_reader_rejects_bad_files(tmp_path: Path) -> None:
    prefix = str(tmp_path / "c")
    _write(prefix, [[[1, 2, 3]]], np.int32)
    with open(tmp_path / "c.bin", "ab") as f:  # a .bin that does not match its .idx
        f.write(b"\0\0\0\0")
    with pytest.raises(IndexedDatasetError, match=r"c\.bin: 16 bytes but .*c\.idx describes 12"):
        IndexedDataset(prefix)
    raw = bytearray((tmp_path / "c.idx").read_bytes())
    raw[0:9] = b"NOTANIDX!"
    (tmp_path / "c.idx").write_bytes(bytes(raw))
    with pytest.raises(IndexedDatasetError, match="magic"):
        IndexedDataset(prefix)


def test_failed_write_leaves_nothing(tmp_path: Path) -> None:
    prefix = str(tmp_path / "c")
    with pytest.raises(RuntimeError), IndexedDatasetWriter(prefix, np.int32) as w:
        w.add_document([1, 2])
        raise RuntimeError("tokenizer crashed")
    assert list(tmp_path.iterdir()) == []
