"""The frozen held-out RL prompt set: the checkable items the RL gate compares candidate and production on.

Like the eval set (``core.evaluation.eval_set``), a version ``v<N>`` is written once under
``<root>/rl_eval_sets/v<N>/`` and never rewritten::

    prompts.jsonl   the held-out items (``core.rl.tasks``: prompt, task, answer, reference, choices, ids), sorted
    manifest.json   format, version, count per task, the task settings, SHA-256 of the file and ``content_sha256``

``load_rl_eval_set`` checks the hashes with the eval set's own checks (a changed or missing file is an error naming
it and what to do), so every RL candidate of a version is scored on exactly the same prompts. The items come from
documents on the held-out side only (``core.rl.tasks.held_out``), which no training reads, and once frozen they are
protected items (``core.evaluation.protected.rl_eval_set_items``): no training row of the lineage may hold their
passages, so no prompt of this set is ever trained on. Dagster-free.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nexa_dagster.core.common import storage
from nexa_dagster.core.common.jsonl import dumps
from nexa_dagster.core.evaluation.eval_set import content_sha256, frozen_marker, load_eval_set, version_exists

FORMAT = "nexa-rl-eval-set/1"
PROMPTS = "prompts.jsonl"


def freeze_rl_eval_set(
    items: Sequence[dict[str, Any]],
    root: str,
    version: int,
    settings: dict[str, Any],
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Write version ``version`` from the held-out ``items`` (sorted by item id), or return the one already frozen
    (checked). Written into a temporary folder and renamed into place whole: a killed freeze leaves nothing."""
    if version_exists(root, version):
        manifest = load_rl_eval_set(root, version)
        log(
            f"RL eval set v{version} is frozen: {manifest['prompts']} prompts ({manifest['content_sha256'][:16]})"
        )
        return manifest
    if not items:
        raise ValueError(
            f"RL eval set v{version}: no held-out item (no ingested document on the held-out side); ingest more "
            "documents or raise rl.tasks.held_out_fraction"
        )
    ordered = sorted(items, key=lambda i: str(i["item_id"]))
    out = Path(storage.join(root, f"v{version}"))
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(directory: Path) -> None:
        with storage.atomic_writer(str(directory / PROMPTS)) as f:
            f.write(b"".join(dumps(i) for i in ordered))
        files = {PROMPTS: storage.sha256_file(str(directory / PROMPTS))}
        tasks: dict[str, int] = {}
        for item in ordered:
            tasks[item["task"]] = tasks.get(item["task"], 0) + 1
        manifest = {
            "format": FORMAT,
            "version": version,
            "prompts": len(ordered),
            "tasks": tasks,
            "settings": settings,
            "files": files,
            "content_sha256": content_sha256(files),
            "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        }
        storage.write_json(manifest, str(directory / "manifest.json"))  # last: its presence means complete

    with storage.directory_lock(out):
        if not version_exists(root, version):
            storage.publish_directory(out, write)
    manifest = load_rl_eval_set(root, version)
    storage.write_text(manifest["content_sha256"] + "\n", frozen_marker(root, version))
    log(f"froze RL eval set v{version}: {manifest['prompts']} prompts {manifest['tasks']} in {out}")
    return manifest


def load_rl_eval_set(root: str, version: int) -> dict[str, Any]:
    """The manifest of frozen version ``version`` with ``prompts_path``, every file's hash checked
    (``FileNotFoundError``: never frozen; ``EvalSetDamaged``: a file missing or changed)."""
    manifest = load_eval_set(root, version)
    if manifest.get("format") != FORMAT:
        raise ValueError(
            f"{storage.join(root, f'v{version}')} holds {manifest.get('format')}, not an RL eval set"
        )
    return {**manifest, "prompts_path": storage.join(root, f"v{version}", PROMPTS)}


def newest_prompts_path(root: str) -> str | None:
    """The prompts file of the newest frozen version (v1, v2, ... up to the first never frozen), hashes checked;
    None when none was frozen. What a canary's live answers are checked against (``core.serving.live_quality``)."""
    version = 0
    while version_exists(root, version + 1):
        version += 1
    return load_rl_eval_set(root, version)["prompts_path"] if version else None


def read_prompts(manifest: dict[str, Any], limit: int | None = None) -> list[dict[str, Any]]:
    """The frozen items, in their order; the first ``limit`` (the scale's ``rl.held_out_prompts``) when given."""
    with storage.open_read(manifest["prompts_path"]) as f:
        rows = [json.loads(line) for line in f]
    return rows[:limit] if limit else rows


def overlap_problems(held_out: Sequence[dict[str, Any]], train_path: str) -> list[str]:
    """What puts a held-out prompt in training: an item id, a document or a prompt text that the train rows at
    ``train_path`` also hold. Empty: none (the ``rl_eval_set`` asset check)."""
    with storage.open_read(train_path) as f:
        train = [json.loads(line) for line in f]
    problems = []
    for key in ("item_id", "doc_id", "prompt"):
        shared = sorted({str(r[key]) for r in held_out} & {str(r[key]) for r in train})
        problems += [f"{key} on both sides: {value[:80]}" for value in shared]
    return problems
