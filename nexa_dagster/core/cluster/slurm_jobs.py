"""What Slurm says about a job, a plain one or a job array (one state per element).

``scontrol show job -o <id>`` prints one line per array element (pending elements grouped on one line as
``ArrayTaskId=2-3%2``); a job is over only when no element is pending or running any more. Accounting (``sacct``)
answers the same where the cluster runs slurmdbd, after the controller has forgotten the job (``MinJobAge``).
"""

from __future__ import annotations

import subprocess

SLURM_DONE = {"COMPLETED"}
SLURM_ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
                "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"}


def scontrol_records(job_id: str) -> list[dict[str, str]]:
    """``scontrol show job -o``: one ``key -> value`` dict per line (one per array element, pending elements
    grouped); empty if the controller does not know the job."""
    proc = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    if proc.returncode != 0:
        return []
    return [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in proc.stdout.splitlines()]


def job_states(job_id: str) -> dict[str, str]:
    """Element (``ArrayTaskId``; the job id for a plain job) -> state, from the controller, else from accounting;
    empty if neither knows the job."""
    states = {fields.get("ArrayTaskId", fields.get("JobId", job_id)): fields["JobState"]
              for fields in scontrol_records(job_id) if "JobState" in fields}
    if states:
        return states
    proc = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "JobID,State"], capture_output=True,
                          text=True)
    for line in proc.stdout.splitlines() if proc.returncode == 0 else []:
        job, _, state = line.partition("|")
        if state:
            states[job.partition("_")[2] or job] = state.split()[0]  # "CANCELLED by 0" -> CANCELLED
    return states


def overall_state(states: dict[str, str]) -> str:
    """One state for the whole job: ``UNKNOWN`` if Slurm knows no element, an active state while any element is
    pending or running (``RUNNING`` first), else the first element's state that is not ``COMPLETED``, else
    ``COMPLETED``."""
    if not states:
        return "UNKNOWN"
    values = list(states.values())
    active = [s for s in values if s in SLURM_ACTIVE]
    if active:
        return "RUNNING" if "RUNNING" in active else active[0]
    return next((s for s in values if s not in SLURM_DONE), "COMPLETED")
