"""Feed the packed Parquet to a Hugging Face ``Trainer`` (or TRL's ``SFTTrainer``) padding-free.

A packed row already holds several documents with ``position_ids`` restarting at each; the collator concatenates
the real tokens of a batch's rows into one ``[1, tokens]`` sequence and passes ``position_ids`` on, from which
``transformers`` (its flash-attention kernels, and its SDPA/eager masks when no ``attention_mask`` is given) keeps
attention within each document, as ``DataCollatorWithFlattening`` does. ``labels`` come from the stored column
(-100 off the loss mask and on each document's first token), so nothing is learned across a boundary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch  # the collator exists to feed a torch Trainer: its importers have torch loaded

COLUMNS = ("input_ids", "labels", "position_ids")


class PackedRowsCollator:
    """``Trainer`` collator for rows of the packed Parquet (``datasets.Dataset.from_parquet(...)``)."""

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        parts: dict[str, list[np.ndarray]] = {c: [] for c in COLUMNS}
        for i, row in enumerate(rows):
            missing = [c for c in (*COLUMNS, "num_tokens") if c not in row]
            if missing:
                raise ValueError(
                    f"packed row {i} lacks {missing}: read the packed Parquet of packaging "
                    "(packed-sft-parquet/3 or later) and keep its columns (remove_unused_columns=False)"
                )
            n = int(row["num_tokens"])  # the padding after them is dropped, not masked
            for c in COLUMNS:
                parts[c].append(np.asarray(row[c][:n], dtype=np.int64))
        return {c: torch.from_numpy(np.concatenate(v))[None] for c, v in parts.items()}
