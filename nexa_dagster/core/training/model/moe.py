"""The Nexa MoE language model used for training: Mixtral's architecture, written for speed and for packing.

Why not train ``transformers.MixtralForCausalLM`` directly? It is the model we *export* to (every checkpoint is a
plain Hugging Face Mixtral directory that ``transformers`` and vLLM load), but as a training model it leaves speed
and correctness on the table:

* packed rows hold several documents; Hugging Face's causal mask lets a token attend across the boundary into the
  previous document. Here attention stays within each document (``position_ids`` restart at 0 per document):
  FlexAttention with a block mask on GPUs, a boolean mask with SDPA elsewhere;
* the experts run as two grouped GEMMs per layer over tokens sorted by expert (``torch.nn.functional.grouped_mm``),
  not a Python loop over experts, and each decoder layer is compiled on its own (torchtitan's per-block compile);
* the loss is computed from bf16 logits in chunks, never materialising ``tokens x vocab`` in fp32: not in the
  forward, and not for the backward either, where each chunk's logits are recomputed (activation checkpointing of
  the chunk) instead of being kept by autograd for every chunk at once.

The parameter names and shapes are exactly those of ``transformers``' Mixtral (5.x), so ``state_dict()`` loads into
``MixtralForCausalLM`` unchanged; ``tests/test_moe_model.py`` checks that both give the same logits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import ModelOutput

IGNORE_INDEX = -100

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@dataclass
class MoEOutput(ModelOutput):
    """What a training forward returns: the loss the optimizer minimises and the parts a monitor reports.

    A ``ModelOutput`` (a dict underneath), so DeepSpeed's ZeRO-3 hooks can find the tensors in it.
    """

    loss: torch.Tensor | None = None  # lm_loss + router_aux_loss_coef * aux_loss (None without labels)
    lm_loss: torch.Tensor | None = None
    lm_loss_sum: torch.Tensor | None = (
        None  # summed over the learned tokens: the training loop weights by tokens
    )
    aux_loss: torch.Tensor | None = None
    logits: torch.Tensor | None = (
        None  # only when asked for (evaluation, tests): training never materialises them
    )
    expert_load: torch.Tensor | None = (
        None  # [layers, experts] share of routed token slots each expert received
    )
    token_logps: torch.Tensor | None = (
        None  # [rows, seq] log-probability of each labelled token, 0 elsewhere (``token_logps``)
    )


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_tables(
    position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[batch, seq, head_dim]`` for rotary embeddings at each token's position in its own document."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device).float() / head_dim))
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_theta(config: object) -> float:
    """RoPE base frequency; transformers 5 keeps it in ``rope_parameters``, older versions on the config."""
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Number each packed document in a row: a new document starts wherever ``position_ids`` is 0."""
    return (position_ids == 0).cumsum(-1)


class DocumentMask:
    """Causal attention confined to each packed document, in the form the attention kernel wants.

    ``branch_ids`` (``[batch, seq]``, optional) lays one prompt's completions out as branches of a shared trunk
    (GRPO's group, ``core/training/grpo.py``): 0 marks the trunk, ``j > 0`` branch ``j``; a token attends, within its
    document and causally, to the trunk and to its own branch only, so each branch reads exactly what it would read
    as a row of its own after the trunk, which is computed once instead of once per branch.
    """

    def __init__(
        self, position_ids: torch.Tensor, use_flex: bool, branch_ids: torch.Tensor | None = None
    ) -> None:
        docs = document_ids(position_ids)
        batch, seq = docs.shape
        self.flex = None
        self.dense = None
        if use_flex:
            # optional: torch >= 2.5 only (pyproject allows 2.4), and only the FlexAttention path needs it
            from torch.nn.attention.flex_attention import create_block_mask

            self.flex = create_block_mask(
                attends(docs, branch_ids), batch, None, seq, seq, device=docs.device, _compile=docs.is_cuda
            )
        else:  # attends() for every pair at once
            causal = torch.ones(seq, seq, dtype=torch.bool, device=docs.device).tril()
            self.dense = (docs[:, :, None] == docs[:, None, :]) & causal  # [batch, q, kv]
            if branch_ids is not None:
                b = branch_ids
                self.dense &= (b[:, :, None] == b[:, None, :]) | (b[:, None, :] == 0)
            self.dense = self.dense[:, None]


def attends(docs: torch.Tensor, branch: torch.Tensor | None) -> Callable[..., torch.Tensor]:
    """FlexAttention's ``mask_mod``: query ``q`` of row ``b`` sees key ``kv`` in its own document, causally, and with
    ``branch`` ids in the trunk (branch 0) or its own branch only. ``DocumentMask``'s dense mask is the same rule
    computed for all pairs. Packed rows without branches (SFT, pretraining, DPO) get the document rule alone."""

    def same_document_causal(b, h, q, kv):  # noqa: ANN001, ANN202 - FlexAttention's mask_mod signature
        return (docs[b, q] == docs[b, kv]) & (q >= kv)

    if branch is None:
        return same_document_causal

    def in_trunk_or_own_branch(b, h, q, kv):  # noqa: ANN001, ANN202 - as above
        own = (branch[b, q] == branch[b, kv]) | (branch[b, kv] == 0)
        return same_document_causal(b, h, q, kv) & own

    return in_trunk_or_own_branch


_flex_attention = None


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: object) -> torch.Tensor:
    global _flex_attention
    if _flex_attention is None:
        # as in the block mask: torch >= 2.5
        from torch.nn.attention.flex_attention import flex_attention as fa

        _flex_attention = torch.compile(fa, dynamic=False)
    return _flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: DocumentMask | None
    ) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if mask is not None and mask.flex is not None:
            out = flex_attention(q, k, v, mask.flex)
        elif mask is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class Router(nn.Module):
    """Mixtral's router: softmax over all experts, keep the top k, renormalise their weights to sum to 1."""

    def __init__(self, hidden: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        probs = F.softmax(F.linear(x, self.weight).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        return probs, weights / weights.sum(-1, keepdim=True), experts


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x[rows of expert e] @ weight[e].T`` for every expert at once; rows are sorted by expert.

    ``offsets[e]`` is the end row of expert ``e``. One grouped GEMM kernel where PyTorch has one for this dtype and
    device (bf16 on Hopper/Ampere, fp32 on CPU); a loop over experts otherwise (fp16 on GPUs).
    """
    if _grouped_mm is not None and (x.device.type == "cpu" or x.dtype == torch.bfloat16):
        return _grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    out = x.new_empty(x.shape[0], weight.shape[1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        out[start:end] = x[start:end] @ weight[e].T
        start = end
    return out


class Experts(nn.Module):
    """SwiGLU experts stored as Hugging Face does: ``gate_up_proj [E, 2F, H]`` and ``down_proj [E, H, F]``."""

    def __init__(self, hidden: int, ffn: int, experts: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * ffn, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, ffn))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        tokens, k = experts.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # token-slots grouped by expert
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat)
        )  # not bincount: a fixed output shape compiles without graph breaks
        offsets = counts.cumsum(0).to(torch.int32)
        token = order // k  # the token each sorted slot belongs to
        rows = x[token]
        gate, up = grouped_linear(rows, self.gate_up_proj, offsets).chunk(2, dim=-1)
        out = grouped_linear(F.silu(gate) * up, self.down_proj, offsets)
        out = out.float() * weights.reshape(-1)[order, None]
        combined = torch.zeros(tokens, x.shape[-1], dtype=out.dtype, device=x.device)
        combined.index_add_(0, token, out)
        return combined.to(x.dtype)


class MoEBlock(nn.Module):
    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.gate = Router(hidden, experts, top_k)
        self.experts = Experts(hidden, ffn, experts)

    def forward(
        self, x: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns the output and this layer's two load-balancing statistics (per-expert means).

        ``token_mask`` (``[batch, seq]``, 1 for real tokens) leaves padding out of the statistics, as Hugging Face's
        ``load_balancing_loss_func`` does with an attention mask; None: every token counts (packed rows). It is a
        weight: a shared trunk's token that stands for ``n`` rows' copies of it counts ``n`` times.
        """
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs, weights, experts = self.gate(flat)
        out = self.experts(flat, weights, experts)
        # Switch/Mixtral load balancing: fraction of token slots per expert, and mean router probability
        if token_mask is None:
            slot_fraction = F.one_hot(experts, probs.shape[-1]).float().mean(0)  # [k, E]
            return out.view(shape), slot_fraction, probs.mean(0)
        m = token_mask.reshape(-1).float()
        count = m.sum().clamp(min=1)
        slot_fraction = (F.one_hot(experts, probs.shape[-1]).float() * m[:, None, None]).sum(0) / count
        return out.view(shape), slot_fraction, (probs * m[:, None]).sum(0) / count


class DecoderLayer(nn.Module):
    def __init__(self, cfg: object) -> None:
        super().__init__()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoEBlock(
            cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts, cfg.num_experts_per_tok
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: DocumentMask | None,
        token_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        moe_out, slot_fraction, mean_prob = self.mlp(self.post_attention_layernorm(x), token_mask)
        return x + moe_out, slot_fraction, mean_prob


class Backbone(nn.Module):
    def __init__(self, cfg: object) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class NexaMoEForCausalLM(nn.Module):
    """Mixtral-architecture MoE for training; ``config`` is a ``transformers.MixtralConfig``.

    ``forward(input_ids, position_ids, labels)`` returns an :class:`MoEOutput`. ``labels`` use -100 for tokens not
    learned (Hugging Face's convention; they are shifted by one here, as Hugging Face does).
    """

    def __init__(self, config: object, attention: str = "auto") -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.attention = (
            attention  # "auto": FlexAttention on CUDA, SDPA with a dense mask elsewhere; "causal"
        )
        self.activation_checkpointing = False
        self.loss_chunk_tokens = 8192
        self.head_on_learned_only = True  # False: every position through the LM head (bench/rl.py's before)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Hugging Face's initialisation for Mixtral: normal(0, initializer_range) for matrices, ones for norms."""
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, mean=0.0, std=std)

    def compile_layers(self) -> None:
        """Compile each decoder layer on its own: short compile times, one graph reused by every layer."""
        for i, layer in enumerate(self.model.layers):
            self.model.layers[i] = torch.compile(layer, dynamic=False)
        self.compile_head()

    def compile_head(self) -> None:
        """Compile the LM head and its loss for any count of positions: it runs on the labelled positions only,
        a count that changes with every micro-batch (a static compile would recompile at each)."""
        self._chunk_loss = torch.compile(self._chunk_loss, dynamic=True)
        self._chunk_logps = torch.compile(self._chunk_logps, dynamic=True)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_logits: bool = False,
        attention_mask: torch.Tensor | None = None,
        per_token: bool = False,
        temperature: float = 1.0,
        branch_ids: torch.Tensor | None = None,
    ) -> MoEOutput:
        """The LM loss of packed rows (SFT, pretraining); with ``per_token`` the log-probability of each labelled
        token instead (``token_logps``: what a preference objective sums per document), so that a DeepSpeed engine,
        which only ever calls ``forward``, can run either."""
        if per_token:
            if labels is None:
                raise ValueError("per_token scoring needs labels (the tokens to score, -100 elsewhere)")
            return self.token_logps(input_ids, labels, position_ids, attention_mask, temperature, branch_ids)
        cfg = self.config
        x, aux_loss, expert_load = self._trunk(input_ids, position_ids, branch_ids=branch_ids)
        logits = self.lm_head(x) if return_logits else None
        lm_loss = lm_loss_sum = loss = None
        if labels is not None:
            lm_loss_sum = self._loss(x, labels)
            lm_loss = lm_loss_sum / labels[:, 1:].ne(IGNORE_INDEX).sum().clamp(min=1)
            loss = lm_loss + cfg.router_aux_loss_coef * aux_loss
        return MoEOutput(
            loss=loss,
            lm_loss=lm_loss,
            lm_loss_sum=lm_loss_sum,
            aux_loss=aux_loss,
            logits=logits,
            expert_load=expert_load,
        )

    def token_logps(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temperature: float = 1.0,
        branch_ids: torch.Tensor | None = None,
    ) -> MoEOutput:
        """``[rows, seq]``: at each labelled token its log-probability, 0 elsewhere (summed per document by a
        preference objective).

        Token ``t`` (``labels[:, t] != -100``, ``t >= 1``) is scored by the logits at ``t - 1``: TRL's
        ``DPOTrainer`` scoring, computed in chunks as ``_loss`` is (``tokens x vocab`` never materialised in fp32).
        A document's first token (position 0) is a prompt token and never labelled, so no document is scored from
        the one before it. ``attention_mask`` (1 for real tokens) leaves padding out of the router aux loss and
        the expert load, as Hugging Face's Mixtral does (a weight: ``MoEBlock.forward``); attention stays within
        documents (``position_ids``) and, with ``branch_ids``, within a branch and its trunk (``DocumentMask``).
        Returns ``token_logps``, ``aux_loss`` and ``expert_load`` (no LM loss). ``temperature``: the
        log-probabilities of logits / temperature (what GRPO samples from; the LM head has no bias, so the hidden
        state is divided instead of the vocabulary-wide logits).
        """
        x, aux_loss, expert_load = self._trunk(input_ids, position_ids, attention_mask, branch_ids)
        if temperature != 1.0:
            x = x / temperature
        per_token = self._token_logps(x, labels).view(input_ids.shape)  # [:, t]: the token at t + 1
        return MoEOutput(
            aux_loss=aux_loss,
            expert_load=expert_load,
            token_logps=F.pad(per_token[:, :-1], (1, 0)),
        )

    def _trunk(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        token_mask: torch.Tensor | None = None,
        branch_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The decoder: final hidden states, the router aux loss over all layers and the expert load."""
        cfg = self.config
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_tables(position_ids, self.head_dim, rope_theta(cfg), x.dtype)
        use_flex = self.attention == "flex" or (self.attention == "auto" and x.is_cuda)
        # a block mask costs little even for single-document rows; branches always need their mask
        if use_flex or branch_ids is not None:
            mask = DocumentMask(position_ids, use_flex, branch_ids)
        elif self.attention == "causal" or not bool((position_ids[:, 1:] == 0).any()):
            mask = (
                None  # plain causal attention (one document per row, or asked for: the baseline's attention)
            )
        else:
            mask = DocumentMask(position_ids, use_flex=False)
        slot_fractions, mean_probs = [], []
        for layer in self.model.layers:
            if self.activation_checkpointing and self.training:
                x, frac, prob = torch.utils.checkpoint.checkpoint(
                    layer, x, cos, sin, mask, token_mask, use_reentrant=False
                )
            else:
                x, frac, prob = layer(x, cos, sin, mask, token_mask)
            slot_fractions.append(frac)
            mean_probs.append(prob)
        x = self.model.norm(x)
        frac = torch.stack(slot_fractions)  # [layers, k, E]
        prob = torch.stack(mean_probs)  # [layers, E]
        # Hugging Face's load_balancing_loss_func over all layers' router outputs at once
        aux_loss = (frac.mean(0) * prob.mean(0)[None]).sum() * cfg.num_local_experts
        expert_load = frac.sum(1).detach() / frac.shape[1]
        return x, aux_loss, expert_load

    def _loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy summed over learned tokens, computed in chunks of ``loss_chunk_tokens``.

        Only the positions that predict a labelled token go through the LM head (see ``_labelled``). Under autograd
        each chunk is checkpointed: the backward pass recomputes that chunk's logits (one more ``lm_head`` matmul
        per chunk) rather than autograd saving an fp32 ``chunk x vocab`` softmax for every chunk, which together
        would be the ``tokens x vocab`` fp32 tensor the chunking is meant to avoid.
        """
        hidden, targets, _ = _labelled(hidden, labels, self.head_on_learned_only)
        total = hidden.new_zeros((), dtype=torch.float32)
        for chunk in self._chunks(hidden, targets, self._chunk_loss):
            total = total + chunk
        return total

    def _token_logps(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``[tokens]`` log-probability of each labelled next token (0 elsewhere), chunked and checkpointed like
        ``_loss``: the same logits, kept per token instead of summed."""
        tokens = hidden.shape[0] * hidden.shape[1]
        hidden, targets, where = _labelled(hidden, labels, self.head_on_learned_only)
        scored = list(self._chunks(hidden, targets, self._chunk_logps))
        values = torch.cat(scored) if scored else hidden.new_zeros(0, dtype=torch.float32)
        return values.new_zeros(tokens).index_copy(0, where, values)

    def _chunks(
        self,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        head: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> Iterator[torch.Tensor]:
        """``head`` over ``loss_chunk_tokens`` positions at a time, each chunk checkpointed under autograd."""
        checkpointed = torch.is_grad_enabled() and hidden.requires_grad
        for start in range(0, hidden.shape[0], self.loss_chunk_tokens):
            chunk = (
                hidden[start : start + self.loss_chunk_tokens],
                targets[start : start + self.loss_chunk_tokens],
            )
            yield (
                torch.utils.checkpoint.checkpoint(head, *chunk, use_reentrant=False)
                if checkpointed
                else head(*chunk)
            )

    def _chunk_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")

    def _chunk_logps(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        return -F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="none")


def _labelled(
    hidden: torch.Tensor, labels: torch.Tensor, learned_only: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The final hidden states that predict a labelled token, those tokens, and the flat positions they are at.

    The LM head and the vocabulary-wide softmax are most of a small model's compute (the tiny model: 64 x 2,048
    = 131K multiply-adds per token and 2,048 exponentials, against ~125K in its two layers), and a position whose
    next token is not learned (a prompt, padding, a document's last token) gives nothing to the loss or its
    gradient: GRPO learns 8 completion tokens of rows of ~140, SFT the assistant turns only. Selecting them first gives the same sum and
    the same gradients for the labelled tokens. (On a GPU the selection's ``nonzero`` waits for the device once
    per micro-batch.)
    """
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
    if learned_only:
        where = targets.ne(IGNORE_INDEX).nonzero().squeeze(1)
    else:  # every position, as before (the head's ignore_index gives the unlearned ones 0)
        where = torch.arange(targets.numel(), device=targets.device)
    flat = hidden.reshape(-1, hidden.shape[-1])
    return flat.index_select(0, where), targets.index_select(0, where), where


def moe_with_weights(
    config: object, state: dict[str, torch.Tensor], attention: str, where: str
) -> NexaMoEForCausalLM:
    """The training MoE of ``config`` holding exactly ``state`` (a tied head may be absent from it); a tensor that
    does not map is an error naming ``where`` (the checkpoint it came from)."""
    model = NexaMoEForCausalLM(config, attention=attention)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(
            f"{where}: weights do not map onto the training MoE: missing {missing}, unexpected {unexpected}"
        )
    return model


def to_hf(model: NexaMoEForCausalLM) -> torch.nn.Module:
    """The same weights as a ``transformers.MixtralForCausalLM`` (for saving, serving and evaluation)."""
    from transformers import MixtralForCausalLM  # transformers' Mixtral code (seconds): only for a conversion

    hf = MixtralForCausalLM(model.config)
    state = {k.replace("_orig_mod.", ""): v for k, v in model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(
            f"weights do not map onto transformers' Mixtral: missing {missing}, unexpected {unexpected}"
        )
    return hf.to(next(model.parameters()).dtype)
