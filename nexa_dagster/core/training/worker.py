"""The training process: ``python -m nexa_dagster.core.training.worker --job job.json``.

Launched by the GPU-cluster resource (locally, on Slurm, on Kubernetes). Under Dagster Pipes it streams progress
into the Dagster run's logs and reports the final metrics as materialization metadata; run by hand it prints.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import traceback
from pathlib import Path


def _single_process_defaults() -> None:
    """Let one process be a world of one, as ``torchrun`` would set it up."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", required=True, help="path of the TrainingJob JSON")
    args = parser.parse_args(argv)

    from nexa_dagster.core.training.job import TrainingJob

    job = TrainingJob.model_validate_json(Path(args.job).read_text())
    if job.accelerator == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    _single_process_defaults()
    rank = int(os.environ["RANK"])

    pipes = None
    if rank == 0 and os.environ.get("DAGSTER_PIPES_CONTEXT"):
        from dagster_pipes import open_dagster_pipes

        pipes_cm = open_dagster_pipes()
        pipes = pipes_cm.__enter__()

    def log(message: str) -> None:
        if pipes is not None:
            pipes.log.info(message)
        print(message, flush=True)

    def on_log(step: int, m: dict[str, float]) -> None:
        log(f"step {step}/{job.settings.max_steps} loss {m['loss']:.4f} lr {m['lr']:.2e} "
            f"grad_norm {m['grad_norm']:.3f} tokens/s {m['tokens_per_s']:.0f}")

    try:
        from nexa_dagster.core.training.loop import train

        log(f"training {job.run_id}: preset {job.model_preset}, {job.settings.max_steps} steps, "
            f"world size {os.environ['WORLD_SIZE']}, accelerator {job.accelerator}")
        result = train(job, on_log=on_log)
        log(f"saved {result.checkpoint_dir}: loss {result.first_loss:.4f} -> {result.final_loss:.4f}, "
            f"validation {result.validation_loss:.4f}, {result.tokens_per_s:.0f} tokens/s")
        if pipes is not None:
            # a custom message, not a materialization: the asset itself returns the Checkpoint artifact
            pipes.report_custom_message({
                "steps": result.steps, "first_loss": result.first_loss, "final_loss": result.final_loss,
                "validation_loss": result.validation_loss, "tokens_per_s": round(result.tokens_per_s, 1),
                "world_size": result.world_size, "checkpoint_dir": result.checkpoint_dir,
            })
        return 0
    except Exception as e:
        message = f"training {job.run_id} failed: {type(e).__name__}: {e}"
        print(traceback.format_exc(), file=sys.stderr, flush=True)
        print(message, file=sys.stderr, flush=True)
        Path(args.job).with_name("error.txt").write_text(message + "\n")  # read back by the launcher
        if pipes is not None:
            pipes.log.error(message)
        return 1
    finally:
        if pipes is not None:
            pipes_cm.__exit__(None, None, None)


if __name__ == "__main__":
    sys.exit(main())
