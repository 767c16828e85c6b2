"""Runtime monitors of a training run: throughput, MFU, memory, expert balance, and a stall watchdog.

MFU (model FLOPs utilisation) counts the FLOPs the model needs, not what the kernels happen to execute:
``6 x active parameters`` per token for the matrix products (forward + backward; an MoE token only runs its
top-k experts) plus ``12 x layers x hidden x sequence`` for attention scores (PaLM's formula, causal not halved),
divided by the accelerator's dense bf16 peak. Using active parameters is what makes MoE numbers comparable with a
dense model of the same active size.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable

import psutil
import torch

# Dense bf16 tensor-core peak (no sparsity), FLOP/s, by device-name substring.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def flops_per_token(active_params: int, layers: int, hidden: int, seq_len: int) -> float:
    return 6.0 * active_params + 12.0 * layers * hidden * seq_len


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None where it is unknown (CPUs): then MFU is not reported."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def mfu(tokens_per_s: float, per_token_flops: float, peak: float | None) -> float | None:
    return None if not peak else tokens_per_s * per_token_flops / peak


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return psutil.Process().memory_info().rss / 2**30


def expert_balance(expert_load: torch.Tensor) -> float:
    """Max over layers of (busiest expert's share / the fair share 1/E): 1.0 is perfect balance."""
    load = expert_load.float()
    return float((load.max(dim=-1).values * load.shape[-1]).max())


class StallWatchdog:
    """Fail the run when no training step completes within ``timeout_s``.

    A hung collective (a dead peer, a wedged NCCL) blocks forever without an error; the watchdog turns that into
    a failed run with diagnostics: the last step, how long ago, and every thread's Python stack. It is armed by the
    first ``beat()``, so engine start-up and compilation do not count against it.
    """

    def __init__(self, timeout_s: float, describe: Callable[[], str], exit_code: int = 3) -> None:
        self.timeout_s = timeout_s
        self.describe = describe
        self.exit_code = exit_code
        self._last: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stall-watchdog", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            if self._last is None:
                continue
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                sys.stderr.write(
                    f"STALL: no training step completed for {idle:.0f} s (limit {self.timeout_s:.0f} "
                    f"s); {self.describe()}; stacks of every thread follow\n"
                )
                sys.stderr.flush()
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                os._exit(self.exit_code)
