"""GRPO on a device with compiled layers for a few steps, dynamo's recompiles logged: why a step takes seconds.

    OUT=/tmp/probe python scripts/grpo_recompiles.py cuda 220   # device, timeout in seconds

It takes the GRPO job file of the data root ``build/gpu_data`` (a CPU `make run`'s, see scripts/gpu_check.sh), keeps
its model (the tiny preset) and starting checkpoint, and runs 8 steps on the device with ``TORCH_LOGS=recompiles``;
it prints the figures and the log's recompile and step lines. On CPU nothing is compiled (a rehearsal of the rest).
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, ".")
spec = importlib.util.spec_from_file_location("gpu_lifecycle", "bench/gpu_lifecycle.py")
gl = importlib.util.module_from_spec(spec)
sys.modules["gpu_lifecycle"] = gl  # its dataclasses look their module up
spec.loader.exec_module(gl)


def main() -> None:
    device, timeout = sys.argv[1], float(sys.argv[2])
    out = Path(os.environ.get("OUT", "/tmp/grpo_recompiles")) / "probe"
    out.mkdir(parents=True, exist_ok=True)
    jobs = gl.first_night_jobs(Path("build/gpu_data"))
    cuda = device == "cuda"
    plan = gl.Plan(device, None, "zero1_bf16.json" if cuda else None, 8, cuda, {}, 20)
    job = gl.training_job(plan, jobs["grpo"], "grpo", out, settings={"max_steps": 8, "log_every": 1})
    try:
        summary = gl.train(job, out, timeout, env={"TORCH_LOGS": "recompiles"})
        print(json.dumps(gl.figures(summary)))
    finally:
        log = (out / "gpu-lifecycle-grpo.log").read_text(errors="replace").splitlines()
        keep = [line for line in log if "ecompil" in line or line.startswith("step ") or "Error" in line]
        print("\n".join(keep[-60:]))


if __name__ == "__main__":
    main()
