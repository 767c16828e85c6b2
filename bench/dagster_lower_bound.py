"""Dagster's lower bound (pyproject.toml: dagster>=1.13,<1.14), checked and timed: runs
scripts/check_dagster_lower_bound.sh (dagster 1.13.0 in a venv of its own over .venv's other packages,
`dagster definitions validate`, the asset tests and every test that uses a private Dagster module) and reports it.

Run: .venv/bin/python bench/dagster_lower_bound.py [VENV]   (after `make install`; it installs from the package index)
Last line: one JSON object, the script's own (the Dagster version imported, validate, test files, tests passed) with
the wall time, the load average at the start and the end, and the exit status.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    script = ROOT / "scripts" / "check_dagster_lower_bound.sh"
    load_before = os.getloadavg()[0]
    start = time.monotonic()
    proc = subprocess.run(
        ["bash", str(script), *sys.argv[1:]], cwd=ROOT, capture_output=True, text=True, check=False
    )
    wall = time.monotonic() - start
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    try:
        result = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        result = {}
    if proc.returncode:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
    result.update(
        returncode=proc.returncode,
        wall_s=round(wall, 1),
        load_start=round(load_before, 1),
        load_end=round(os.getloadavg()[0], 1),
    )
    print(json.dumps(result))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
