"""Packaging: conversations -> chat-template tokens with an assistant loss mask -> fixed-length packed sequences.

Packing is best-fit-decreasing: the longest conversations are placed first, each into the fullest bin it still
fits, which wastes few slots. Each packed row records where its documents start (``cu_seqlens``) and restarts
``position_ids`` at every document so that training can keep attention within documents.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from nexa_dagster.core.llm.base import ChatMessage

PACKED_COLUMNS = ["input_ids", "loss_mask", "position_ids", "attention_mask", "cu_seqlens", "num_documents",
                  "num_tokens", "num_loss_tokens"]


@dataclass
class TokenizedConversation:
    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False


def conversation(system_prompt: str, prompt: str, response: str) -> list[ChatMessage]:
    msgs: list[ChatMessage] = []
    if system_prompt:
        msgs.append({"role": "system", "content": system_prompt})
    msgs.append({"role": "user", "content": prompt})
    msgs.append({"role": "assistant", "content": response})
    return msgs


def tokenize_conversation(tokenizer: Any, messages: Sequence[ChatMessage]) -> tuple[list[int], list[int]]:
    """Token ids of the chat-template rendering, and a mask that is 1 exactly on what the assistant wrote.

    Each message is rendered through the tokenizer's own chat template on its own, so the mask boundaries are
    exact; the assistant's end-of-turn token is learned too (that is how the model learns to stop).
    """
    ids: list[int] = []
    mask: list[int] = []
    for message in messages:
        rendered = tokenizer.apply_chat_template([message], tokenize=False)
        content = message["content"]
        head, _, tail = rendered.partition(content) if content else (rendered, "", "")
        head_ids = tokenizer.encode(head, add_special_tokens=False)
        body_ids = tokenizer.encode(content, add_special_tokens=False) if content else []
        tail_ids = tokenizer.encode(tail, add_special_tokens=False)
        learn = 1 if message["role"] == "assistant" else 0
        ids += head_ids + body_ids + tail_ids
        mask += [0] * len(head_ids) + [learn] * len(body_ids)
        # the end-of-turn token is learned for the assistant; the newline after it is template glue
        mask += [learn if i == 0 else 0 for i in range(len(tail_ids))]
    return ids, mask


@dataclass
class PackingStats:
    sequences: int = 0
    documents: int = 0
    real_tokens: int = 0
    loss_tokens: int = 0
    slots: int = 0
    truncated_documents: int = 0
    dropped_documents: int = 0
    per_bin: list[int] = field(default_factory=list)

    @property
    def efficiency(self) -> float:
        return self.real_tokens / self.slots if self.slots else 0.0


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of ``capacity`` (each length must be <= capacity)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (remaining capacity, bin index), kept sorted
    for i in order:
        n = lengths[i]
        pos = bisect.bisect_left(free, (n, -1))
        if pos < len(free):
            remaining, b = free.pop(pos)
            bins[b].append(i)
            bisect.insort(free, (remaining - n, b))
        else:
            bins.append([i])
            bisect.insort(free, (capacity - n, len(bins) - 1))
    return bins


def pack(conversations: Sequence[TokenizedConversation], pack_size: int, pad_id: int) -> tuple[pd.DataFrame, PackingStats]:
    """Pack tokenized conversations into rows of exactly ``pack_size`` tokens.

    A conversation longer than ``pack_size`` is cut at the end; if the cut leaves none of the assistant's tokens
    it is dropped (a prompt without its answer teaches nothing). Both are counted in the stats.
    """
    docs = []
    stats = PackingStats()
    for c in conversations:
        ids, mask = c.input_ids[:pack_size], c.loss_mask[:pack_size]
        if len(c.input_ids) > pack_size:
            if not any(mask):
                stats.dropped_documents += 1
                continue
            stats.truncated_documents += 1
        docs.append((ids, mask))
    rows = []
    for members in best_fit_decreasing([len(d[0]) for d in docs], pack_size):
        input_ids: list[int] = []
        loss_mask: list[int] = []
        position_ids: list[int] = []
        cu = [0]
        for i in members:
            ids, mask = docs[i]
            input_ids += ids
            loss_mask += mask
            position_ids += list(range(len(ids)))
            cu.append(len(input_ids))
        n_real = len(input_ids)
        pad = pack_size - n_real
        rows.append({
            "input_ids": input_ids + [pad_id] * pad,
            "loss_mask": loss_mask + [0] * pad,
            "position_ids": position_ids + list(range(pad)),
            "attention_mask": [1] * n_real + [0] * pad,
            "cu_seqlens": cu,
            "num_documents": len(members),
            "num_tokens": n_real,
            "num_loss_tokens": sum(loss_mask),
        })
        stats.real_tokens += n_real
        stats.loss_tokens += sum(loss_mask)
        stats.per_bin.append(n_real)
    stats.sequences = len(rows)
    stats.documents = len(docs)
    stats.slots = stats.sequences * pack_size
    return pd.DataFrame(rows, columns=PACKED_COLUMNS), stats


def is_validation(sample_id: str, fraction: float, seed: int = 0) -> bool:
    """A stable split: a sample stays on its side whatever else arrives later."""
    h = int(hashlib.sha256(f"{seed}:{sample_id}".encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < fraction


def split_train_validation(sample_ids: Sequence[str], fraction: float, seed: int = 0) -> tuple[list[int], list[int]]:
    """Indices for train and validation; both sides get at least one sample when there are two or more."""
    val = [i for i, s in enumerate(sample_ids) if is_validation(s, fraction, seed)]
    train = [i for i, s in enumerate(sample_ids) if not is_validation(s, fraction, seed)]
    if len(sample_ids) >= 2 and not val:
        val, train = train[-1:], train[:-1]
    if len(sample_ids) >= 2 and not train:
        train, val = val[-1:], val[:-1]
    return train, val


def run_hash(sample_ids: Sequence[str], tokenizer_fingerprint: str, chat_template: str, pack_size: int,
             seed: int) -> str:
    """What the packaged dataset is a function of; equal hashes mean byte-identical outputs."""
    h = hashlib.sha256()
    for part in (json.dumps(sorted(sample_ids)), tokenizer_fingerprint, chat_template, str(pack_size), str(seed)):
        h.update(part.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()[:16]


def tokenizer_fingerprint(tokenizer: Any) -> str:
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode("utf-8")).hexdigest()[:16]
