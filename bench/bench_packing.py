"""Packing benchmark: best-fit-decreasing vs. the naive baseline (one conversation per sequence, padded).

Run: .venv/bin/python bench/bench_packing.py [pack_size]
Tokenizes the shipped sample corpus as (prompt, answer) conversations with the tiny tokenizer and prints slot
efficiency (real tokens / slots) and packing speed for both. Last line: one JSON object with the figures.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from nexa_dagster.core.config import REPO_ROOT
from nexa_dagster.core.ingest import ingest_day
from nexa_dagster.core.packing import TokenizedConversation, conversation, pack, tokenize_conversation
from nexa_dagster.core.tiny_model import build_tiny_causal_lm


def main(pack_size: int) -> dict[str, float]:
    from transformers import AutoTokenizer

    model_dir = build_tiny_causal_lm(Path(tempfile.mkdtemp()) / "models" / "tiny-bench")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    convs = []
    for day_dir in sorted((REPO_ROOT / "sample_data" / "landing").iterdir()):
        docs = ingest_day(day_dir, day_dir.name, max_docs=None, max_chars=pack_size * 3)
        for d in docs.itertuples():
            half = len(d.text) // 2
            ids, mask = tokenize_conversation(tok, conversation("", d.text[:half], d.text[half:]))
            convs.append(TokenizedConversation(d.doc_id, ids, mask))
    t = time.perf_counter()
    _, bfd = pack(convs, pack_size, tok.pad_token_id)
    bfd_s = time.perf_counter() - t
    # baseline: no packing, each conversation padded to pack_size on its own
    naive_slots = len(convs) * pack_size
    naive_real = sum(min(len(c.input_ids), pack_size) for c in convs)
    figures = {
        "pack_size": pack_size,
        "conversations": len(convs),
        "bfd_sequences": bfd.sequences,
        "bfd_efficiency": round(bfd.efficiency, 4),
        "baseline_sequences": len(convs),
        "baseline_efficiency": round(naive_real / naive_slots, 4),
        "sequences_ratio_baseline_over_bfd": round(len(convs) / bfd.sequences, 2),
        "bfd_pack_seconds": round(bfd_s, 4),
    }
    for k, v in figures.items():
        print(f"{k:>36}: {v}")
    return figures


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 1024)))
