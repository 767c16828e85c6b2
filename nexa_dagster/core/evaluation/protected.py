"""What training data must not contain: the frozen eval set's examples, the frozen held-out RL prompts and the
configured benchmark tasks' items.

They are listed for ``core.data.contamination.ContaminationIndex``: an eval example is protected by its prompt's own
text (the document it quotes, without the teacher template's words) and its answer; a held-out RL prompt by the
words of its document it shows, with its answer for ``next_words`` (``core.rl.tasks.document_text``: the RL gate
asks about passages no model in its lineage was trained on, so no pretraining document, SFT row or preference pair
may hold one); a benchmark item by the string fields of its data row (a task's YAML under the benchmarks'
``include_path`` names its data file; ``id`` fields are not text). A task given by a name the local YAMLs do not
define (one of the harness's own, downloaded on a GPU host) has no local items to protect and is listed as such.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nexa_dagster.core.common import storage
from nexa_dagster.core.common.config import BenchmarkSettings, parse_yaml, resolve_path
from nexa_dagster.core.data.contamination import ProtectedItem
from nexa_dagster.core.evaluation.rl_eval_set import read_prompts
from nexa_dagster.core.rl.tasks import document_text

# a frozen RL eval set's items are from "rl_eval_set v<N>", as the eval set's are from "eval_set v<N>"
RL_EVAL_SET_SOURCE = "rl_eval_set"


def eval_set_items(
    manifest: dict[str, Any], prompt_segments: Callable[[str], list[str]]
) -> list[ProtectedItem]:
    """The frozen eval set's examples (``samples.jsonl``), each by its prompt's own text and its answer."""
    items = []
    with storage.open_read(manifest["samples_path"]) as f:
        for line in f:
            record = json.loads(line)
            texts: list[str] = []
            for message in record["messages"]:
                if message["role"] == "user":
                    texts += prompt_segments(message["content"])
                elif message["role"] == "assistant":
                    texts.append(message["content"])
            items.append(ProtectedItem(f"eval_set v{manifest['version']}", record["sample_id"], tuple(texts)))
    return items


def rl_eval_set_items(manifest: dict[str, Any]) -> list[ProtectedItem]:
    """The frozen RL eval set's prompts (``core.evaluation.rl_eval_set``), each by the document words it shows."""
    source = f"{RL_EVAL_SET_SOURCE} v{manifest['version']}"
    return [ProtectedItem(source, str(i["item_id"]), (document_text(i),)) for i in read_prompts(manifest)]


def benchmark_items(settings: BenchmarkSettings) -> tuple[list[ProtectedItem], list[str]]:
    """(the items of the configured tasks found in local task YAMLs, the task names with no local data)."""
    wanted = set(settings.tasks)
    items: list[ProtectedItem] = []
    found: set[str] = set()
    for folder in (resolve_path(p) for p in settings.include_path):
        for task_yaml in sorted(Path(folder).rglob("*.yaml")):
            spec = parse_yaml(task_yaml.read_text(encoding="utf-8")) or {}
            tags = spec.get("tag", [])
            names = {spec.get("task"), *(tags if isinstance(tags, list) else [tags])}
            if not wanted & names or not isinstance(spec.get("task"), str):
                continue
            found |= wanted & names
            files = (spec.get("dataset_kwargs") or {}).get("data_files") or {}
            for data_file in files.values() if isinstance(files, dict) else [files]:
                path = task_yaml.parent / data_file
                with open(path, encoding="utf-8") as f:
                    for row, line in enumerate(f):
                        record = json.loads(line)
                        text = " ".join(v for k, v in record.items() if k != "id" and isinstance(v, str))
                        item_id = str(record.get("id", row))
                        items.append(ProtectedItem(f"benchmark:{spec['task']}", item_id, (text,)))
    return items, sorted(wanted - found)
