"""A plain PyTorch loop that trains the tiny model a few steps on chat examples: tests that need models of known
quality (a trained copy better than its random init, a fine-tune that breaks one slice) without a training job."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def train_steps(model: Any, encoded: Sequence[tuple[list[int], list[int]]], steps: int) -> None:
    """``steps`` AdamW steps (lr 3e-3, seed 0), one example each, cycling over ``encoded`` (input ids, loss mask):
    the mean NLL of the loss-masked tokens."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    torch.manual_seed(0)
    for step in range(steps):
        ids, mask = encoded[step % len(encoded)]
        x = torch.tensor([ids])
        logits = model(input_ids=x).logits[:, :-1]
        target_mask = torch.tensor([mask[1:]], dtype=torch.float32)
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")
        loss = (nll * target_mask).sum() / target_mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
