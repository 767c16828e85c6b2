"""Widening attention heads (``core/llm/widen_heads``): the widened checkpoint computes the same logits in
transformers (with grouped-query attention and rotary embeddings), vLLM's head-size check then takes it, and a
widening that breaks the rotary pairs or the scale is caught by the same comparison."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nexa_dagster.core.llm.vllm_models import why_vllm_cannot_run
from nexa_dagster.core.llm.widen_heads import positions, widen_checkpoint, widen_state


def _mixtral(path: Path) -> Path:
    """A random Mixtral of the tiny preset's attention shape: 4 query heads and 2 key/value heads of 16."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        rope_theta=10000.0,
        initializer_range=0.2,  # attention far from uniform, so the score's scale and rotation matter
    )
    torch.manual_seed(0)
    MixtralForCausalLM(config).save_pretrained(path)
    return path


def _logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("wide", [32, 64])
def test_widened_heads_compute_the_same_logits_and_vllm_takes_them(tmp_path: Path, wide: int) -> None:
    source = _mixtral(tmp_path / "h16")
    out = widen_checkpoint(source, tmp_path / f"h{wide}", wide)
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    before, after = _logits(source, ids), _logits(out, ids)
    assert json.loads((out / "config.json").read_text())["head_dim"] == wide
    assert before.abs().max() > 0.1  # logits that differ across tokens: the comparison means something
    assert (before - after).abs().max() < 1e-4, (before - after).abs().max()
    assert "head size is 16" in str(why_vllm_cannot_run(source, "cpu"))
    assert why_vllm_cannot_run(out, "cpu") is None


def test_a_widening_that_breaks_the_rotary_pairs_or_the_scale_is_caught(tmp_path: Path) -> None:
    """The comparison above fails for the two mistakes a widening invites: the head's dimensions kept contiguous
    (each rotary pair then rotates at another frequency) and the query left unscaled (the softmax sharpens)."""
    from safetensors.torch import load_file, save_file

    source = _mixtral(tmp_path / "h16")
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(1))
    reference = _logits(source, ids)
    state = load_file(source / "model.safetensors")
    good = widen_state(state, 4, 2, 16, 32)
    unscaled = {k: (v / 2**0.5 if k.endswith("q_proj.weight") else v) for k, v in good.items()}
    contiguous = {}
    for k, v in state.items():  # each head's 16 dimensions first, then 16 zeros
        if k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            heads = v.shape[0] // 16
            wide = torch.zeros(heads, 32, v.shape[1])
            wide[:, :16] = v.view(heads, 16, -1)
            v = wide.reshape(heads * 32, -1) * (2**0.5 if k.endswith("q_proj.weight") else 1.0)
        elif k.endswith("o_proj.weight"):
            wide = torch.zeros(v.shape[0], 4, 32)
            wide[:, :, :16] = v.view(v.shape[0], 4, 16)
            v = wide.reshape(v.shape[0], -1)
        contiguous[k] = v
    config = json.loads((source / "config.json").read_text())
    for name, broken in {"unscaled": unscaled, "contiguous": contiguous}.items():
        out = tmp_path / name
        out.mkdir()
        save_file(broken, out / "model.safetensors", metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps({**config, "head_dim": 32}))
        assert (_logits(out, ids) - reference).abs().max() > 1e-2, name


def test_positions_keep_each_rotary_pair_at_its_frequency() -> None:
    """Dimension i of a 16-wide head (pair i, i + 8, frequency theta^(-2i/16)) goes to 2i of a 32-wide head (pair
    2i, 2i + 16, frequency theta^(-4i/32): the same); sizes that cannot hold it are refused."""
    assert positions(16, 32).tolist() == [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30]
    assert positions(16, 64).tolist()[:2] == [0, 4] and positions(16, 64).tolist()[8] == 32
    for bad in (24, 16, 8):
        with pytest.raises(ValueError, match="cannot widen heads of 16"):
            positions(16, bad)
