"""Packaging: conversations -> chat-template tokens with an assistant loss mask -> fixed-length packed sequences.

Packing is best-fit-decreasing: the longest conversations are placed first, each into the fullest bin it still
fits, which wastes few slots. Each packed row records where its documents start (``cu_seqlens``) and restarts
``position_ids`` at every document so that training can keep attention within documents.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from nexa_dagster.core.common import storage
from nexa_dagster.core.data.schemas import PackedSequences
from nexa_dagster.core.llm.base import ChatMessage
from nexa_dagster.core.packaging.formats.packed_split import PACKED_SCHEMA, iter_packed_tables


def conversation(system_prompt: str, prompt: str, response: str) -> list[ChatMessage]:
    msgs: list[ChatMessage] = []
    if system_prompt:
        msgs.append({"role": "system", "content": system_prompt})
    msgs.append({"role": "user", "content": prompt})
    msgs.append({"role": "assistant", "content": response})
    return msgs


@dataclass
class PackingStats:
    sequences: int = 0
    documents: int = 0
    real_tokens: int = 0
    loss_tokens: int = 0
    slots: int = 0
    truncated_documents: int = 0
    dropped_documents: int = 0

    @property
    def efficiency(self) -> float:
        return self.real_tokens / self.slots if self.slots else 0.0

    def add(self, other: PackingStats) -> None:
        for name in (
            "sequences",
            "documents",
            "real_tokens",
            "loss_tokens",
            "slots",
            "truncated_documents",
            "dropped_documents",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def to_json(self) -> dict[str, int]:
        return {
            "sequences": self.sequences,
            "documents": self.documents,
            "real_tokens": self.real_tokens,
            "loss_tokens": self.loss_tokens,
            "slots": self.slots,
            "truncated_documents": self.truncated_documents,
            "dropped_documents": self.dropped_documents,
        }

    @classmethod
    def from_json(cls, data: dict[str, int]) -> PackingStats:
        return cls(**data)


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


IGNORE_INDEX = -100  # what the cross-entropy of PyTorch and Hugging Face skips


def learned(loss_mask: Any, attention_mask: Any, position_ids: Any) -> Any:
    """Where a packed row's token is a training target (NumPy arrays or torch tensors alike).

    Only assistant tokens are learned (``loss_mask``), never padding, and never the first token of a packed
    document: it would be predicted from the end of an unrelated document. The one definition of the rule: the
    ``labels`` column is written from it and the trainer computes it for data without that column.
    """
    return (loss_mask == 1) & (attention_mask == 1) & (position_ids != 0)


def labels_of(
    input_ids: np.ndarray, loss_mask: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray
) -> np.ndarray:
    """Hugging Face ``labels``: the token id where it is learned, ``IGNORE_INDEX`` elsewhere, not shifted (the
    model shifts them by one itself, as ``transformers``' causal LMs and TRL's trainers expect)."""
    return np.where(learned(loss_mask, attention_mask, position_ids), input_ids, IGNORE_INDEX).astype(
        np.int32
    )


PACKED_COLUMNS = PACKED_SCHEMA.names


def _list_column(matrix: np.ndarray, value_type: pa.DataType) -> pa.Array:
    rows, width = matrix.shape
    offsets = pa.array(np.arange(0, (rows + 1) * width, width, dtype=np.int32), pa.int32())
    return pa.ListArray.from_arrays(offsets, pa.array(matrix.ravel(), value_type))


def pack_table(
    docs: Sequence[tuple[np.ndarray, np.ndarray]],
    pack_size: int,
    pad_id: int,
    stats: PackingStats | None = None,
) -> tuple[pa.Table, PackingStats]:
    """Pack ``(input_ids, loss_mask)`` documents into an Arrow table of rows of exactly ``pack_size`` tokens.

    A document longer than ``pack_size`` is cut at the end; if the cut leaves none of the assistant's tokens it is
    dropped (a prompt without its answer teaches nothing). Both are counted in the stats. Rows are built as
    NumPy matrices and handed to Arrow without per-token Python objects.
    """
    stats = stats or PackingStats()
    kept = _cut_to_pack_size(docs, pack_size, stats)
    bins = best_fit_decreasing([len(d[0]) for d in kept], pack_size)
    n = len(bins)
    input_ids, loss_mask, position_ids, attention_mask, cu_seqlens, num_tokens = _filled_rows(
        kept, bins, pack_size, pad_id
    )
    num_loss = loss_mask.sum(axis=1, dtype=np.int64)
    labels = labels_of(input_ids, loss_mask, attention_mask, position_ids)
    table = pa.Table.from_arrays(
        [
            _list_column(input_ids, pa.int32()),
            _list_column(loss_mask, pa.int8()),
            _list_column(position_ids, pa.int32()),
            _list_column(attention_mask, pa.int8()),
            pa.array(cu_seqlens, pa.list_(pa.int32())),
            pa.array([len(b) for b in bins], pa.int64()),
            pa.array(num_tokens, pa.int64()),
            pa.array(num_loss, pa.int64()),
            _list_column(labels, pa.int32()),
        ],
        schema=PACKED_SCHEMA,
    )
    stats.sequences += n
    stats.documents += len(kept)
    stats.real_tokens += int(num_tokens.sum())
    stats.loss_tokens += int(num_loss.sum())
    stats.slots += n * pack_size
    return table, stats


def _cut_to_pack_size(
    docs: Sequence[tuple[np.ndarray, np.ndarray]], pack_size: int, stats: PackingStats
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The non-empty documents, each cut to ``pack_size`` tokens; a cut one with no assistant token left is dropped.
    ``stats`` counts the truncated and the dropped ones."""
    kept: list[tuple[np.ndarray, np.ndarray]] = []
    for ids, mask in docs:
        if len(ids) > pack_size:
            ids, mask = ids[:pack_size], mask[:pack_size]
            if not np.any(mask):
                stats.dropped_documents += 1
                continue
            stats.truncated_documents += 1
        if len(ids):
            kept.append((ids, mask))
    return kept


def _filled_rows(
    kept: Sequence[tuple[np.ndarray, np.ndarray]], bins: list[list[int]], pack_size: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[list[int]], np.ndarray]:
    """One packed row per bin, its documents side by side then padding: the ``input_ids``, ``loss_mask``,
    ``position_ids`` (from 0 at every document, and in the padding) and ``attention_mask`` matrices, each row's
    document starts and end (``cu_seqlens``) and its real tokens."""
    n = len(bins)
    input_ids = np.full((n, pack_size), pad_id, dtype=np.int32)
    loss_mask = np.zeros((n, pack_size), dtype=np.int8)
    position_ids = np.empty((n, pack_size), dtype=np.int32)
    attention_mask = np.zeros((n, pack_size), dtype=np.int8)
    ramp = np.arange(pack_size, dtype=np.int32)
    cu_seqlens: list[list[int]] = []
    num_tokens = np.zeros(n, dtype=np.int64)
    for r, members in enumerate(bins):
        cu = [0]
        at = 0
        for i in members:
            ids, mask = kept[i]
            k = len(ids)
            input_ids[r, at : at + k] = ids
            loss_mask[r, at : at + k] = mask
            position_ids[r, at : at + k] = ramp[:k]
            at += k
            cu.append(at)
        position_ids[r, at:] = ramp[: pack_size - at]  # padding counts from 0 too; attention_mask hides it
        attention_mask[r, :at] = 1
        num_tokens[r] = at
        cu_seqlens.append(cu)
    return input_ids, loss_mask, position_ids, attention_mask, cu_seqlens, num_tokens


def tokenizer_fingerprint(tokenizer: Any) -> str:
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode("utf-8")).hexdigest()[:16]


_SENTINEL = "NEXA7SENTINEL7CONTENT"
_LOADED: dict[str, Any] = {}
_OPENER: list[ChatMessage] = [{"role": "system", "content": "Be brief."}]
_PROBE: list[ChatMessage] = [
    *_OPENER,
    {"role": "user", "content": "Why?"},
    {"role": "assistant", "content": "Because."},
    {"role": "user", "content": "And?"},
    {"role": "assistant", "content": "Done."},
]
_NOT_PER_MESSAGE = (
    "the chat template is not per-message (a conversation renders differently from its messages rendered one "
    "by one, after the template's preamble); this packer needs a per-message template"
)


def template_affixes(tokenizer: Any) -> tuple[dict[str, str], dict[str, str], str]:
    """Each role's text before and after its content, and the *preamble*: what the template writes before a
    conversation that does not open with a system message ('' for most; SmolLM2's, like Qwen's, is a default
    system message). Raises unless the two shapes ``conversation`` builds, with and without a system message
    first, render as the preamble (when there is no system message) then each message's head, content and tail.

    A role other than system is rendered after a system message, so a template's once-per-conversation text
    (a default system prompt, a BOS token) lands in the preamble or the system head, not in every message."""

    def render(messages: list[ChatMessage]) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False)

    opened = render(_OPENER)
    heads: dict[str, str] = {}
    tails: dict[str, str] = {}
    for role in ("system", "user", "assistant"):
        message: list[ChatMessage] = [{"role": role, "content": _SENTINEL}]
        rendered = render(message) if role == "system" else render(_OPENER + message)
        if role != "system":
            if not rendered.startswith(opened):
                raise ValueError(_NOT_PER_MESSAGE)
            rendered = rendered[len(opened) :]
        if rendered.count(_SENTINEL) != 1:
            raise ValueError(
                f"chat template renders a {role} message's content {rendered.count(_SENTINEL)} times"
            )
        heads[role], _, tails[role] = rendered.partition(_SENTINEL)
    lone, user = render([{"role": "user", "content": _SENTINEL}]), heads["user"] + _SENTINEL + tails["user"]
    if not lone.endswith(user):
        raise ValueError(_NOT_PER_MESSAGE)
    preamble = lone[: -len(user)]
    for probe, before in ((_PROBE, ""), (_PROBE[1:], preamble)):
        parts = "".join(heads[m["role"]] + m["content"] + tails[m["role"]] for m in probe)
        if render(probe) != before + parts:
            raise ValueError(_NOT_PER_MESSAGE)
    return heads, tails, preamble


@dataclass(frozen=True)
class ChatTokenizer:
    """Chat-template tokenization without rendering Jinja per conversation, picklable to worker processes.

    The template is rendered once per role around a sentinel, which gives each role's head and tail (for the
    project's template: ``<|im_start|>assistant\n`` and ``<|im_end|>\n``), tokenized once. A conversation is then
    the concatenation of head, content and tail tokens per message, with the contents of a whole batch tokenized
    in one call to the Rust tokenizer, after the template's preamble when it does not open with a system message
    (``template_affixes``). ``from_hf`` checks that the template really renders that way and refuses it
    otherwise, so the fast path never gives different tokens from rendering the whole conversation.
    """

    tokenizer_file: str
    fingerprint: str
    heads: dict[str, tuple[int, ...]]
    tails: dict[str, tuple[int, ...]]
    pad_id: int
    eos_id: int | None
    vocab_size: int
    preamble: tuple[int, ...] = ()  # before a conversation without a system message first (not learned)

    @classmethod
    def from_hf(cls, tokenizer: Any, tokenizer_file: str) -> ChatTokenizer:
        """Build from a Hugging Face tokenizer; its ``tokenizer.json`` is written to ``tokenizer_file`` for workers."""
        heads, tails, preamble = template_affixes(tokenizer)

        def encode(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        fingerprint = tokenizer_fingerprint(tokenizer)
        if not storage.exists(tokenizer_file):
            storage.write_text(tokenizer.backend_tokenizer.to_str(), tokenizer_file)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError("the tokenizer has neither a pad nor an eos token to pad packed sequences with")
        return cls(
            tokenizer_file,
            fingerprint,
            {role: encode(text) for role, text in heads.items()},
            {role: encode(text) for role, text in tails.items()},
            int(pad),
            tokenizer.eos_token_id,
            len(tokenizer),
            encode(preamble),
        )

    def describe(self) -> dict[str, Any]:
        """What the tokens depend on (goes into the run hash); the file location does not."""
        return {
            "fingerprint": self.fingerprint,
            "heads": {k: list(v) for k, v in sorted(self.heads.items())},
            "tails": {k: list(v) for k, v in sorted(self.tails.items())},
            "pad_id": self.pad_id,
            **({"preamble": list(self.preamble)} if self.preamble else {}),  # absent: the hashes of before
        }

    def _backend(self) -> Any:
        tok = _LOADED.get(self.fingerprint)
        if tok is None:
            from tokenizers import Tokenizer  # only when text is tokenized: not at the code location's load

            with storage.open_read(self.tokenizer_file) as f:
                tok = Tokenizer.from_str(f.read().decode("utf-8"))
            _LOADED[self.fingerprint] = tok
        return tok

    def encode_texts(self, texts: Sequence[str]) -> list[list[int]]:
        """Plain token ids for a batch of texts (no special tokens added)."""
        backend = self._backend()
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        return [e.ids for e in encode(list(texts), add_special_tokens=False)]

    def encode_conversations(
        self, conversations: Sequence[Sequence[ChatMessage]]
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(input_ids, loss_mask)`` per conversation; the mask is 1 on the assistant's content and end-of-turn."""
        bodies = self.encode_texts([m["content"] for c in conversations for m in c])
        out = []
        k = 0
        for conv in conversations:
            ids: list[int] = [] if conv and conv[0]["role"] == "system" else list(self.preamble)
            mask: list[int] = [0] * len(ids)
            for m in conv:
                head, tail, body = self.heads[m["role"]], self.tails[m["role"]], bodies[k]
                k += 1
                learn = 1 if m["role"] == "assistant" else 0
                ids += head
                ids += body
                ids += tail
                mask += [0] * len(head)
                mask += [learn] * len(body)
                if (
                    tail
                ):  # the end-of-turn token is learned for the assistant; what follows it is template glue
                    mask.append(learn)
                    mask += [0] * (len(tail) - 1)
            out.append((np.array(ids, dtype=np.int32), np.array(mask, dtype=np.int8)))
        return out


def check_packed_file(path: str, pack_size: int, label: str = "") -> list[str]:
    """Problems with a packed split as training will read it (empty list: fine).

    ``path`` is a split manifest (``core/packed_split``) or a packed Parquet file; the shard files are checked one
    at a time, and rows are numbered across the whole split, in the order training reads them. A split that
    cannot be read (a shard gone from the store, cut short, or no longer Parquet) is a problem naming it, as
    training would fail on it: the asset check fails instead of erroring.
    """
    where = label or path
    problems: list[str] = []
    offset = loss_tokens = 0
    tables = iter_packed_tables(path)
    while True:
        try:
            shard = next(tables, None)
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            return [*problems, f"{where} ({path}) cannot be read: {type(e).__name__}: {str(e)[:300]}"]
        if shard is None:
            break
        frame = shard[1].to_pandas()
        frame.index += offset
        offset += len(frame)
        problems += _frame_problems(frame, pack_size, where, PackedSequences)
        loss_tokens += int(frame["num_loss_tokens"].sum())
    if loss_tokens == 0:
        problems.append(f"{where}: no loss-masked (assistant) tokens")
    return problems


def _frame_problems(frame: Any, pack_size: int, where: str, schema: Any) -> list[str]:
    schema.validate(frame)
    problems = []
    if not frame["input_ids"].map(len).eq(pack_size).all():
        problems.append(f"{where}: a row is not {pack_size} tokens long")
    for row in frame.itertuples():
        cu = list(row.cu_seqlens)
        if cu[0] != 0 or cu[-1] != row.num_tokens or any(b <= a for a, b in zip(cu, cu[1:], strict=False)):
            problems.append(
                f"{where}: row {row.Index} has document boundaries {cu} for {row.num_tokens} tokens"
            )
            break
    if "labels" in frame.columns:
        columns = {
            c: np.stack(frame[c].to_numpy())
            for c in ("input_ids", "loss_mask", "attention_mask", "position_ids", "labels")
        }
        expected = labels_of(
            columns["input_ids"], columns["loss_mask"], columns["attention_mask"], columns["position_ids"]
        )
        wrong = np.flatnonzero((columns["labels"] != expected).any(axis=1))
        if len(wrong):
            problems.append(
                f"{where}: row {int(wrong[0]) + int(frame.index[0])} has labels that disagree with its "
                f"input_ids/loss_mask ({len(wrong)} rows in all)"
            )
    return problems
