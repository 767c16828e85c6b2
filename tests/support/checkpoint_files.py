"""Checkpoint folders in tests: what one must say for transformers 4.x to read it as 5.x does, a folder copied in
by hand from another data root, and a model worse by construction."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from nexa_dagster.core.common.artifacts import COMPLETION_MARKER


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


def copy_checkpoint_from_elsewhere(model: Path, dest: Path) -> Path:
    """``model`` copied to ``dest`` with the record another data root wrote (its own, if it has one): the paths in
    it, of the model and of its validation split, do not exist here."""
    shutil.copytree(model, dest)
    record = dest / "checkpoint.json"
    written = (
        json.loads(record.read_text())
        if record.exists()
        else {"checkpoint_id": dest.name, "num_steps": 4, "dataset_run_hash": "0123456789abcdef"}
    )
    record.write_text(
        json.dumps(
            {
                **written,
                "path": f"/elsewhere/data/checkpoints/{dest.name}",
                "dataset_validation_path": "/elsewhere/data/sft/x/validation.parquet",
            }
        )
    )
    (dest / COMPLETION_MARKER).write_text("ok\n")
    return dest


def corrupted_model(path: Path, scale: float = 20.0) -> Path:
    """A saved model's output layer scaled in place: far more confident random predictions, a much worse loss (about
    double on every example), so a gate's paired interval against it is decisive even on a tiny eval set."""
    import torch  # only the tests that build such a model pay for it
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.save_pretrained(str(path))
    return path
