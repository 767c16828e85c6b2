"""Fault injection for the fault tests, and nothing else: the one place a test can make production code fail.

A fault test sets one environment variable in the process it starts (never in its own), and the production code
calls ``fault_point(name, ...)`` at the moment the fault must strike. Unset, a fault point costs one dictionary
lookup: the variable is read at each call (``fault_point`` says why).

====================================  ==================================================================
``NEXA_FAULT_KILL_BEFORE_RENAME``     a glob: SIGKILL the process when a file matching it is fully
                                      written and not yet renamed into place (``storage.atomic_writer``)
``NEXA_FAULT_STALL_AT_STEP``          a step: the training loop hangs after it (the stall watchdog test)
``NEXA_FAULT_NAN_AT_STEP``            a step: that step's loss is NaN (the non-finite guard test)
``NEXA_FAULT_KILL_AFTER_ROLLOUT``     a step: SIGKILL the training process once that step's GRPO rollouts
                                      are sampled (on vLLM: after the weight sync), before its update
``NEXA_FAULT_STEP_PAUSE_S``           seconds: the training loop sleeps that long after every step, a
                                      training that lasts minutes at little CPU (the Slurm time-limit test
                                      waits up to 95 s for slurmctld's warning; at full speed its worker
                                      trained throughout, 92 CPU-s in the suite of 2026-12-06)
====================================  ==================================================================
"""

from __future__ import annotations

import fnmatch
import os
import signal
import time

KILL_BEFORE_RENAME = "NEXA_FAULT_KILL_BEFORE_RENAME"
STALL_AT_STEP = "NEXA_FAULT_STALL_AT_STEP"
NAN_AT_STEP = "NEXA_FAULT_NAN_AT_STEP"
KILL_AFTER_ROLLOUT = "NEXA_FAULT_KILL_AFTER_ROLLOUT"
STEP_PAUSE = "NEXA_FAULT_STEP_PAUSE_S"
FAULTS = (KILL_BEFORE_RENAME, STALL_AT_STEP, NAN_AT_STEP, KILL_AFTER_ROLLOUT, STEP_PAUSE)


def fault_point(name: str, *, path: str = "", step: int = 0, stall_s: float = 0.0) -> bool:
    """Strike the fault ``name`` if a test armed it for this moment.

    ``KILL_BEFORE_RENAME``: kills this process when ``path`` matches the armed glob (does not return).
    ``KILL_AFTER_ROLLOUT``: kills this process at the armed step (does not return).
    ``STALL_AT_STEP``: sleeps ``stall_s`` at the armed step. ``NAN_AT_STEP``: returns True at the armed step (the
    caller poisons its loss). ``STEP_PAUSE``: sleeps the armed seconds, at every step. Anything else, or nothing
    armed: returns False at once.

    The variable is read at each call, not when this module is imported: a worker forked from a warm Python
    (``core/cluster/warm_python.py``, which imported this module under its own environment) takes the fault its
    launcher armed as a fresh process would.
    """
    armed = os.environ.get(name)
    if not armed:
        return False
    if name == KILL_BEFORE_RENAME:
        if fnmatch.fnmatch(path, armed):
            os.kill(os.getpid(), signal.SIGKILL)
        return False
    if name == STEP_PAUSE:
        time.sleep(float(armed))
        return True
    if int(armed) != step:
        return False
    if name == KILL_AFTER_ROLLOUT:
        os.kill(os.getpid(), signal.SIGKILL)
    if name == STALL_AT_STEP:
        time.sleep(stall_s)
    return True


def fault_env(name: str, value: str | int) -> dict[str, str]:
    """The environment entry that arms fault ``name`` in a process a test starts."""
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; one of {', '.join(FAULTS)}")
    return {name: str(value)}
