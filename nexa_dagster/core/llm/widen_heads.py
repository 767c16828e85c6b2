"""A Mixtral/Llama checkpoint rewritten with wider attention heads that compute the same function: how a model
whose head size vLLM's CPU attention lacks (the tiny preset's 16) runs on vLLM.

Each head of size ``d`` becomes a head of size ``D`` (a multiple of ``d``, ``D = m d``) whose extra dimensions are
zero in the query, key and value projections, and the output projection reads only the original dimensions. The
function is unchanged, up to float rounding, because:

* the attention score: zeros add nothing to ``q . k``; the scale is ``1 / sqrt(D)`` instead of ``1 / sqrt(d)``, so
  the query rows are multiplied by ``sqrt(D / d)``;
* rotary embeddings (the ``rotate_half`` convention of transformers and vLLM): dimension ``i < d/2`` of a head is
  rotated with dimension ``i + d/2`` at frequency ``theta^(-2i/d)``. In the wide head, dimension ``j`` pairs with
  ``j + D/2`` at ``theta^(-2j/D)``; putting original dimension ``i`` at ``j = m i`` (and ``i + d/2`` at ``m i + D/2``)
  gives the same frequency and the same pair, and the zero dimensions pair with zeros;
* the values: the same positions, so the output projection's columns move with them and the rest are zero.

Measured (``tests/integration/test_vllm_engine.py``): the tiny model widened from 16 to 32 gives transformers'
greedy tokens in vLLM. The cost: the attention projections are ``m`` times wider (the tiny model's 4 x 16 becomes
4 x 32), which the experts' share of the compute dwarfs at every preset but the tiny one.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def positions(head_dim: int, wide: int) -> torch.Tensor:
    """Where each of a head's ``head_dim`` dimensions goes in a head of ``wide`` (see the module docstring)."""
    if wide % head_dim or wide <= head_dim or head_dim % 2:
        raise ValueError(
            f"cannot widen heads of {head_dim} to {wide}: it must be a larger multiple of an even size"
        )
    m, half = wide // head_dim, head_dim // 2
    first = torch.arange(half) * m
    return torch.cat([first, first + wide // 2])


def _spread_rows(weight: torch.Tensor, heads: int, head_dim: int, wide: int) -> torch.Tensor:
    """``[heads * head_dim, hidden]`` projection rows -> ``[heads * wide, hidden]``, zeros in the new rows."""
    out = weight.new_zeros(heads, wide, weight.shape[1])
    out[:, positions(head_dim, wide)] = weight.view(heads, head_dim, -1)
    return out.reshape(heads * wide, -1)


def widen_state(
    state: dict[str, torch.Tensor], heads: int, kv_heads: int, head_dim: int, wide: int
) -> dict[str, torch.Tensor]:
    """The attention projections of a Mixtral/Llama state dict widened (others as they are)."""
    scale = math.sqrt(wide / head_dim)
    out = {}
    for name, tensor in state.items():
        if name.endswith("self_attn.q_proj.weight"):
            tensor = _spread_rows(tensor, heads, head_dim, wide) * scale
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            tensor = _spread_rows(tensor, kv_heads, head_dim, wide)
        elif name.endswith("self_attn.o_proj.weight"):
            tensor = _spread_rows(tensor.t().contiguous(), heads, head_dim, wide).t().contiguous()
        elif any(f"self_attn.{p}." in name for p in ATTENTION):
            raise ValueError(f"{name}: attention biases are not widened (the architectures here have none)")
        out[name] = tensor
    return out


def head_dim_of(config: dict[str, object]) -> int:
    explicit = config.get("head_dim")
    if isinstance(explicit, int) and explicit > 0:
        return explicit
    return int(config["hidden_size"]) // int(config["num_attention_heads"])  # type: ignore[call-overload]


def widen_checkpoint(model_dir: str | Path, out_dir: str | Path, wide: int) -> Path:
    """``model_dir`` (a Hugging Face checkpoint directory) written to ``out_dir`` with heads of ``wide``: its
    config (``head_dim``), its weights (``model.safetensors``) and every other file (tokenizer, templates) as is."""
    from safetensors.torch import load_file, save_file  # the checkpoint's format; a conversion only

    src, out = Path(model_dir), Path(out_dir)
    config = json.loads((src / "config.json").read_text())
    head_dim = head_dim_of(config)
    shards = sorted(src.glob("*.safetensors"))
    if len(shards) != 1:
        raise ValueError(f"{src}: expected one model.safetensors, found {[s.name for s in shards]}")
    state = widen_state(
        load_file(shards[0]),
        int(config["num_attention_heads"]),
        int(config.get("num_key_value_heads") or config["num_attention_heads"]),
        head_dim,
        wide,
    )
    out.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name != "config.json":
            (out / item.name).write_bytes(item.read_bytes())
    save_file(state, out / shards[0].name, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "head_dim": wide}, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="a Hugging Face checkpoint directory (one model.safetensors)")
    parser.add_argument("out_dir", help="where the widened checkpoint is written")
    parser.add_argument(
        "--head-dim", type=int, default=32, help="the new head size (vLLM's CPU attention: 32+)"
    )
    args = parser.parse_args(argv)
    print(widen_checkpoint(args.model_dir, args.out_dir, args.head_dim))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
