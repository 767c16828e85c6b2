"""What a local model *is*, independent of where it lies: a content hash of its config, weights and tokenizer.

Sample ids and generation-store keys hash the teacher's identity (``core.distillation.sample_key``). With the
model's directory path in that hash, two checkouts of the same data gave different ids (hence different
train/validation splits, datasets and losses), and moving the data root made every stored teacher answer
unreachable. A served model is identified by its served name; a local directory by this fingerprint.

Hashing multi-gigabyte weights takes minutes, so the digest is cached on disk (``$NEXA_CACHE_DIR``, default
``~/.cache/nexa-dagster``), keyed by the directory and the name, size and mtime of every hashed file: a
directory that has not changed costs one ``stat`` per file; any change (a new weight shard, a rewritten config)
is hashed again. A copy or move hashes once at its new place and gives the same fingerprint.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import threading
from pathlib import Path

from nexa_dagster import settings

# Files that decide what the model answers. Markers (``_COMPLETE``), lineage notes (``checkpoint.json``, which
# names absolute paths), optimizer state and logs are left out: copying them elsewhere changes nothing.
IDENTITY_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model*.bin.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "chat_template.*",
    "preprocessor_config.json",
)
PREFIX = "sha256:"
_CHUNK = 8 << 20
_MEMO: dict[str, tuple[list[tuple[str, int, int]], str]] = {}
_MEMO_LOCK = threading.Lock()


def cache_dir() -> Path:
    return settings.cache_root() / "model-fingerprints"


def identity_files(model_dir: Path) -> list[Path]:
    """The top-level files of ``model_dir`` that the fingerprint covers, sorted by name."""
    return sorted(
        p
        for p in model_dir.iterdir()
        if p.is_file() and any(fnmatch.fnmatch(p.name, pat) for pat in IDENTITY_PATTERNS)
    )


def _stat_key(files: list[Path]) -> list[tuple[str, int, int]]:
    return [(p.name, (st := p.stat()).st_size, st.st_mtime_ns) for p in files]


def _digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for p in files:  # name and length framed, so moving bytes between files changes the digest
        h.update(f"{p.name}\0{p.stat().st_size}\0".encode())
        with open(p, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()[:32]


def model_fingerprint(model_dir: str | os.PathLike[str]) -> str:
    """``sha256:<32 hex>`` of the identity files of a local model directory (cached by path, size and mtime)."""
    root = Path(model_dir).resolve()
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"model directory {root} has no config.json: cannot identify the model")
    files = identity_files(root)
    stat = _stat_key(files)
    with _MEMO_LOCK:
        memo = _MEMO.get(str(root))
    if memo and memo[0] == stat:
        return memo[1]
    cache_file = cache_dir() / f"{hashlib.sha256(str(root).encode()).hexdigest()[:24]}.json"
    digest = None
    try:
        cached = json.loads(cache_file.read_text())
        if cached.get("path") == str(root) and [tuple(s) for s in cached.get("files", [])] == stat:
            digest = str(cached["fingerprint"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no cache or an unreadable one: hash again
    if digest is None:
        digest = PREFIX + _digest(files)
        if _stat_key(files) == stat:  # not rewritten while we read it; else do not cache a torn state
            try:
                cache_file.parent.mkdir(parents=True, exist_ok=True)
                tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps({"path": str(root), "files": stat, "fingerprint": digest}))
                os.replace(tmp, cache_file)
            except OSError:
                pass  # a read-only home: the in-process memo still saves the repeat within this process
    with _MEMO_LOCK:
        _MEMO[str(root)] = (stat, digest)
    return digest
