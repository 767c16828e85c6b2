"""The training model is the exported model: same weights, same logits, attention kept within packed documents."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM

from nexa_dagster.core.training.model.moe import NexaMoEForCausalLM, to_hf


def small_config(**overrides: object) -> MixtralConfig:
    spec = {
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.02,
        "rope_theta": 10000.0,
    }
    return MixtralConfig(**{**spec, **overrides})


def test_exported_checkpoint_gives_the_training_models_logits(tmp_path: Path) -> None:
    """Export through save_pretrained, load with plain transformers: fp32 logits agree to rounding."""
    torch.manual_seed(0)
    model = NexaMoEForCausalLM(small_config()).eval()
    to_hf(model).save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    assert type(loaded) is MixtralForCausalLM
    ids = torch.randint(0, 300, (3, 40))
    with torch.no_grad():
        ours = model(ids, return_logits=True).logits
        theirs = loaded(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_bf16_logits_agree_within_bf16_tolerance() -> None:
    torch.manual_seed(1)
    model = NexaMoEForCausalLM(small_config()).eval().to(torch.bfloat16)
    hf = to_hf(model).eval()
    ids = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        ours, theirs = model(ids, return_logits=True).logits.float(), hf(input_ids=ids).logits.float()
    assert (ours - theirs).abs().max() < 0.05 * theirs.abs().max()


def test_loss_and_router_aux_loss_equal_transformers() -> None:
    """Same LM loss (shifted labels, -100 ignored) and the same load-balancing loss as Mixtral's."""
    torch.manual_seed(2)
    model = NexaMoEForCausalLM(small_config()).eval()
    hf = to_hf(model).eval()
    hf.config.output_router_logits = True
    ids = torch.randint(0, 300, (2, 24))
    labels = ids.masked_fill(torch.rand(ids.shape) < 0.3, -100)
    with torch.no_grad():
        ours, theirs = model(ids, labels=labels), hf(input_ids=ids, labels=labels)
    torch.testing.assert_close(ours.lm_loss + 0.02 * ours.aux_loss, theirs.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.aux_loss, theirs.aux_loss, rtol=1e-5, atol=1e-6)


def test_packed_documents_do_not_attend_to_each_other() -> None:
    """A row holding two documents gives each the logits it has alone (Hugging Face's causal mask would not)."""
    torch.manual_seed(3)
    model = NexaMoEForCausalLM(small_config()).eval()
    hf = to_hf(model).eval()
    ids = torch.randint(0, 300, (1, 30))
    position_ids = torch.cat([torch.arange(18), torch.arange(12)])[None]
    with torch.no_grad():
        packed = model(ids, position_ids=position_ids, return_logits=True).logits
        alone = torch.cat([hf(input_ids=ids[:, :18]).logits, hf(input_ids=ids[:, 18:]).logits], dim=1)
        leaky = hf(input_ids=ids, position_ids=position_ids).logits
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(leaky[:, 18:], alone[:, 18:], atol=1e-4), "the test would not see a leak"


def test_branches_of_a_shared_trunk_each_see_the_trunk_and_themselves_only() -> None:
    """A row of a trunk and three branches (GRPO's group with its prompt once, ``branch_ids``) gives each branch
    the logits it has as a row of its own after the trunk, and with the trunk's tokens weighted by the branch count
    the router's aux loss and expert load of the three rows; without ``branch_ids`` a branch would read the ones
    before it. FlexAttention's rule (the GPU path, ``attends``) is the dense mask the CPU uses, pair for pair."""
    from torch.nn.attention.flex_attention import create_mask

    from nexa_dagster.core.training.model.moe import DocumentMask, attends, document_ids

    torch.manual_seed(7)
    model = NexaMoEForCausalLM(small_config()).eval()
    trunk, tails = torch.randint(0, 300, (9,)), [torch.randint(0, 300, (n,)) for n in (4, 6, 3)]
    ids = torch.cat([trunk, *tails])[None]
    positions = torch.cat([torch.arange(9)] + [torch.arange(9, 9 + len(t)) for t in tails])[None]
    branches = torch.cat(
        [torch.zeros(9)] + [torch.full((len(t),), j + 1.0) for j, t in enumerate(tails)]
    ).long()
    weights = torch.cat([torch.full((9,), 3.0), torch.ones(13)])[None]
    rows = torch.full((3, 15), 0)
    alone = torch.zeros((3, 15))
    for r, tail in enumerate(tails):
        rows[r, : 9 + len(tail)], alone[r, : 9 + len(tail)] = torch.cat([trunk, tail]), 1
    with torch.no_grad():
        shared = model(ids, position_ids=positions, return_logits=True, branch_ids=branches[None])
        leaky = model(ids, position_ids=positions, return_logits=True).logits
        separate = model(rows, return_logits=True).logits
        stats = model.token_logps(ids, ids, positions, weights, branch_ids=branches[None])
        row_stats = model.token_logps(rows, rows, None, alone)
    start = 9
    for r, tail in enumerate(tails):
        torch.testing.assert_close(shared.logits[0, :9], separate[r, :9], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            shared.logits[0, start : start + len(tail)], separate[r, 9 : 9 + len(tail)], rtol=1e-5, atol=1e-5
        )
        start += len(tail)
    assert not torch.allclose(leaky[0, 13:19], separate[1, 9:15], atol=1e-4), "the test would not see a leak"
    torch.testing.assert_close(stats.aux_loss, row_stats.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats.expert_load, row_stats.expert_load, rtol=1e-5, atol=1e-6)

    docs = document_ids(torch.cat([positions, torch.cat([torch.arange(12), torch.arange(10)])[None]]))
    branch = torch.stack([branches, torch.zeros(22, dtype=torch.long)])
    dense = DocumentMask(
        torch.cat([positions, torch.cat([torch.arange(12), torch.arange(10)])[None]]), False, branch
    ).dense
    flex = create_mask(attends(docs, branch), 2, None, 22, 22, device="cpu")
    assert torch.equal(flex, dense)
    # and for packed rows without branches (SFT, pretraining, DPO) the document rule alone, in both forms
    plain = DocumentMask(
        torch.cat([positions, torch.cat([torch.arange(12), torch.arange(10)])[None]]), False
    ).dense
    assert torch.equal(create_mask(attends(docs, None), 2, None, 22, 22, device="cpu"), plain)
    assert not torch.equal(plain, dense), "the branches' rule is seen"


def test_experts_are_trained_and_load_is_reported() -> None:
    torch.manual_seed(4)
    model = NexaMoEForCausalLM(small_config())
    ids = torch.randint(0, 300, (2, 16))
    out = model(ids, labels=ids)
    out.loss.backward()
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.grad.abs().sum() > 0 and experts.down_proj.grad.abs().sum() > 0
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0, "the router learns through its weights"
    assert out.expert_load.shape == (2, 4)
    torch.testing.assert_close(out.expert_load.sum(-1), torch.ones(2))


def test_tied_embeddings_export() -> None:
    model = NexaMoEForCausalLM(small_config(tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    hf = to_hf(model)
    assert torch.equal(hf.lm_head.weight, model.lm_head.weight)


@pytest.mark.gpu
def test_gpu_paths_match_the_exported_model() -> None:
    """On CUDA: FlexAttention document masks and the experts against transformers' own forward.

    fp32 (no TF32) must agree to rounding. In bf16 (grouped GEMMs, compiled layers) a token whose two best experts
    are nearly tied can be routed differently by the two implementations' rounding, which changes that token's
    output entirely; so bf16 is held to: nearly every token agrees within bf16 tolerance.
    """
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(5)
    model = NexaMoEForCausalLM(small_config(hidden_size=128, intermediate_size=256)).cuda().eval()
    hf = to_hf(model).cuda().eval()
    ids = torch.randint(0, 300, (2, 256), device="cuda")
    position_ids = torch.cat([torch.arange(100), torch.arange(156)]).cuda()[None].expand(2, -1)
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, return_logits=True).logits, hf(input_ids=ids).logits, rtol=1e-4, atol=1e-4
        )
        packed = model(ids, position_ids=position_ids, return_logits=True).logits
        torch.testing.assert_close(packed[:, 100:], hf(input_ids=ids[:, 100:]).logits, rtol=1e-4, atol=1e-4)
        # GRPO's group as one row (a trunk of 100 tokens, two branches of 78) under FlexAttention: each branch's
        # logits are those of its own row after the trunk
        branches = torch.cat([torch.zeros(100), torch.ones(78), torch.full((78,), 2.0)]).long().cuda()[None]
        positions = torch.cat([torch.arange(178), torch.arange(100, 178)]).cuda()[None]
        shared = model(ids[:1], position_ids=positions, return_logits=True, branch_ids=branches).logits
        second = torch.cat([ids[:1, :100], ids[:1, 178:]], 1)
        torch.testing.assert_close(
            shared[:, 178:], hf(input_ids=second).logits[:, 100:], rtol=1e-4, atol=1e-4
        )

    model, hf = model.to(torch.bfloat16), hf.to(torch.bfloat16)
    model.compile_layers()
    with torch.no_grad():
        ours, theirs = model(ids, return_logits=True).logits.float(), hf(input_ids=ids).logits.float()
    per_token = (ours - theirs).abs().amax(-1)
    agree = (per_token < 0.05 * theirs.abs().max()).float().mean()
    assert agree > 0.97, f"only {agree:.1%} of tokens agree"


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    """Recomputing each layer in the backward pass trades compute for memory, never the result."""
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(6)
        model = NexaMoEForCausalLM(small_config())
        model.activation_checkpointing = checkpointing
        ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
        model(ids, labels=ids).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)


def test_chunked_loss_keeps_no_fp32_logits_for_backward() -> None:
    """What autograd saves for the backward pass holds no fp32 ``tokens x vocab`` logits (each chunk is recomputed),
    and the gradients are those of the unchunked loss."""
    torch.manual_seed(3)
    cfg = small_config(vocab_size=2000)
    model = NexaMoEForCausalLM(cfg)
    ids = torch.randint(0, 2000, (2, 48))
    saved: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    model.loss_chunk_tokens = 32  # 96 tokens: three chunks
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = model(ids, labels=ids)
    weights = {
        p.data_ptr() for p in model.parameters()
    }  # lm_head's weight (and its transpose) are not logits
    vocab_sized = [
        tuple(t.shape)
        for t in saved
        if t.dim() >= 1
        and t.shape[-1] == cfg.vocab_size
        and t.dtype == torch.float32
        and t.data_ptr() not in weights
    ]
    assert vocab_sized == [], vocab_sized  # before: one [32, 2000] fp32 softmax saved per chunk
    out.lm_loss.backward()
    chunked = [p.grad.clone() for p in model.parameters()]

    model.zero_grad()
    model.loss_chunk_tokens = 10_000  # one chunk
    full = model(ids, labels=ids)
    torch.testing.assert_close(full.lm_loss, out.lm_loss)
    full.lm_loss.backward()
    for a, p in zip(chunked, model.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-6)


def test_token_logps_and_their_gradients_are_those_of_the_full_logits_where_few_tokens_are_learned() -> None:
    """The LM head runs only where the next token is learned (GRPO: a completion after a long prompt, then
    padding): the labelled tokens' log-probabilities, zeros elsewhere, and the gradients equal those read from
    the logits of every position, across chunk boundaries."""
    torch.manual_seed(7)
    model = NexaMoEForCausalLM(small_config(vocab_size=500))
    model.loss_chunk_tokens = 3  # 2 rows x 5 learned tokens: four chunks
    ids = torch.randint(0, 500, (2, 40))
    labels = torch.full_like(ids, -100)
    labels[0, 30:35] = ids[0, 30:35]  # a 30-token prompt, 5 completion tokens, then padding
    labels[1, 12:17] = ids[1, 12:17]
    weights = torch.randn(ids.shape)

    scored = model(ids, labels=labels, per_token=True, temperature=0.7).token_logps
    (scored * weights).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    logits = model(ids, return_logits=True).logits / 0.7
    every = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    expected = torch.nn.functional.pad(every, (1, 0)) * labels.ne(-100)
    (expected * weights).sum().backward()
    torch.testing.assert_close(scored, expected, rtol=1e-5, atol=1e-6)
    assert int(scored.ne(0).sum()) == 10
    for ours, full in zip(grads, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(ours, full, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_compiled_head_on_learned_positions_matches_eager_as_their_count_changes(device: str) -> None:
    """The compiled LM head (``compile_head``, part of ``compile_layers``): the loss, the per-token
    log-probabilities and the gradients of micro-batches whose count of learned positions differs (as every GRPO
    and SFT micro-batch's does) equal the eager model's, and the head is compiled once for any count, not once per
    count (a recompile per micro-batch stalls training, then falls back to eager at the recompile limit without
    saying so). On CPU, inductor's C++ backend compiles it (the suite's machines have g++)."""
    import torch._dynamo

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(11)
    eager = NexaMoEForCausalLM(small_config(vocab_size=500, hidden_size=128)).to(device)
    compiled = NexaMoEForCausalLM(small_config(vocab_size=500, hidden_size=128)).to(device)
    compiled.load_state_dict(eager.state_dict())
    for model in (eager, compiled):
        model.loss_chunk_tokens = 64
    compiled.compile_head()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()

    ids = torch.randint(0, 500, (4, 96), device=device)
    graphs = []
    for learned in (5, 37, 70, 91, 13, 52, 88):  # learned tokens per row: a count new at every micro-batch
        labels = torch.full_like(ids, -100)
        labels[:, -learned:] = ids[:, -learned:]
        results = []
        for model in (eager, compiled):
            model.zero_grad()
            out = model(ids, labels=labels)
            out.loss.backward()
            logps = model(ids, labels=labels, per_token=True).token_logps.detach()
            results.append((out.lm_loss_sum.detach(), logps, [p.grad.clone() for p in model.parameters()]))
        (loss_e, logps_e, grads_e), (loss_c, logps_c, grads_c) = results
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(logps_c, logps_e, rtol=1e-4, atol=1e-4)
        for ours, theirs in zip(grads_c, grads_e, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-5)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    # Each head function compiles twice at most: once for a lone chunk (the view is its whole base) and once for a
    # chunk of several (dynamo guards on the view's base size); then never again, whatever the count.
    assert graphs[0] > 0, "nothing was compiled"
    assert graphs[-1] == graphs[1] <= 4, (
        f"graphs compiled after each micro-batch: {graphs} (a recompile per count)"
    )
