"""Sparse upcycling on a random tiny Llama: the MoE built from the dense checkpoint computes its logits at
initialisation (top-1 and top-2 routing), Drop-Upcycling's re-initialisation makes the experts differ, and a
model preset's ``upcycling`` block is what the training builds the MoE with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

from nexa_dagster.core.common.config import REPO_ROOT, ConfigError, load_model_preset
from nexa_dagster.core.training.init import check_init_checkpoint, load_mixtral_checkpoint
from nexa_dagster.core.training.upcycle import UpcyclingSpec, upcycle_dense_checkpoint

TOLERANCE = 1e-4  # float32 rounding of the same sums in another order (grouped GEMM vs dense matmul)


def tiny_llama(path: Path, tie: bool = False, **overrides: object) -> Path:
    """A random 2-layer Llama (grouped-query attention, its own RoPE base) saved as a Hugging Face directory."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=50000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        **overrides,
    )
    model = LlamaForCausalLM(config)
    for p in model.parameters():  # weights of a trained model's scale, norms not all ones
        torch.nn.init.normal_(p, mean=1.0 if p.ndim == 1 else 0.0, std=0.1)
    model.save_pretrained(path)
    return path


def logits_of_both(path: Path, spec: UpcyclingSpec) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))
    dense = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    moe = upcycle_dense_checkpoint(str(path), spec, attention="causal").eval()
    with torch.no_grad():
        return dense(ids).logits, moe(ids, return_logits=True).logits


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("tie", [False, True])
def test_upcycled_moe_computes_the_dense_models_logits(tmp_path: Path, top_k: int, tie: bool) -> None:
    path = tiny_llama(tmp_path / "llama", tie=tie)
    dense, moe = logits_of_both(path, UpcyclingSpec(num_local_experts=4, num_experts_per_tok=top_k))
    assert dense.abs().max() > 1.0  # logits of some size: a match of near-zero tensors would prove little
    assert (dense - moe).abs().max().item() < TOLERANCE


def test_every_expert_is_the_dense_mlp_and_the_router_is_new(tmp_path: Path) -> None:
    path = tiny_llama(tmp_path / "llama")
    dense = LlamaForCausalLM.from_pretrained(path).state_dict()
    moe = upcycle_dense_checkpoint(str(path), UpcyclingSpec(num_local_experts=3, num_experts_per_tok=2))
    experts = moe.model.layers[1].mlp.experts
    gate_up = torch.cat(
        [dense["model.layers.1.mlp.gate_proj.weight"], dense["model.layers.1.mlp.up_proj.weight"]]
    )
    for e in range(3):
        assert torch.equal(experts.gate_up_proj[e], gate_up)
        assert torch.equal(experts.down_proj[e], dense["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(
        moe.model.layers[0].self_attn.q_proj.weight, dense["model.layers.0.self_attn.q_proj.weight"]
    )
    router = moe.model.layers[0].mlp.gate.weight
    assert router.shape == (3, 64) and 0.01 < router.std().item() < 0.03  # normal(0, router_init_std=0.02)
    assert moe.config.model_type == "mixtral" and moe.config.num_local_experts == 3


def test_drop_upcycling_reinitialises_a_share_of_each_copys_units(tmp_path: Path) -> None:
    """r = 0.5: expert 0 stays the dense MLP, every other expert has half its intermediate units re-drawn (other
    units per expert), so the model's logits move away from the dense model's."""
    path = tiny_llama(tmp_path / "llama")
    spec = UpcyclingSpec(num_local_experts=4, num_experts_per_tok=2, expert_drop_ratio=0.5)
    moe = upcycle_dense_checkpoint(str(path), spec)
    gate_up = moe.model.layers[0].mlp.experts.gate_up_proj
    changed = [set(torch.nonzero((gate_up[e] != gate_up[0]).any(1)).flatten().tolist()) for e in range(4)]
    assert changed[0] == set()
    for units in changed[1:]:  # 48 of 96 units, in both the gate rows (< 96) and the up rows (>= 96)
        assert {u for u in units if u < 96} == {u - 96 for u in units if u >= 96} and len(units) == 96
    assert changed[1] != changed[2]
    dense, upcycled = logits_of_both(path, spec)
    assert (dense - upcycled).abs().max().item() > 100 * TOLERANCE


def test_init_from_a_dense_directory_is_upcycled_with_the_presets_experts(tmp_path: Path) -> None:
    """The training's entry point (``load_mixtral_checkpoint``, what the worker calls) upcycles a Llama directory
    with the model preset's experts, and refuses one it cannot compute or one without a preset."""
    path = tiny_llama(tmp_path / "llama")
    model = load_mixtral_checkpoint(str(path), "causal", "tiny")  # configs/models/tiny.yaml: 4 experts, top-2
    assert (model.config.num_local_experts, model.config.num_experts_per_tok) == (4, 2)
    with pytest.raises(ValueError, match="needs a model preset"):
        load_mixtral_checkpoint(str(path), "causal")
    biased = tiny_llama(tmp_path / "biased", attention_bias=True)
    with pytest.raises(ValueError, match="cannot upcycle this checkpoint: attention_bias"):
        load_mixtral_checkpoint(str(biased), "causal", "tiny")
    with pytest.raises(
        ValueError, match="vocab_size 320 is smaller"
    ):  # the check before launch accepts llama
        check_init_checkpoint(str(path), ThousandTokens(), "the data")


class ThousandTokens:
    """What the check reads of a tokenizer without files in the checkpoint: its length."""

    def __len__(self) -> int:
        return 1000


def preset_with_upcycling(configs: Path, name: str, upcycling: dict[str, object] | None) -> str:
    """``configs/models/<name>.yaml``: the tiny preset's experts (4, top-2) with this ``upcycling`` block."""
    data = yaml.safe_load((REPO_ROOT / "configs" / "models" / "tiny.yaml").read_text())
    (configs / "models").mkdir(parents=True, exist_ok=True)
    (configs / "models" / f"{name}.yaml").write_text(yaml.safe_dump({**data, "upcycling": upcycling}))
    return name


def test_a_presets_upcycling_block_reaches_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``upcycling`` block of a model preset is what the training's loader builds the MoE with: a nonzero
    ``expert_drop_ratio`` moves the logits away from the dense model's, zero keeps them equal, and
    ``router_init_std`` is the new router's spread. Loaded through ``load_mixtral_checkpoint`` (the worker's
    entry point), so the preset file, its validation and ``UpcyclingSpec.from_preset`` are all on the path."""
    path = tiny_llama(tmp_path / "llama")
    monkeypatch.setenv("NEXA_CONFIG_DIR", str(tmp_path / "configs"))
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        dense = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(ids).logits
    logits, routers = {}, {}
    for name, block in {
        "exact": {"router_init_std": 0.2, "expert_drop_ratio": 0.0},
        "dropped": {"expert_drop_ratio": 0.5},
    }.items():
        model = load_mixtral_checkpoint(
            str(path), "causal", preset_with_upcycling(tmp_path / "configs", name, block)
        )
        with torch.no_grad():
            logits[name] = model.eval()(ids, return_logits=True).logits
        routers[name] = model.model.layers[0].mlp.gate.weight.std().item()
    assert (dense - logits["exact"]).abs().max().item() < TOLERANCE
    assert (dense - logits["dropped"]).abs().max().item() > 100 * TOLERANCE
    assert 0.15 < routers["exact"] < 0.25 and 0.01 < routers["dropped"] < 0.03  # set, and the default 0.02


def test_the_upcycling_block_is_checked_and_the_shipped_preset_reaches_the_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``smollm2-upcycled``'s block as written becomes the spec (exact copies, 2 experts top-1); a misspelt or
    out-of-range key is refused with the file named, not trained with silently."""
    spec = UpcyclingSpec.from_preset(load_model_preset("smollm2-upcycled"))
    assert (spec.num_local_experts, spec.num_experts_per_tok) == (2, 1)
    assert (spec.router_init_std, spec.expert_drop_ratio, spec.router_aux_loss_coef) == (0.02, 0.0, 0.02)
    monkeypatch.setenv("NEXA_CONFIG_DIR", str(tmp_path / "configs"))
    for name, block in {"typo": {"expert_drop_rate": 0.5}, "range": {"expert_drop_ratio": 1.5}}.items():
        preset_with_upcycling(tmp_path / "configs", name, block)
        with pytest.raises(ConfigError, match=f"models/{name}.yaml"):
            load_model_preset(name)
