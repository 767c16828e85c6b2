"""The thread policy (``settings.thread_policy``) applied inside this process: a process the project did not start
itself (Dagster's, a test worker) or one whose launcher's machine is not its own (a Slurm or Kubernetes worker).

The variables go into this process's environment, for a library not loaded yet (libgomp reads its wait policy
once, when it loads) and for every child that inherits it; torch's pool, when torch is loaded already, is resized
at once. Nothing here imports torch: a process that never computes does not pay for its import.
"""

from __future__ import annotations

import contextlib
import sys

from nexa_dagster import settings

# torch's inter-op pool runs only what torch.jit.fork hands it, which nothing here calls; one thread keeps it from
# starting a thread per core should a library call it
INTEROP_THREADS = 1


def use(policy: settings.ThreadPolicy) -> settings.ThreadPolicy:
    """Compute with ``policy`` from now on in this process and the children that inherit its environment."""
    for variable, value in policy.variables().items():
        settings.export(variable, value)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(policy.threads)
        # refused once inter-op work has started or the size was set: it then keeps its size
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(INTEROP_THREADS)
    return policy
