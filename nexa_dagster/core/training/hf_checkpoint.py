"""Hugging Face checkpoint files that ``transformers`` 4.x and 5.x read the same way.

``save_pretrained`` in 5.x writes two things that a 4.x reader (and an engine pinned to the 4.x schema, such as a
vLLM build) reads differently, with no error:

* ``config.json`` has the RoPE base only inside ``rope_parameters``; 4.x reads the top-level ``rope_theta``, finds
  none and silently uses Mixtral's default (1e6) instead of the model's (measured on the tiny model: logits off by
  up to 0.029);
* ``tokenizer_config.json`` names ``TokenizersBackend`` (a 5.x class; 4.x refuses to load it) and lists the extra
  special tokens as ``extra_special_tokens`` (a list, which 4.x expects to be a dict of named tokens).

``write_portable_configs`` rewrites both files in a saved directory so that each version reads what the other
does: the top-level ``rope_theta`` (and, for a scaled RoPE, 4.x's ``rope_scaling``) equal to ``rope_parameters``,
``PreTrainedTokenizerFast`` (what 4.x calls a ``tokenizer.json`` tokenizer; 5.x maps it to the same backend) and
the special tokens under ``additional_special_tokens``, which both read. Measured: the tiny model's logits under
4.57.6 and 5.23 then agree to 1.3e-7 (fp32 rounding), with the same token ids from the chat template.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

PORTABLE_TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def _rewrite(path: Path, change: Any) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    changed = change(data)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(changed, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def portable_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` with the 4.x RoPE keys derived from ``rope_parameters`` (5.x keeps reading the latter)."""
    out = dict(config)
    rope = out.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        out["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
    return out


def portable_tokenizer_config(config: dict[str, Any]) -> dict[str, Any]:
    """``tokenizer_config.json`` naming a class both versions have, special tokens where both read them."""
    out = dict(config)
    if out.get("tokenizer_class") in (None, "TokenizersBackend"):
        out["tokenizer_class"] = PORTABLE_TOKENIZER_CLASS
    extra = out.get("extra_special_tokens")
    if isinstance(extra, list):
        out.pop("extra_special_tokens")
        known = list(out.get("additional_special_tokens") or [])
        out["additional_special_tokens"] = known + [t for t in extra if t not in known]
    return out


def write_portable_configs(directory: str | os.PathLike[str]) -> None:
    """Rewrite ``config.json`` and ``tokenizer_config.json`` in a ``save_pretrained`` directory (see module doc)."""
    root = Path(directory)
    if (root / "config.json").exists():
        _rewrite(root / "config.json", portable_model_config)
    if (root / "tokenizer_config.json").exists():
        _rewrite(root / "tokenizer_config.json", portable_tokenizer_config)
