"""A ``transformers`` Mixtral config from a model preset (``configs/models/<name>.yaml``): what training builds,
exports and checks, and what the tiny bootstrap models are made of."""

from __future__ import annotations

from typing import Any

from transformers import MixtralConfig

from nexa_dagster.core.common.config import load_model_preset


def build_model_config(
    preset: str | dict[str, Any],
    vocab_size: int,
    tokenizer: Any | None = None,
    output_router_logits: bool = False,
) -> Any:
    """A ``transformers`` config for a model preset from ``configs/models/``.

    ``output_router_logits`` adds the router's load-balancing loss to the LM loss: training wants it, inference
    must not have it (transformers' Mixtral computes it on every forward, and it breaks left-padded batches).
    """
    spec = dict(load_model_preset(preset) if isinstance(preset, str) else preset)
    arch = spec.pop("architecture", "MixtralForCausalLM")
    spec.pop(
        "upcycling", None
    )  # how a dense checkpoint is upcycled (core/training/upcycle.py): not the shape
    if arch != "MixtralForCausalLM":
        raise ValueError(f"model preset {preset!r}: unsupported architecture {arch!r}")
    unknown = sorted(set(spec) - set(MixtralConfig().to_dict()) - {"rope_theta"})
    if unknown:  # transformers keeps unknown keys silently: a typo would train a different model than asked
        raise ValueError(
            f"model preset {preset if isinstance(preset, str) else '(inline)'!r} has unknown fields "
            f"{unknown}; see MixtralConfig for the valid ones"
        )
    spec["vocab_size"] = vocab_size  # the tokenizer decides
    extra: dict[str, Any] = {}
    if tokenizer is not None:
        extra = {
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        }
    return MixtralConfig(**spec, **extra, output_router_logits=output_router_logits)
