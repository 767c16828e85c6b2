"""Where a training starts (``init_from``): a base model, the production model, random weights, or any Mixtral
checkpoint on disk.

``init_from`` is ``base`` (the latest ``base_model``), ``production`` (the production checkpoint: nightly
continual fine-tuning), ``scratch`` (random initialisation from the model preset) or a path of a Hugging Face
Mixtral-format directory. The Dagster layer resolves the names to a directory (``resolve``); this module then
checks the directory before anything launches (``check_init_checkpoint``: the architecture and the vocabulary
the data was tokenized with) and the worker loads it into the project's training MoE
(``load_mixtral_checkpoint``). The checkpoint's own config wins over the model preset: the weights decide the
shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nexa_dagster.core.common.config import load_model_preset
from nexa_dagster.core.packaging.packing import tokenizer_fingerprint

DENSE_MODEL_TYPES = ("llama",)  # decoders upcycle.py turns into the MoE (Llama's: RoPE, RMSNorm, SwiGLU)

INIT_NAMES = ("base", "production", "scratch")
MIXTRAL = "MixtralForCausalLM"


@dataclass(frozen=True)
class InitSource:
    """A resolved ``init_from``: the directory to load ('' for scratch) and the parent recorded in lineage."""

    path: str
    parent: str  # "scratch", "base:<id>", "production:<id>" or "path:<dir>"
    note: str = ""  # why the request was changed (e.g. "base" with no base model yet)


def resolve(
    init_from: str,
    base: tuple[str, str] | None,
    production: tuple[str, str] | None,
    preset_default: bool = False,
) -> InitSource:
    """Turn ``init_from`` into a directory. ``base`` and ``production`` are ``(id, path)`` or None when none
    exists. Only for the ``preset_default`` (the preset named it, no person asked for it) does a
    missing production model fall back to the base model and a missing base model to scratch: the very first night
    has neither; asked for explicitly, a missing one is an error."""
    value = init_from.strip()
    if value == "scratch":
        return InitSource("", "scratch")
    if value == "production" and production is None and preset_default:
        # the preset's continual fine-tuning on a data root with no production model yet (the first night)
        fallen = resolve("base", base, None, preset_default=True)
        note = (
            "init_from 'production' (the preset's default) but no model is in production yet: starting from "
            + ("the latest base model" if fallen.path else "random weights")
        )
        return InitSource(fallen.path, fallen.parent, f"{note}; {fallen.note}" if fallen.note else note)
    if value == "base":
        if base is None:
            if preset_default:
                return InitSource(
                    "",
                    "scratch",
                    "init_from 'base' (the preset's default) but no base_model has "
                    "been materialized yet: training from scratch; the checkpoint will be evaluated but not "
                    "deployed (pretrain a base model with pretraining_job first)",
                )
            raise ValueError(
                "init_from 'base' but no base_model has been materialized yet (run pretraining_job, "
                "or set init_from: scratch)"
            )
        return InitSource(base[1], f"base:{base[0]}")
    if value == "production":
        if production is None:
            raise ValueError("init_from 'production' but no model is in production yet")
        return InitSource(production[1], f"production:{production[0]}")
    if not value:
        raise ValueError(f"init_from is empty; use one of {INIT_NAMES} or a checkpoint path")
    return InitSource(value, f"path:{value}")


def read_config(path: str) -> dict[str, Any]:
    config = Path(path) / "config.json"
    if not config.is_file():
        raise ValueError(f"init_from {path}: no config.json there (not a Hugging Face model directory)")
    try:
        return json.loads(config.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"init_from {path}: config.json is not valid JSON: {e}") from e


def check_init_checkpoint(path: str, data_tokenizer: Any, data_label: str) -> str:
    """Fail before launch on a checkpoint the training cannot start from; return the tokenizer directory to
    train with (the checkpoint's own when it has one: the tokenizer comes with the model).

    Checked: a Mixtral architecture (the project's MoE is Mixtral), weights present, and a vocabulary that is the
    one the data (``data_label``) was tokenized with: the same tokenizer when the checkpoint ships one, else an
    embedding table large enough for every token id of the data's tokenizer.
    """
    config = read_config(path)
    architectures = config.get("architectures") or []
    dense = config.get("model_type") in DENSE_MODEL_TYPES  # upcycled into the MoE (core/training/upcycle.py)
    if not dense and (
        config.get("model_type") != "mixtral" or (architectures and MIXTRAL not in architectures)
    ):
        found = ", ".join(architectures) or config.get("model_type") or "unknown"
        raise ValueError(
            f"init_from {path}: a {found} checkpoint; training starts only from a Mixtral-architecture "
            f"checkpoint ({MIXTRAL}, model_type 'mixtral') or a dense one it upcycles (model_type "
            f"{', '.join(DENSE_MODEL_TYPES)})"
        )
    if not any(Path(path).glob("*.safetensors")) and not any(Path(path).glob("*.bin")):
        raise ValueError(f"init_from {path}: no weights (*.safetensors or *.bin) in the directory")
    vocab = int(config.get("vocab_size", 0))
    if (Path(path) / "tokenizer.json").is_file() or (Path(path) / "tokenizer_config.json").is_file():
        # seconds to import, only for a checkpoint with a tokenizer: not at the code location's load
        from transformers import AutoTokenizer

        own = AutoTokenizer.from_pretrained(path)
        if tokenizer_fingerprint(own) != tokenizer_fingerprint(data_tokenizer):
            raise ValueError(
                f"init_from {path}: its tokenizer ({len(own)} tokens) is not the one {data_label} was "
                f"tokenized with ({len(data_tokenizer)} tokens); re-package the data with this "
                "model's tokenizer or start from another checkpoint"
            )
        tokenizer_dir = path
    else:
        tokenizer_dir = ""
    if vocab < len(data_tokenizer):
        raise ValueError(
            f"init_from {path}: vocab_size {vocab} is smaller than the {len(data_tokenizer)} tokens "
            f"of the tokenizer {data_label} was tokenized with"
        )
    return tokenizer_dir


def load_mixtral_checkpoint(path: str, attention: str = "auto", model_preset: str | None = None) -> Any:
    """A Hugging Face Mixtral directory as the project's training MoE, with exactly its weights; a dense
    Llama-family directory is upcycled into one instead, with ``model_preset``'s experts (``upcycle.py``).

    Loaded through ``MixtralForCausalLM.from_pretrained`` (so every layout transformers reads, including the
    older per-expert one, works) in fp32, the training dtype before DeepSpeed casts; then every tensor is copied
    into ``NexaMoEForCausalLM``, whose parameter names are transformers'. A tensor that does not map is an error.
    """
    # torch and transformers (3+ s to import) only when a model is loaded: the code location imports this module
    import torch
    from transformers import MixtralForCausalLM

    from nexa_dagster.core.training.model.moe import moe_with_weights

    if read_config(path).get("model_type") in DENSE_MODEL_TYPES:
        return _upcycled(path, attention, model_preset)
    try:
        hf = MixtralForCausalLM.from_pretrained(path, dtype=torch.float32)
    except (OSError, ValueError) as e:
        raise ValueError(f"init_from {path}: cannot load it as {MIXTRAL}: {e}") from e
    hf.config.output_router_logits = False
    return moe_with_weights(hf.config, hf.state_dict(), attention, f"init_from {path}")


def _upcycled(path: str, attention: str, model_preset: str | None) -> Any:
    """The MoE sparse-upcycled from the dense checkpoint at ``path``, with the preset's experts and routing."""
    # torch (seconds to import) comes with the upcycling module: only for a dense checkpoint
    from nexa_dagster.core.training.upcycle import UpcyclingSpec, upcycle_dense_checkpoint

    if not model_preset:
        raise ValueError(
            f"init_from {path}: a dense checkpoint is upcycled into the MoE, and that needs a model preset "
            "naming the experts (num_local_experts, num_experts_per_tok)"
        )
    return upcycle_dense_checkpoint(
        path, UpcyclingSpec.from_preset(load_model_preset(model_preset)), attention
    )
