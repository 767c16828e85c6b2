"""Sparse upcycling: a dense Llama-family checkpoint as the starting point of the project's Mixture-of-Experts.

Most open checkpoints are dense; the product trains MoEs. Sparse upcycling (Komatsuzaki et al., "Sparse
Upcycling: Training Mixture-of-Experts from Dense Checkpoints", ICLR 2023, arXiv:2212.05055) builds the MoE from
the dense model: attention, norms, embeddings and head are the dense model's, every expert of a layer is a copy of
that layer's MLP, and only the router is new (randomly initialised). Megatron-Core does the same at load time
(``megatron/core/transformer/moe/upcycling_utils.py``: ``upcycle_state_dict``, ``load_and_upcycle_model``,
flag ``--moe-use-upcycling``); its authors (He et al., "Upcycling Large Language Models into Mixture of Experts",
2024, arXiv:2410.07524) found softmax-then-top-k routing better for upcycling than top-k-then-softmax.

The project's router is Mixtral's: softmax over all experts, keep the top k, renormalise the k weights to sum to
one (``model/moe.py::Router``). With identical experts the mix is then exactly the dense MLP whatever the router
chose, so at initialisation the upcycled model computes the dense model's logits (to float rounding; tested on
SmolLM2-135M and a random tiny Llama, top-1 and top-2). Training then lets the router and experts diverge.

Expert diversity, configurable in the model preset's ``upcycling`` block (``UpcyclingSpec``):

* ``router_init_std``: the router's normal initialisation (Komatsuzaki et al. initialise it randomly; a larger
  std makes the first routing less uniform, it never changes the initial logits);
* ``expert_drop_ratio`` (default 0: exact copies): Drop-Upcycling (Nakamura et al., ICLR 2025,
  arXiv:2502.19261) re-initialises, in each expert, a random share ``r`` of the intermediate units (rows of the
  gate and up projections, columns of the down projection) from a normal with the original matrix's mean and
  std, so experts start different; they report ``r = 0.5`` as the best trade-off. With ``r > 0`` the upcycled
  model no longer equals the dense one at initialisation (that is the point).

The result is an ordinary ``NexaMoEForCausalLM`` whose config is a ``MixtralConfig``: it trains, saves and serves
as every other checkpoint of the project.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nexa_dagster.core.training.model.moe import NexaMoEForCausalLM, moe_with_weights, rope_theta


@dataclass(frozen=True)
class UpcyclingSpec:
    """How a dense checkpoint becomes the MoE: the expert count and routing from the model preset, and the
    diversity knobs (see the module docstring for their sources)."""

    num_local_experts: int
    num_experts_per_tok: int
    router_aux_loss_coef: float = 0.001
    router_init_std: float = 0.02  # transformers' initializer_range for Mixtral's router
    expert_drop_ratio: float = 0.0  # Drop-Upcycling's r; 0: Komatsuzaki et al.'s exact copies
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(
                f"upcycling: num_experts_per_tok {self.num_experts_per_tok} must be between 1 and "
                f"num_local_experts {self.num_local_experts}"
            )
        if not 0.0 <= self.expert_drop_ratio <= 1.0:
            raise ValueError(f"upcycling: expert_drop_ratio {self.expert_drop_ratio} is not in [0, 1]")

    @classmethod
    def from_preset(cls, preset: dict[str, Any], seed: int = 0) -> UpcyclingSpec:
        """From a model preset's keys (``configs/models/<name>.yaml``): its experts, top-k, aux-loss weight and
        its optional ``upcycling`` block."""
        extra = preset.get("upcycling") or {}
        return cls(
            num_local_experts=int(preset["num_local_experts"]),
            num_experts_per_tok=int(preset["num_experts_per_tok"]),
            router_aux_loss_coef=float(preset.get("router_aux_loss_coef", 0.001)),
            seed=seed,
            **extra,
        )


def check_dense_config(dense: Any, path: str) -> None:
    """Refuse what the MoE's decoder does not compute (biases, scaled RoPE, another activation), naming it."""
    problems = []
    if getattr(dense, "attention_bias", False):
        problems.append("attention_bias")
    if getattr(dense, "mlp_bias", False):
        problems.append("mlp_bias")
    if getattr(dense, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {dense.hidden_act!r} (the experts are SwiGLU: silu)")
    rope = getattr(dense, "rope_parameters", None) or getattr(dense, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_type {rope.get('rope_type')!r} (the MoE computes plain RoPE)")
    if problems:
        raise ValueError(f"init_from {path}: cannot upcycle this checkpoint: {', '.join(problems)}")


def upcycled_config(dense: Any, spec: UpcyclingSpec) -> Any:
    """The Mixtral config of the MoE: the dense model's shape, the spec's experts and routing."""
    # transformers' Mixtral code (seconds): only when a model is upcycled
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=dense.vocab_size,
        hidden_size=dense.hidden_size,
        intermediate_size=dense.intermediate_size,
        num_hidden_layers=dense.num_hidden_layers,
        num_attention_heads=dense.num_attention_heads,
        num_key_value_heads=dense.num_key_value_heads,
        head_dim=getattr(dense, "head_dim", None) or dense.hidden_size // dense.num_attention_heads,
        max_position_embeddings=dense.max_position_embeddings,
        rms_norm_eps=dense.rms_norm_eps,
        rope_theta=rope_theta(dense),
        tie_word_embeddings=bool(dense.tie_word_embeddings),
        initializer_range=dense.initializer_range,
        bos_token_id=dense.bos_token_id,
        eos_token_id=dense.eos_token_id,
        pad_token_id=dense.pad_token_id,
        num_local_experts=spec.num_local_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        router_aux_loss_coef=spec.router_aux_loss_coef,
        output_router_logits=False,
        sliding_window=None,
    )


def upcycle_state_dict(
    dense: dict[str, torch.Tensor], num_layers: int, hidden: int, spec: UpcyclingSpec
) -> dict[str, torch.Tensor]:
    """The MoE's tensors from the dense model's: the same names for everything but the MLPs, whose weights become
    ``experts.gate_up_proj [E, 2F, H]`` (gate rows, then up rows) and ``experts.down_proj [E, H, F]``, plus a
    new router ``gate.weight [E, H]``."""
    generator = torch.Generator().manual_seed(spec.seed)
    experts = spec.num_local_experts
    out = {k: v for k, v in dense.items() if ".mlp." not in k}
    for i in range(num_layers):
        prefix = f"model.layers.{i}.mlp."
        gate, up, down = (dense[f"{prefix}{n}_proj.weight"] for n in ("gate", "up", "down"))
        copies = [
            perturbed(gate, up, down, spec.expert_drop_ratio, generator) if e else (gate, up, down)
            for e in range(experts)
        ]  # expert 0 stays the exact dense MLP
        out[f"{prefix}experts.gate_up_proj"] = torch.stack([torch.cat((g, u)) for g, u, _ in copies])
        out[f"{prefix}experts.down_proj"] = torch.stack([d for _, _, d in copies])
        router = torch.empty(experts, hidden, dtype=gate.dtype)
        out[f"{prefix}gate.weight"] = router.normal_(0.0, spec.router_init_std, generator=generator)
    return out


def perturbed(
    gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, ratio: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drop-Upcycling: a random share ``ratio`` of the intermediate units re-drawn from N(mean, std) of each
    original matrix (the same units in gate, up and down: a unit is dropped whole)."""
    if ratio == 0.0:
        return gate, up, down
    units = gate.shape[0]
    dropped = torch.randperm(units, generator=generator)[: round(ratio * units)]
    gate, up, down = gate.clone(), up.clone(), down.clone()
    for matrix, rows in ((gate, True), (up, True), (down, False)):
        shape = (len(dropped), matrix.shape[1]) if rows else (matrix.shape[0], len(dropped))
        fresh = torch.empty(shape, dtype=matrix.dtype).normal_(
            matrix.mean().item(), matrix.std().item(), generator=generator
        )
        if rows:
            matrix[dropped] = fresh
        else:
            matrix[:, dropped] = fresh
    return gate, up, down


def load_dense(path: str) -> Any:
    """The dense checkpoint in fp32 through transformers (every layout it reads)."""
    from transformers import AutoModelForCausalLM  # as MixtralConfig above: only when a model is upcycled

    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except (OSError, ValueError) as e:
        raise ValueError(f"init_from {path}: cannot load it as a dense Llama-family model: {e}") from e


def upcycle_dense_checkpoint(path: str, spec: UpcyclingSpec, attention: str = "auto") -> NexaMoEForCausalLM:
    """The MoE upcycled from the dense Hugging Face directory ``path`` (see the module docstring)."""
    dense = load_dense(path)
    check_dense_config(dense.config, path)
    config = upcycled_config(dense.config, spec)
    state = upcycle_state_dict(dense.state_dict(), config.num_hidden_layers, config.hidden_size, spec)
    return moe_with_weights(config, state, attention, f"init_from {path} (upcycled)")
