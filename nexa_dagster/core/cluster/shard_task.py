"""One packaging shard as a cluster task: the task file, and ``python -m nexa_dagster.core.cluster.shard_task``.

The Dagster step plans the shards and checks their receipts; the shards that lack a valid one go to a task file
(``tasks.json``: the work function by import path, the run's runtime values, each task's shard, key, configuration
and output root). A cluster then starts one process per task, e.g. a Slurm array element or a Kubernetes indexed
Job's pod::

    python -m nexa_dagster.core.cluster.shard_task --plan tasks.json [--index N]

with ``N`` from ``--index``, else ``SLURM_ARRAY_TASK_ID``, else ``JOB_COMPLETION_INDEX`` (a position in the task
file, not the shard's number: only the shards still to do are in it). The process does exactly what the local
process pool does, ``shards.run_task`` (outputs, then the receipt), so the outputs are the same bytes whichever ran
them; a task whose receipt is already valid (an element the cluster requeued after it finished) does nothing.

The file is JSON, not a pickle: it can be read, and loading it runs no code but the named work function's import.
Runtime values must be plain values or dataclasses of them (the packer's ``ChatTokenizer``); tuples stay tuples.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nexa_dagster import settings
from nexa_dagster.core.common import storage
from nexa_dagster.core.packaging import shards as sh

TASKS_FORMAT = "nexa-shard-tasks/1"
INDEX_ENV = (
    settings.SLURM_ARRAY_TASK_ID,
    settings.JOB_COMPLETION_INDEX,
)  # Slurm job array, Kubernetes indexed Job

Work = Callable[[sh.ShardTask], sh.Receipt]


OUTPUT_TAIL_CHARS = 4000
TASK_ENV = {
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
}  # log lines at once; one shard, one thread


class ShardTasksFailed(RuntimeError):
    """Some shards did not finish on the cluster; the message names each one and where its output is."""

    def __init__(self, message: str, shard_ids: Sequence[str]) -> None:
        super().__init__(message)
        self.shard_ids = list(shard_ids)


def collect_receipts(
    tasks: Sequence[sh.ShardTask], where: Callable[[int], str], engine: str
) -> list[sh.Receipt]:
    """Every task's valid receipt in task order, or ``ShardTasksFailed`` naming each task without one.

    ``where(i)`` says what ran task ``i`` and where its output is (an element's state and log file).
    """
    receipts: list[sh.Receipt] = []
    failed: list[tuple[str, str]] = []
    for i, task in enumerate(tasks):
        receipt, why = sh.check_receipt(task.root, task.out_id, task.key)
        if receipt is None:
            failed.append((task.shard.shard_id, f"{describe(task)}: {why}; {where(i)}"))
        else:
            receipts.append(receipt)
    if failed:
        raise ShardTasksFailed(
            f"{len(failed)} of {len(tasks)} shards did not finish on {engine}:\n"
            + "\n".join(m for _, m in failed),
            [s for s, _ in failed],
        )
    return receipts


def output_tail(path: Path, chars: int = OUTPUT_TAIL_CHARS) -> str:
    """The end of a task's (or job's) output file, where its error is."""
    if not path.exists():
        return f"(no output file {path})"
    return path.read_text(encoding="utf-8", errors="replace").rstrip()[-chars:] or "(empty)"


def work_path(work: Work) -> str:
    """``module:qualname`` of a module-level work function (what a cluster task imports)."""
    module, name = getattr(work, "__module__", ""), getattr(work, "__qualname__", "")
    if not module or module == "__main__" or "<" in name:
        raise ValueError(
            f"shard work function {name or work!r} must be a module-level function of an importable "
            f"module to run on a cluster (got module {module!r})"
        )
    return f"{module}:{name}"


def import_work(path: str) -> Work:
    module, _, name = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def encode(value: Any, where: str = "runtime") -> Any:
    """A JSON value for ``value``; tuples and dataclasses are tagged so that ``decode`` gives them back."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: encode(v, f"{where}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        return {
            "__dataclass__": f"{cls.__module__}:{cls.__qualname__}",
            "fields": {
                f.name: encode(getattr(value, f.name), f"{where}.{f.name}") for f in dataclasses.fields(value)
            },
        }
    raise TypeError(
        f"{where}: a {type(value).__name__} cannot be sent to a cluster shard task (only plain values, "
        "tuples, lists, dicts with string keys and dataclasses of them)"
    )


def decode(value: Any) -> Any:
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(decode(v) for v in value["__tuple__"])
        if set(value) == {"__dataclass__", "fields"}:
            return import_work(value["__dataclass__"])(**{k: decode(v) for k, v in value["fields"].items()})
        return {k: decode(v) for k, v in value.items()}
    return value


def plan_id(tasks: Sequence[sh.ShardTask]) -> str:
    """Names a submission by what it does (its shard keys), so a retried step reuses the same folder."""
    return hashlib.sha256("\n".join(t.key for t in tasks).encode()).hexdigest()[:16]


def write_task_file(tasks: Sequence[sh.ShardTask], work: Work, path: str) -> str:
    """The task file for ``tasks`` (atomic); the run's configuration is stored once per distinct value."""
    if not tasks:
        raise ValueError("no shard task to write")
    configs: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    rows = []
    for task in tasks:
        text = json.dumps(task.config, sort_keys=True, default=str)
        if text not in seen:
            seen[text] = len(configs)
            configs.append(json.loads(text))
        rows.append(
            {
                "shard": dataclasses.asdict(task.shard),
                "root": task.root,
                "key": task.key,
                "config": seen[text],
                "output_id": task.output_id,
            }
        )
    runtimes = {json.dumps(encode(t.runtime), sort_keys=True) for t in tasks}
    if len(runtimes) != 1:
        raise ValueError("shard tasks of one submission must share their runtime values")
    storage.write_json(
        {
            "format": TASKS_FORMAT,
            "work": work_path(work),
            "runtime": json.loads(runtimes.pop()),
            "configs": configs,
            "tasks": rows,
        },
        path,
    )
    return path


def read_task_file(path: str) -> tuple[Work, list[sh.ShardTask]]:
    data = storage.read_json(path)
    if data.get("format") != TASKS_FORMAT:
        raise ValueError(
            f"{path}: not a shard task file (format {data.get('format')!r}, expected {TASKS_FORMAT!r})"
        )
    runtime = decode(data["runtime"])
    tasks = [
        sh.ShardTask(
            sh.Shard(**row["shard"]),
            row["root"],
            row["key"],
            data["configs"][row["config"]],
            dict(runtime),
            row["output_id"],
        )
        for row in data["tasks"]
    ]
    return import_work(data["work"]), tasks


def index_from_env() -> int:
    for variable in INDEX_ENV:
        if variable.get().strip():
            return int(variable.get())
    raise ValueError(
        f"no task index: pass --index, or run as a Slurm array element or a Kubernetes indexed Job "
        f"pod (one of {', '.join(v.name for v in INDEX_ENV)} set)"
    )


def describe(task: sh.ShardTask) -> str:
    """How a shard is named in logs and errors: its number and where its rows come from."""
    s = task.shard
    return f"shard {s.shard_id} ({s.label} lines {s.first_line}-{s.first_line + s.rows - 1})"


def run_index(plan: str, index: int, log: Callable[[str], None] = print) -> sh.Receipt:
    """Run task ``index`` of the task file ``plan`` as the local runner would, unless its receipt is valid."""
    work, tasks = read_task_file(plan)
    if not 0 <= index < len(tasks):
        raise IndexError(f"{plan}: task index {index} out of range (the file has {len(tasks)} tasks)")
    task = tasks[index]
    receipt, _ = sh.check_receipt(task.root, task.out_id, task.key)
    if receipt is not None:
        log(f"{describe(task)}: already done (valid receipt), nothing to do")
        return receipt
    started = time.monotonic()
    receipt = sh.run_task(work, task)
    log(
        f"{describe(task)}: done in {time.monotonic() - started:.1f} s, {receipt.rows} rows, receipt "
        f"{sh.receipt_path(task.root, task.out_id)}"
    )
    return receipt


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nexa_dagster.core.cluster.shard_task", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--plan", required=True, help="the task file (tasks.json) the Dagster step wrote")
    parser.add_argument(
        "--index",
        type=int,
        default=None,
        help=f"the task to run (default: ${' or $'.join(v.name for v in INDEX_ENV)})",
    )
    args = parser.parse_args(argv)
    index = args.index if args.index is not None else index_from_env()
    run_index(args.plan, index, lambda m: print(m, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
