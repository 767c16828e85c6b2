"""``generate`` with each distinct prompt read once, however many answers are sampled from it.

GRPO samples K completions of every prompt and the RL gate 16 answers of every held-out prompt, each as rows of one
left-padded ``generate`` call. Hugging Face's ``generate`` runs the prefill (the whole prompt through the model) for
every row, so a group's identical prompt is read K times; with prompts of ~100-250 tokens and 8 new tokens the
prefill is most of the call. Here the distinct rows are prefilled once into a key/value cache, the cache rows are
copied to every row that repeats them, and ``generate`` continues from the cache: it reads only each row's last
prompt token, then samples as before. The attention mask and the positions are the ones ``generate`` would have
used (a left-padded row counts its positions from its first real token), so each row samples from the same
distribution and, under one seed, draws the same tokens: a test holds every step's logits to 1e-4 and the tokens
equal (a prefill in a batch of another size may round its last bits differently on another CPU's kernels).

Measured on the tiny model by ``bench/rl.py`` (its rollout part, against ``share=False``): docs/measurements.md.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


def generate_sharing_prompts(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    share: bool = True,
    **generate_kwargs: Any,
) -> torch.Tensor:
    """``model.generate(input_ids=..., attention_mask=..., **generate_kwargs)``, each distinct row prefilled once.

    The plain call where nothing repeats (teacher prompts, a judge's), where a row has a single token (nothing to
    prefill before it), where the caller brings a cache of its own, or with ``share=False`` (a bench's baseline).
    """
    cache_arg = _cache_argument(model)
    if not share or input_ids.shape[1] < 2 or cache_arg in generate_kwargs:
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, **generate_kwargs)
    rows = torch.cat([input_ids, attention_mask.to(input_ids.dtype)], dim=1)
    distinct, copy_of = torch.unique(rows, dim=0, return_inverse=True)
    if distinct.shape[0] == rows.shape[0]:  # nothing repeats
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, **generate_kwargs)
    from transformers import DynamicCache  # transformers is imported by whoever holds a model already

    width = input_ids.shape[1]
    ids, mask = distinct[:, :width], distinct[:, width:]
    positions = mask.cumsum(-1) - 1  # as generate() derives them from a left-padded mask
    positions.masked_fill_(mask == 0, 1)
    cache = DynamicCache(config=model.config)
    model(
        input_ids=ids[:, :-1],
        attention_mask=mask[:, :-1],
        position_ids=positions[:, :-1],
        use_cache=True,
        logits_to_keep=1,
        **{cache_arg: cache},
    )
    cache.batch_select_indices(copy_of)  # every row gets the cache of the distinct row it repeats
    return model.generate(
        input_ids=input_ids, attention_mask=attention_mask, **{cache_arg: cache}, **generate_kwargs
    )


def _cache_argument(model: Any) -> str:
    """``cache`` in transformers releases that renamed ``past_key_values`` (5.2x), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
