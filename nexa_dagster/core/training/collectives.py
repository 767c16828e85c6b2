"""Collectives the training loop and its objectives share (no-ops in a world of one process)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_sum(*values: float) -> list[float]:
    """Sum scalars over ranks (a no-op for a single process)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(values)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


def barrier_if_distributed() -> None:
    """Every rank waits here (several ranks only): e.g. until rank 0 has written a file the others read."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
