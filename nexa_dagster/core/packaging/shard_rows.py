"""The rows of one planned shard, transformed: the loop every packaging format starts with.

Each format's worker (packed SFT, Megatron bin/idx, JSONL) reads its byte range of a source file, applies the
source's transform, and sets bad rows aside (``on_error: quarantine``) or stops on them (``raise``) with the file,
line and field. Only what the format does with the good rows differs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from nexa_dagster.core.common import storage
from nexa_dagster.core.common.jsonl import BadRow, OnError, Record, RecordError, iter_jsonl
from nexa_dagster.core.common.jsonl import dumps as dump_line
from nexa_dagster.core.packaging import shards as sh
from nexa_dagster.core.packaging.blend import BlendSource
from nexa_dagster.core.packaging.transforms import apply_transform, build_transform

Validate = Callable[[Record], None]  # raises RecordError for a transformed record the format cannot use


def source_of(task: sh.ShardTask) -> BlendSource:
    return BlendSource.model_validate(task.config["sources"][task.shard.source])


def transformed_rows(
    task: sh.ShardTask, bad: list[bytes], validate: Validate | None = None
) -> Iterator[tuple[Record, Record]]:
    """``(input record, transformed record)`` for every good row of the shard, in file order.

    Bad rows (unreadable, failing the transform or ``validate``) are appended to ``bad`` as quarantine lines, or
    raise ``RecordError`` naming ``file:line`` when the blend says ``on_error: raise``.
    """
    shard = task.shard
    transform = build_transform(source_of(task).transform)
    on_error: OnError = task.config["on_error"]
    with storage.open_read(shard.path) as f:
        for where, item in iter_jsonl(f, shard.label, shard.start, shard.end, shard.first_line, on_error):
            out: Any = item if isinstance(item, BadRow) else apply_transform(transform, item, where, on_error)
            if validate is not None and not isinstance(out, BadRow):
                try:
                    validate(out)
                except RecordError as err:
                    if on_error == "raise":
                        raise err.at(where) from None
                    out = BadRow(where, err.field, err.reason, str(item)[:2000])
            if isinstance(out, BadRow):
                bad.append(dump_line({"source": shard.source, **out.to_json()}))
                continue
            yield item, out
