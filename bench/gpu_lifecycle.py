"""The lifecycle's GPU check in one command: the training and evaluation workers on the job files of a CPU `make run`.

    python bench/gpu_lifecycle.py --data-root data --device cuda   # on a GPU host (about 8 minutes on an H100)
    python bench/gpu_lifecycle.py --data-root data --device cpu    # the same stages, tiny preset (the suite runs it)

`make run` on any CPU machine leaves, under ``<data root>/runs/``, the job file of every worker it launched: the base
model's pretraining, each night's SFT, the DPO and GRPO trainings and each evaluation. This script takes the first night's
(paths rewritten from the root they were written under to ``--data-root``, so the data root can be copied to a GPU
host), points them at the device and runs each stage as its own process under its own timeout:

1. ``pretrain``: the training worker pretrains the preset from random weights on the corpus (bin/idx);
2. ``sft``: from that base, on the first night's packed SFT data (state saved every few steps, loss at every step);
3. ``dpo``: from that SFT model, on the preference pairs, its reference log-probabilities computed anew;
   ``grpo``: from that SFT model, GRPO on the RL prompts (rollouts generated on the device, the rewards, the update
   with the PPO-ptx rows), its held-out reward at the end;
4. ``evaluate``: the evaluation worker scores the SFT model and the base on eval set v1 and answers its prompts;
5. ``generate``: ``transformers`` reloads the SFT checkpoint and generates 16 tokens greedily;
6. ``resume``: the SFT run again, stalled after a saved state and SIGKILLed, then relaunched: its loss must equal the
   straight run's at every step;
7. ``fp16``: the SFT run with ``zero2_fp16.json`` (GPUs only: DeepSpeed has no fp16 path on CPU);
8. ``throughput``: ``bench/train_throughput.py`` (this project's training path against HF Mixtral + ZeRO-1).

Each stage's figures (steps, first and last loss, validation loss, tokens/s, peak memory, seconds) are printed as it
ends; the last line is one JSON object with every stage, the device and the library versions. A stage that fails or
times out is reported as such and the others still run; the exit status is 1 when any stage failed.

A GPU host without this project's Python environment (no network) needs carried: the repository (its source on
``PYTHONPATH``), a data root from a CPU `make run`, and wheels of what the host lacks (docs/measurements.md, "The GPU
host").
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# run as a script, bench/ is sys.path[0]: bench/packaging.py would shadow the installed `packaging` module
sys.path[:] = [str(REPO)] + [
    p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent
]

GENERATE = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path, device = sys.argv[1], sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path).to(device).eval()
ids = tokenizer("def add(a, b):", return_tensors="pt").to(device)
with torch.no_grad():
    out = model.generate(**ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
new = out[0, ids["input_ids"].shape[1]:]
print(len(new))
print(repr(tokenizer.decode(new)))
"""


@dataclass(frozen=True)
class Plan:
    """What each stage runs with on a device: the model preset, DeepSpeed config, steps and time limits."""

    device: str
    preset: str | None  # None: the preset the job files name (the tiny one of a CPU `make run`)
    deepspeed: str | None
    micro_batch: int | None
    compile: bool
    steps: dict[str, int]
    state_every: (
        int  # SFT and resume: resumable state every N steps; the resume run is killed after the first
    )
    timeouts: dict[str, int] = field(default_factory=dict)


PLANS = {
    "cuda": Plan(
        "cuda",
        "nexa-moe-mini",
        "zero1_bf16.json",
        8,
        True,
        {"pretrain": 60, "sft": 40, "dpo": 30, "grpo": 20, "fp16": 40},
        20,
        {
            "pretrain": 150,
            "sft": 90,
            "dpo": 120,
            "grpo": 150,
            "evaluate": 90,
            "generate": 60,
            "resume": 180,
            "fp16": 120,
            "throughput": 240,
        },
    ),
    "cpu": Plan(
        "cpu",
        None,
        None,
        None,
        False,
        {"pretrain": 6, "sft": 6, "dpo": 3, "grpo": 3, "fp16": 0},
        3,
        {
            "pretrain": 240,
            "sft": 240,
            "dpo": 240,
            "grpo": 240,
            "evaluate": 240,
            "generate": 120,
            "resume": 360,
            "fp16": 1,
            "throughput": 420,
        },
    ),
}


def rebase(value: Any, old: str, new: str) -> Any:
    """``value`` with every string under the root ``old`` moved under ``new`` (a data root copied to another host)."""
    if isinstance(value, str):
        return new + value[len(old) :] if value == old or value.startswith(old + "/") else value
    if isinstance(value, dict):
        return {k: rebase(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [rebase(v, old, new) for v in value]
    return value


def first_night_jobs(data_root: Path) -> dict[str, dict[str, Any]]:
    """The job files of the first pretraining, the first SFT from a base model, the first DPO training and the
    first SFT model's evaluation, rebased onto ``data_root``."""
    runs = data_root / "runs"

    def read(path: Path) -> dict[str, Any]:
        job = json.loads(path.read_text(encoding="utf-8"))
        written = Path(job.get("output_dir") or job["output_path"])
        # <root>/{base_models,checkpoints}/<id> (training) or <root>/runs/eval-<id>/scores.json (evaluation)
        old_root = str(written.parents[1] if "output_dir" in job else written.parents[2])
        return rebase(job, old_root, str(data_root.resolve()))

    def pick(pattern: str, keep: Any = lambda job: True) -> dict[str, Any]:
        for path in sorted(runs.glob(pattern)):
            job = read(path)
            if keep(job):
                return job
        raise SystemExit(f"no job file {runs}/{pattern} of the kind needed: run `make run` on a CPU first")

    sft = pick("ckpt-*/job.json", lambda job: job.get("parent", "").startswith("base:"))
    return {
        "pretrain": pick("base-*/job.json"),
        "sft": sft,
        "dpo": pick("pref-*/job.json"),
        "grpo": pick("rl-*/job.json"),
        "evaluate": pick(f"eval-{sft['run_id']}/eval_job.json"),
    }


def training_job(plan: Plan, job: dict[str, Any], stage: str, out: Path, **changes: Any) -> dict[str, Any]:
    """A job file's job pointed at this device and this run's output folder."""
    from nexa_dagster.core.common.config import load_deepspeed_config

    job = {
        **job,
        "run_id": f"gpu-lifecycle-{stage}",
        "output_dir": str(out / stage),
        "accelerator": plan.device,
    }
    settings = {**job["settings"], "num_procs": 1, "compile": plan.compile}
    if plan.micro_batch:
        settings["micro_batch_size"] = plan.micro_batch
    job["settings"] = {**settings, **changes.pop("settings", {})}
    if plan.preset:
        job["model_preset"] = plan.preset
    if plan.deepspeed:
        job["deepspeed_config"] = load_deepspeed_config(plan.deepspeed)
    return {**job, **changes}


def starts_from(out: Path, stage: str) -> dict[str, str]:
    """A training job's start: the checkpoint the earlier stage wrote."""
    return {"init_from": str(out / stage), "parent": f"path:gpu-lifecycle-{stage}"}


def dpo_job(job: dict[str, Any], reference_logps: Path) -> dict[str, Any]:
    """The DPO job with its reference model the weights it starts from, their log-probabilities computed anew (the
    CPU run's cached ones belong to other weights)."""
    objective = {**job["objective"], "reference_path": "", "reference_logps_path": str(reference_logps)}
    return {**job, "objective": objective}


LOG = logging.getLogger("gpu_lifecycle")  # on stderr: stdout's last line is the JSON object
# the environment every stage's process runs under (and the warm Python imports under, ``warm_start``)
BASE_ENV = {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}


# what starts the stages' processes (``main``): on a CPU it forks the workers from a warm Python
# (``core/cluster/warm_python.py``, what `make run`'s workers fork from): torch, transformers and DeepSpeed imported
# once, not by each of the seven worker launches (~5 s each on the 2-core machine). On a GPU every stage starts fresh:
# the GPU check's launches stay those its figures were measured with (docs/measurements.md), and a fork has not been
# run on a GPU host.
STARTER: Any = None


def worker_starter(device: str) -> Any:
    """The ``warm_python.WorkerStarter`` of this run, its warm Python importing on a CPU."""
    # here, not at the top: a GPU host runs this script with the repository's source alone on its path, and the
    # local backend's preload list comes with Dagster, which only the CPU path needs
    from nexa_dagster.core.cluster.warm_python import WorkerStarter

    starter = WorkerStarter(sys.executable, {**os.environ, **BASE_ENV}, LOG)
    if device == "cpu":
        from nexa_dagster.resources.gpu_cluster.local import WARM_PRELOAD

        starter.preload = WARM_PRELOAD
        starter.start()  # imports while the jobs are written; the first launch waits for it
    return starter


def launch(args: list[str], log: Path, env: dict[str, str] | None = None) -> Any:
    """A process in a session of its own (a kill reaches all of it), its output in ``log``: forked from the warm
    Python where there is one and ``args`` is a worker (``warm_python.fork_worker`` says on stderr why one is
    not), else a fresh process. Only ``python -m nexa_dagster...`` is forked: it sizes torch's threads by its
    policy (``threads.use``), while the throughput bench and the generation script take torch's default, which a
    fork would give as the warm Python's one thread. Either answers ``pid``, ``poll`` and ``wait``."""
    worker = len(args) >= 3 and args[1] == "-m" and args[2].startswith("nexa_dagster.")
    # the starter's environment (the one its warm Python imported under), with what this launch adds
    env = {**STARTER.env, **env} if env else None
    return STARTER.launch(args, REPO, log, env, own_session=True, fork=worker)


def finish(proc: Any, timeout: float, log: Path) -> None:
    """Wait for ``proc``; kill its session and raise with the log's tail when it fails or overruns."""
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise RuntimeError(f"timed out after {timeout:.0f} s; log {log}: {tail(log)}") from None
    if rc != 0:
        raise RuntimeError(f"exit {rc}; log {log}: {tail(log)}")


def tail(log: Path, chars: int = 1500) -> str:
    return log.read_text(encoding="utf-8", errors="replace")[-chars:]


def train(
    job: dict[str, Any], out: Path, timeout: float, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run the training worker on ``job``; return its ``training_summary.json``."""
    job_file = out / f"{job['run_id']}.json"
    job_file.write_text(json.dumps(job, indent=2), encoding="utf-8")
    log = out / f"{job['run_id']}.log"
    proc = launch(
        [sys.executable, "-m", "nexa_dagster.core.training.worker", "--job", str(job_file)], log, env
    )
    finish(proc, timeout, log)
    return json.loads((Path(job["output_dir"]) / "training_summary.json").read_text(encoding="utf-8"))


def figures(summary: dict[str, Any]) -> dict[str, Any]:
    """What a person compares across runs and devices."""
    keys = (
        "steps",
        "first_loss",
        "final_loss",
        "validation_loss",
        "tokens_per_s",
        "mfu",
        "peak_mem_gb",
        "wall_s",
    )
    out = {k: summary[k] for k in keys if k in summary}
    for k in (
        "reward_accuracy",
        "reward_margin",
        "validation_pairs",
        "resumed_from_step",
        "reward_first",
        "reward_final",
        "held_out_reward",
        "rollout_s",
        "update_s",
    ):
        if summary.get(k) is not None:
            out[k] = summary[k]
    return out


def resume(
    plan: Plan, sft: dict[str, Any], straight: dict[str, Any], out: Path, timeout: float
) -> dict[str, Any]:
    """The SFT run stalled just after its first saved state, SIGKILLed there, relaunched: the same loss at every
    step as the straight run."""
    job = {**sft, "run_id": "gpu-lifecycle-resume", "output_dir": str(out / "resume")}
    job_file = out / "gpu-lifecycle-resume.json"
    job_file.write_text(json.dumps(job, indent=2), encoding="utf-8")
    latest = out / "resume.state" / "latest"
    saved = f"step{plan.state_every:08d}"
    log = out / "gpu-lifecycle-resume.killed.log"
    stall = {"NEXA_FAULT_STALL_AT_STEP": str(plan.state_every + 1)}
    proc = launch(
        [sys.executable, "-m", "nexa_dagster.core.training.worker", "--job", str(job_file)], log, stall
    )
    deadline = time.monotonic() + timeout
    while not (latest.exists() and latest.read_text().strip() == saved):
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(f"no saved state at step {plan.state_every}; log {log}: {tail(log)}")
        time.sleep(0.2)
    time.sleep(1.0)  # in the stalled step now
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    summary = train(job, out, max(1.0, deadline - time.monotonic()))
    losses, reference = summary["loss_curve"], straight["loss_curve"]
    same = [tuple(a) == tuple(b) for a, b in zip(losses, reference, strict=False)]
    if summary.get("resumed_from_step") != plan.state_every or len(losses) != len(reference) or not all(same):
        raise RuntimeError(
            f"resumed from step {summary.get('resumed_from_step')}, losses {losses} differ from {reference}"
        )
    return {"killed_after_step": plan.state_every, "steps_compared": len(losses), "identical": True}


def generate(sft_dir: str, device: str, out: Path, timeout: float) -> dict[str, Any]:
    log = out / "gpu-lifecycle-generate.log"
    proc = launch([sys.executable, "-c", GENERATE, sft_dir, device], log)
    finish(proc, timeout, log)
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    count, text = int(lines[-2]), lines[-1]
    if count != 16:
        raise RuntimeError(f"generated {count} tokens, not 16")
    return {"tokens_generated": count, "text": text}


def evaluate(job: dict[str, Any], sft_dir: str, base_dir: str, plan: Plan, out: Path, timeout: float) -> dict:
    """The evaluation worker: both models scored on the eval set and answering its prompts (no benchmarks: the
    harness is not on every GPU host)."""
    scores = out / "scores.json"
    job = {
        **job,
        "run_id": "gpu-lifecycle-evaluate",
        "models": {"candidate": sft_dir, "production": base_dir},
        "accelerator": plan.device,
        "output_path": str(scores),
        "benchmarks": None,
    }
    job_file = out / "gpu-lifecycle-evaluate.json"
    job_file.write_text(json.dumps(job, indent=2), encoding="utf-8")
    log = out / "gpu-lifecycle-evaluate.log"
    t0 = time.perf_counter()
    argv = [sys.executable, "-m", "nexa_dagster.core.evaluation.worker", "--job", str(job_file)]
    finish(launch(argv, log), timeout, log)
    seconds = time.perf_counter() - t0
    result = json.loads(scores.read_text(encoding="utf-8"))["scores"]
    out_figures: dict[str, Any] = {"seconds": round(seconds, 1)}
    for role, s in result.items():
        out_figures[role] = {
            "eval_loss": round(
                sum(s["nll"]) / sum(s["tokens"]), 4
            ),  # mean loss per token, as the gate reads it
            "examples": len(s["nll"]),
            "answers": len(s["answers"]),
        }
    out_figures["examples_per_s"] = round(2 * out_figures["candidate"]["examples"] / seconds, 1)
    return out_figures


def throughput(plan: Plan, out: Path, timeout: float) -> dict[str, Any]:
    """``bench/train_throughput.py`` on this device: its last line's JSON."""
    log = out / "gpu-lifecycle-throughput.log"
    argv = [sys.executable, str(REPO / "bench" / "train_throughput.py"), "--device", plan.device]
    if plan.device == "cuda":
        argv += ["--preset", plan.preset or "nexa-moe-mini"]
    else:  # its smallest run, the suite's one run of it (tests/e2e/test_demo.py); --seq 64: its shortest document
        argv += ["--seq", "64", "--micro-batch", "1", "--baseline-micro-batch", "1"]
        argv += ["--steps", "1", "--warmup", "0"]
    finish(launch(argv, log), timeout, log)
    return json.loads(log.read_text().strip().splitlines()[-1])


def versions(device: str) -> dict[str, str]:
    """What the figures ran with: a GPU figure names its versions and its card."""
    import torch

    out = {"python": sys.version.split()[0], "torch": torch.__version__}
    for name in ("transformers", "deepspeed", "pydantic"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    out["device"] = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data-root", type=Path, default=REPO / "data", help="a data root a CPU `make run` made"
    )
    parser.add_argument("--device", choices=sorted(PLANS), default="cuda")
    parser.add_argument("--out", type=Path, default=None, help="default: <data root>/gpu_lifecycle/<time>")
    parser.add_argument("--skip", nargs="*", default=[], help="stages to leave out (e.g. throughput)")
    args = parser.parse_args()
    plan = PLANS[args.device]
    out = (args.out or args.data_root / "gpu_lifecycle" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True)
    jobs = first_night_jobs(args.data_root)
    t0 = time.perf_counter()
    if plan.device == "cpu":
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    global STARTER
    STARTER = worker_starter(plan.device)
    results: dict[str, Any] = {}
    runs: dict[str, dict[str, Any]] = {}

    def stage(name: str, work: Any) -> None:
        if name in args.skip:
            results[name] = {"status": "skipped", "reason": "--skip"}
            return
        started = time.perf_counter()
        try:
            results[name] = {"status": "ok", **work(plan.timeouts[name])}
        except Exception as e:  # one stage's failure is a figure too: the others still run
            results[name] = {"status": "failed", "error": str(e)[-2000:]}
        results[name]["seconds"] = round(time.perf_counter() - started, 1)
        print(f"{name}: {json.dumps(results[name])}", flush=True)

    def trained(name: str, job: dict[str, Any], timeout: float) -> dict[str, Any]:
        runs[name] = train(job, out, timeout)
        return figures(runs[name])

    # the training stages' jobs: each starts from the one before (pretrain -> SFT -> DPO; fp16 is SFT again)
    every = {"log_every": 1, "checkpoint_every": plan.state_every}
    steps = plan.steps
    jobs["pretrain"] = training_job(
        plan, jobs["pretrain"], "pretrain", out, settings={"max_steps": steps["pretrain"]}
    )
    jobs["sft"] = training_job(
        plan,
        jobs["sft"],
        "sft",
        out,
        settings={"max_steps": steps["sft"], **every},
        **starts_from(out, "pretrain"),
    )
    jobs["dpo"] = dpo_job(
        training_job(
            plan, jobs["dpo"], "dpo", out, settings={"max_steps": steps["dpo"]}, **starts_from(out, "sft")
        ),
        out / "reference_logps.parquet",
    )
    # GRPO from the SFT model: its rollouts, rewards and update on the device (the prompts and ptx rows make run's)
    jobs["grpo"] = training_job(
        plan, jobs["grpo"], "grpo", out, settings={"max_steps": steps["grpo"]}, **starts_from(out, "sft")
    )
    jobs["fp16"] = {
        **training_job(plan, jobs["sft"], "fp16", out, settings={"max_steps": steps["fp16"]}),
        "deepspeed_config": json.loads((REPO / "configs/deepspeed/zero2_fp16.json").read_text()),
    }
    for name in ("pretrain", "sft", "dpo", "grpo"):
        stage(name, lambda t, name=name: trained(name, jobs[name], t))
    stage(
        "evaluate",
        lambda t: evaluate(jobs["evaluate"], str(out / "sft"), str(out / "pretrain"), plan, out, t),
    )
    stage("generate", lambda t: generate(str(out / "sft"), plan.device, out, t))
    stage("resume", lambda t: resume(plan, jobs["sft"], runs["sft"], out, t))
    if steps["fp16"]:
        stage("fp16", lambda t: trained("fp16", jobs["fp16"], t))
    else:
        results["fp16"] = {"status": "skipped", "reason": "fp16 is a GPU path (DeepSpeed has none on CPU)"}
    stage("throughput", lambda t: throughput(plan, out, t))
    STARTER.close()

    failed = [name for name, r in results.items() if r["status"] == "failed"]
    print(
        json.dumps(
            {
                "bench": "gpu_lifecycle",
                "device": plan.device,
                "preset": plan.preset or jobs["sft"]["model_preset"],
                "versions": versions(plan.device),
                "seconds": round(time.perf_counter() - t0, 1),
                "failed": failed,
                "out": str(out),
                "stages": results,
            }
        )
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
