"""Transforms of JSONL records for SFT and RL, named in a blend's YAML.

The transforms are those of Nemotron's ``data_prep.formats.transforms`` (``sft``, ``openai_chat``, ``sharegpt``,
``passthrough``, ``select``, ``rename``); the chat ones all produce the same ``{"messages": [...]}`` record so that
everything after them (chat template, tokenization, packing) has one input shape. A transform is named in the
blend YAML, so a change of transform changes the blend's hash and shows in lineage. A record a transform cannot
read raises ``RecordError`` naming the field; ``apply_transform`` adds the file and line, or quarantines the row.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nexa_dagster.core.common.jsonl import BadRow, OnError, Record, RecordError

Transform = Callable[[Record], Record]

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
}


def _field(record: Record, name: str, kind: type | tuple[type, ...] = str) -> Any:
    if name not in record or record[name] is None:
        raise RecordError(f"missing (fields are {sorted(record)})", field=name)
    value = record[name]
    if not isinstance(value, kind):
        expected = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise RecordError(f"must be {expected}, got {type(value).__name__}", field=name)
    return value


def validate_messages(messages: Any, field: str = "messages") -> list[dict[str, str]]:
    """Messages as the chat template wants them: roles system/user/assistant, string contents, an answer to learn."""
    if not isinstance(messages, list) or not messages:
        raise RecordError("must be a non-empty list of messages", field=field)
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise RecordError(f"message {i} is {type(m).__name__}, not an object", field=field)
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise RecordError(
                f"message {i} has role {role!r}; expected one of {list(ROLES)}", field=f"{field}[{i}].role"
            )
        if not isinstance(content, str):
            raise RecordError(
                f"message {i} content must be a string, got {type(content).__name__}",
                field=f"{field}[{i}].content",
            )
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" and m["content"].strip() for m in out):
        raise RecordError("no assistant message with content: nothing to learn", field=field)
    return out


def sft(input_field: str = "input", output_field: str = "output", system_field: str = "system") -> Transform:
    """``{input, output[, system]}`` -> ``{"messages": [system?, user, assistant]}``."""

    def apply(record: Record) -> Record:
        system = record.get(system_field)
        if system is not None and not isinstance(system, str):
            raise RecordError(f"must be str, got {type(system).__name__}", field=system_field)
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": _field(record, input_field)})
        messages.append({"role": "assistant", "content": _field(record, output_field)})
        return {"messages": validate_messages(messages, output_field)}

    return apply


def openai_chat(messages_field: str = "messages") -> Transform:
    """``{"messages": [{"role", "content"}, ...]}``, checked and stripped to role/content."""

    def apply(record: Record) -> Record:
        return {"messages": validate_messages(_field(record, messages_field, list), messages_field)}

    return apply


def sharegpt(
    conversations_field: str = "conversations", role_field: str = "from", content_field: str = "value"
) -> Transform:
    """``{"conversations": [{"from": "human"|"gpt"|"system", "value"}, ...]}`` -> ``{"messages": [...]}``."""

    def apply(record: Record) -> Record:
        turns = _field(record, conversations_field, list)
        messages = []
        for i, turn in enumerate(turns):
            if not isinstance(turn, Mapping):
                raise RecordError(
                    f"turn {i} is {type(turn).__name__}, not an object", field=conversations_field
                )
            speaker = turn.get(role_field)
            if speaker not in SHAREGPT_ROLES:
                raise RecordError(
                    f"turn {i} speaker {speaker!r}; expected one of {sorted(SHAREGPT_ROLES)}",
                    field=f"{conversations_field}[{i}].{role_field}",
                )
            messages.append({"role": SHAREGPT_ROLES[speaker], "content": turn.get(content_field)})
        return {"messages": validate_messages(messages, conversations_field)}

    return apply


def passthrough() -> Transform:
    """The record unchanged (RL prompts, precomputed fields)."""
    return dict


def select(*fields: str) -> Transform:
    """Only ``fields``, in that order; a missing one is an error (a silently absent field is a silent bug)."""
    if not fields:
        raise ValueError("select needs at least one field")

    def apply(record: Record) -> Record:
        missing = [f for f in fields if f not in record]
        if missing:
            raise RecordError(f"missing (fields are {sorted(record)})", field=missing[0])
        return {f: record[f] for f in fields}

    return apply


def rename(mapping: Mapping[str, str] | None = None, **kwargs: str) -> Transform:
    """Rename fields (``{old: new}``); others are kept. A missing source field is an error."""
    names = dict(mapping or {}, **kwargs)

    def apply(record: Record) -> Record:
        missing = [old for old in names if old not in record]
        if missing:
            raise RecordError(f"missing (fields are {sorted(record)})", field=missing[0])
        return {names.get(k, k): v for k, v in record.items()}

    return apply


def shuffle_answer_words(seed: int = 0) -> Transform:
    """A negative control: every assistant answer's words in a seeded random order (the prompt kept as it is).

    A model fine-tuned on such answers learns the answers' vocabulary but not their order, so on real answers it
    must score worse than the model it started from: the blend ``configs/blends/sft_negative_control.yaml`` trains
    that candidate, and the promotion gate is expected to hold it back on evidence (tests/e2e/test_demo.py). The
    order depends only on ``seed`` and the answer's text, so a record shuffles the same way on every run."""

    def apply(record: Record) -> Record:
        messages = validate_messages(_field(record, "messages", list))
        out = []
        for m in messages:
            if m["role"] == "assistant":
                words = m["content"].split()
                digest = hashlib.sha256(f"{seed}:{m['content']}".encode()).digest()
                random.Random(digest).shuffle(words)
                m = {"role": "assistant", "content": " ".join(words)}
            out.append(m)
        return {**record, "messages": out}

    return apply


TRANSFORMS: dict[str, Callable[..., Transform]] = {
    "sft": sft,
    "openai_chat": openai_chat,
    "sharegpt": sharegpt,
    "passthrough": passthrough,
    "select": select,
    "rename": rename,
    "shuffle_answer_words": shuffle_answer_words,
}
TransformSpec = str | Mapping[str, Any] | Sequence[Any]


def build_transform(spec: TransformSpec | None) -> Transform:
    """A transform from its YAML form: ``"sft"``, ``{"select": ["a", "b"]}``, ``{"rename": {"q": "prompt"}}``,
    ``{"sft": {"input_field": "question"}}`` or a list of these applied in order."""
    if spec is None:
        return passthrough()
    if isinstance(spec, str):
        if spec not in TRANSFORMS:
            raise ValueError(f"unknown transform {spec!r}; built-in ones are {sorted(TRANSFORMS)}")
        return TRANSFORMS[spec]()
    if isinstance(spec, Mapping):
        if len(spec) != 1:
            raise ValueError(f"a transform is one name with its arguments, got {dict(spec)!r}")
        ((name, args),) = spec.items()
        if name not in TRANSFORMS:
            raise ValueError(f"unknown transform {name!r}; built-in ones are {sorted(TRANSFORMS)}")
        if isinstance(args, Mapping):
            return TRANSFORMS[name](**args) if name != "rename" else rename(args)
        if isinstance(args, list | tuple):
            return TRANSFORMS[name](*args)
        return TRANSFORMS[name](args) if args is not None else TRANSFORMS[name]()
    steps = [build_transform(s) for s in spec]

    def chained(record: Record) -> Record:
        for step in steps:
            record = step(record)
        return record

    return chained


def apply_transform(transform: Transform, record: Record, where: str, on_error: OnError) -> Record | BadRow:
    """The transformed record, or the bad row (``on_error="quarantine"``) with the file, line and field."""
    try:
        return transform(record)
    except RecordError as e:
        if on_error == "raise":
            raise e.at(where) from None
        return BadRow(where, e.field, e.reason, json.dumps(record, ensure_ascii=False, default=str))
