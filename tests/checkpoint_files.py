"""What a checkpoint directory must say for ``transformers`` 4.x to read it as 5.x does (``core.hf_checkpoint``)."""

from __future__ import annotations

import json
from pathlib import Path


def assert_portable_checkpoint(directory: str | Path) -> None:
    """The 4.x keys say what the 5.x keys say: RoPE base, tokenizer class, special tokens."""
    root = Path(directory)
    config = json.loads((root / "config.json").read_text())
    assert "rope_theta" in config, "config.json has no top-level rope_theta: transformers 4.x would use 1e6"
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]
    tokenizer = json.loads((root / "tokenizer_config.json").read_text())
    assert tokenizer["tokenizer_class"] == "PreTrainedTokenizerFast", tokenizer["tokenizer_class"]
    assert not isinstance(tokenizer.get("extra_special_tokens"), list), "4.x expects a dict there"
    assert "<|im_start|>" in tokenizer["additional_special_tokens"]
