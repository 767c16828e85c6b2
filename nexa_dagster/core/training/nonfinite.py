"""A non-finite loss never reaches the weights, and nothing reads a GPU value back per step to make sure of it.

Three parts, all without a host sync of our own on a GPU:

- ``gate``: the last micro-batch's backward is multiplied by 1 when the step's loss so far is finite and by NaN when
  it is not (on device). A non-finite loss therefore always gives non-finite gradients, even where autograd alone
  would give finite ones, and multiplying by 1 changes no bit.
- DeepSpeed's own check of the gradients then skips the update (fp32 and bf16 ZeRO through the global grad norm it
  computes for clipping, fp16 through its loss scaler): that check is a host read DeepSpeed makes every step
  anyway. ``after_update`` turns such a skip into a ``FloatingPointError`` at once, from the host flag DeepSpeed
  leaves (``engine.was_step_applied()``), so fp32 ZeRO no longer skips updates silently. Under fp16 a skipped step
  is the loss scaler at work and is not an error.
- ``record`` keeps, on device, the first step whose loss was not finite; ``check`` reads it on the host at log steps
  only and raises naming that step (the fp16 case, or a non-finite loss on another rank).

An engine whose optimizer has no overflow check (DeepSpeed without ZeRO or half precision) cannot skip an update;
there ``before_update`` reads the flag per step, the one case that still costs a host sync.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

NO_STEP = 2**62  # "no non-finite step yet", also the neutral value of the MIN over ranks


class NonFiniteGuard:
    """The on-device record of the first non-finite step of a run, and the checks around each update."""

    def __init__(self, engine: Any, device: torch.device, group: Any = None) -> None:
        self.first = torch.full((), NO_STEP, dtype=torch.int64, device=device)
        self.engine_skips = hasattr(engine.optimizer, "overflow")
        self.loss_scaling = bool(engine.fp16_enabled())
        self.group = (
            group  # the host (gloo) group of ``Control`` for the MIN over ranks; None: the default group
        )

    def gate(self, loss_so_far: torch.Tensor) -> torch.Tensor:
        """1 where the step's loss is finite, NaN where it is not (a device scalar: multiply the last backward)."""
        return torch.where(torch.isfinite(loss_so_far), 1.0, float("nan")).to(loss_so_far.dtype)

    def record(self, step: int, loss: torch.Tensor) -> None:
        """Remember ``step`` on device if ``loss`` is not finite and no earlier step was (no host read)."""
        bad = ~torch.isfinite(loss.detach())
        self.first = torch.where(bad & (self.first == NO_STEP), torch.full_like(self.first, step), self.first)

    def before_update(self, step: int) -> None:
        """Only for an engine that cannot skip an update: read the flag now (a host sync, per step)."""
        if not self.engine_skips:
            self.check(step)

    def after_update(self, engine: Any, step: int) -> None:
        """Report a skipped update at once: DeepSpeed has already read its overflow flag back to the host."""
        if not engine.was_step_applied() and not self.loss_scaling:
            raise FloatingPointError(
                f"non-finite loss at step {step} (caught before its update, which was not "
                "applied): lower the learning rate or check the packed data"
            )

    def first_non_finite_step(self) -> int | None:
        """The first non-finite step on any rank (a host read and, with several ranks, a MIN over them)."""
        first = torch.tensor([int(self.first)], dtype=torch.int64)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(first, op=dist.ReduceOp.MIN, group=self.group)
        value = int(first[0])
        return None if value == NO_STEP else value

    def check(self, step: int) -> None:
        """At a log step: raise if any step so far had a non-finite loss (its update was skipped)."""
        first = self.first_non_finite_step()
        if first is not None:
            raise FloatingPointError(
                f"non-finite loss at step {first} (seen at step {step}; caught before its "
                "update, which was not applied): lower the learning rate or check the packed "
                "data"
            )
