"""Pretraining corpora for tests: real Megatron bin/idx shards written with the project's writer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from nexa_dagster.core.packaging.formats.indexed_dataset import IndexedDatasetWriter
from nexa_dagster.core.tiny.model import SPECIAL_TOKENS


def write_corpus(root: Path, documents: list[list[int]], shards: int = 2) -> str:
    """A corpus as pretrain_corpus writes it: bin/idx shards and a megatron_blend.json listing them."""
    data_paths: list[object] = []
    for s in range(shards):
        prefix = str(root / "shards" / f"{s:05d}")
        with IndexedDatasetWriter(prefix, np.uint16) as writer:
            for doc in documents[s::shards]:
                writer.add_document(np.asarray(doc, dtype=np.uint16))
        data_paths += [sum(len(d) for d in documents[s::shards]), prefix]
    (root / "megatron_blend.json").write_text(json.dumps({"data_paths": data_paths}))
    return str(root)


def random_documents(
    n: int, vocab: int, eos: int, seed: int = 0, lengths: tuple[int, int] = (5, 40)
) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [
        rng.integers(len(SPECIAL_TOKENS), vocab, int(rng.integers(*lengths))).tolist() + [eos]
        for _ in range(n)
    ]
