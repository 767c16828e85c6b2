"""Training throughput of this project's MoE training path against the baseline a user would write.

    python bench/train_throughput.py --device cuda --preset nexa-moe-mini --seq 1024
    python bench/train_throughput.py --device cpu            # tiny preset, runs anywhere

Both sides train the same configuration with the real DeepSpeed engine, ZeRO-1, bf16 on GPUs (fp32 on CPU), AdamW,
on the same synthetic packed rows (documents of random length, position_ids restarting per document):

* ``nexa``: this project's path, the very functions the training worker uses (``build_model``/``build_engine``/
  ``optimizer_step`` with the prefetching loader): grouped-GEMM experts, attention kept within documents
  (FlexAttention), per-layer ``torch.compile``, chunked loss;
* ``baseline``: ``transformers.MixtralForCausalLM`` of the same config (its default experts implementation and SDPA
  attention, router aux loss on), wrapped by ``deepspeed.initialize``, ``engine(input_ids, labels).loss``.

Each side runs in its own process (DeepSpeed keeps global state; peak memory must not mix) and is timed over
``--steps`` optimizer steps after ``--warmup`` steps (compilation excluded). The headline ``speedup`` compares this
project's path at its micro-batch (64 rows of 1024 tokens: the per-step CPU work of DeepSpeed's optimizer and the
kernel launches is then hidden behind GPU work) with the baseline as the issue measured it (micro-batch 16);
``speedup_same_micro_batch`` runs the baseline at the same micro-batch too. MFU counts 6 x active parameters + the
attention FLOPs per token against the device's dense bf16 peak. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# run as a script, bench/ is sys.path[0]: bench/packaging.py would shadow the installed `packaging` module
sys.path[:] = [str(REPO)] + [
    p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent
]

# The configuration the issue's baseline figure was measured on (h=512, 8 layers, 8 experts top-2, ffn 1024).
ISSUE_CONFIG = {
    "architecture": "MixtralForCausalLM",
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 4096,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "tie_word_embeddings": False,
}


def synthetic_rows(rows: int, seq: int, vocab: int, seed: int) -> dict:
    """Packed rows of random tokens: documents of 64..seq tokens back to back, position_ids restarting."""
    import torch

    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (rows, seq), generator=g)
    position_ids = torch.empty(rows, seq, dtype=torch.long)
    for r in range(rows):
        pos = 0
        while pos < seq:
            length = int(torch.randint(64, seq + 1, (1,), generator=g))
            end = min(seq, pos + length)
            position_ids[r, pos:end] = torch.arange(end - pos)
            pos = end
    ones = torch.ones(rows, seq, dtype=torch.long)
    return {
        "input_ids": input_ids,
        "loss_mask": ones,
        "position_ids": position_ids,
        "attention_mask": ones.clone(),
    }


def model_spec(args: argparse.Namespace) -> dict | str:
    return ISSUE_CONFIG if args.preset == "issue" else args.preset


def run_side(args: argparse.Namespace) -> dict:
    """One side of the benchmark, in this process."""
    import torch

    from nexa_dagster.core.common.config import TrainingSettings, load_deepspeed_config
    from nexa_dagster.core.training import monitor
    from nexa_dagster.core.training.data import Prefetcher, labels_for, micro_batches
    from nexa_dagster.core.training.job import TrainingJob
    from nexa_dagster.core.training.lm_objective import LanguageModelLoss
    from nexa_dagster.core.training.loop import (
        Control,
        build_engine,
        build_model,
        count_parameters,
        optimizer_step,
    )
    from nexa_dagster.core.training.model.config import build_model_config
    from nexa_dagster.core.training.nonfinite import NonFiniteGuard

    cuda = args.device == "cuda"
    spec = model_spec(args)
    from nexa_dagster.core.common.config import load_model_preset

    vocab = (spec if isinstance(spec, dict) else load_model_preset(spec)).get("vocab_size", 2048)
    settings = TrainingSettings(
        max_steps=args.warmup + args.steps,
        micro_batch_size=args.micro_batch,
        gradient_accumulation_steps=1,
        learning_rate=3e-4,
        warmup_steps=10,
        weight_decay=0.01,
        grad_clip=1.0,
        log_every=10,
        seed=0,
        num_procs=1,
        compile=cuda and not args.no_compile,
        attention=args.attention,
    )
    job = TrainingJob(
        run_id="bench",
        train_path="-",
        validation_path="-",
        tokenizer_path="-",
        model_preset=args.preset if isinstance(spec, str) else "issue",
        deepspeed_config=load_deepspeed_config(
            args.ds_config or ("zero1_bf16.json" if cuda else "zero1_cpu.json")
        ),
        settings=settings,
        output_dir="/tmp/bench-unused",
        accelerator=args.device,
    )
    data = synthetic_rows(max(64, args.micro_batch * 4), args.seq, vocab, seed=0)
    torch.manual_seed(0)
    if args.side == "nexa":
        if isinstance(spec, dict):
            from nexa_dagster.core.training.model.moe import NexaMoEForCausalLM

            model = NexaMoEForCausalLM(build_model_config(spec, vocab_size=vocab), attention=args.attention)
        else:
            model = build_model(job, vocab, None)
        total, active = count_parameters(model)
        engine = build_engine(model, job, world_size=1)
        batches = Prefetcher(
            micro_batches(data, args.micro_batch, 0, 0, 1), torch.device(engine.device), depth=2
        )

        guard = NonFiniteGuard(engine, torch.device(engine.device))
        objective = LanguageModelLoss(data, data, args.micro_batch)

        def step() -> None:
            return optimizer_step(engine, batches, 1, Control(1), guard, 1, objective).loss
    else:
        import deepspeed
        from transformers import MixtralForCausalLM

        from nexa_dagster.core.training.loop import fill_deepspeed_config, skip_inference_comm_op

        # as the nexa side's build_engine: DeepSpeed's CPU shared-memory op, which no training calls, is not compiled
        # (45 CPU-s on a machine where nothing was built yet, every CI run: the suite runs this bench on a clean one)
        skip_inference_comm_op(job.accelerator)
        config = build_model_config(spec, vocab_size=vocab, output_router_logits=True)
        model = MixtralForCausalLM(config)
        total, active = count_parameters(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=fill_deepspeed_config(job, 1)
        )
        stream = micro_batches(data, args.micro_batch, 0, 0, 1)

        def step() -> None:
            batch = {k: v.to(engine.device) for k, v in next(stream).items()}
            out = engine(input_ids=batch["input_ids"], labels=labels_for(batch))
            engine.backward(out.loss)
            engine.step()
            return out.loss.detach()

    device = torch.device(engine.device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    compile_start = time.perf_counter()
    for _ in range(args.warmup):
        loss = step()
    sync()
    warmup_s = time.perf_counter() - compile_start
    if args.profile:
        profile_steps(step, sync)
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    sync()
    elapsed = time.perf_counter() - start
    tokens_per_s = args.steps * args.micro_batch * args.seq / elapsed
    cfg = model.config
    flops = monitor.flops_per_token(active, cfg.num_hidden_layers, cfg.hidden_size, args.seq)
    return {
        "side": args.side,
        "tokens_per_s": round(tokens_per_s, 1),
        "mfu": monitor.mfu(tokens_per_s, flops, monitor.peak_flops(device)),
        "peak_mem_gb": round(monitor.peak_memory_gb(device), 3),
        "step_ms": round(1000 * elapsed / args.steps, 2),
        "warmup_s": round(warmup_s, 1),
        "final_loss": round(float(loss), 4),
        "parameters_total": total,
        "parameters_active": active,
    }


def profile_steps(step, sync) -> None:  # noqa: ANN001
    """Where a step's time goes: the top kernels and operators of 5 steps, on stderr."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        sync()
    sys.stderr.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30) + "\n")
    sys.stderr.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15) + "\n")


def spawn(args: argparse.Namespace, side: str) -> dict:
    from nexa_dagster.core.common.net import free_port

    env = {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "DS_ACCELERATOR": args.device,
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    command = (
        [
            sys.executable,
            __file__,
            "--side",
            side,
            "--device",
            args.device,
            "--preset",
            args.preset,
            "--seq",
            str(args.seq),
            "--micro-batch",
            str(args.micro_batch),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--attention",
            args.attention,
        ]
        + (["--no-compile"] if args.no_compile else [])
        + (["--profile"] if args.profile else [])
        + (["--ds-config", args.ds_config] if args.ds_config else [])
    )
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if args.profile:
        sys.stderr.write(proc.stderr[-20000:])
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"{side} failed with exit code {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--preset",
        default=None,
        help="model preset (configs/models/) or 'issue' for the issue's "
        "config; default nexa-moe-mini on cuda, tiny on cpu",
    )
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument(
        "--micro-batch", type=int, default=None, help="this project's side (default 64 on cuda)"
    )
    parser.add_argument(
        "--baseline-micro-batch",
        type=int,
        default=None,
        help="the baseline's (default 16: the issue's measured configuration); the baseline is "
        "also run at --micro-batch for a same-batch ratio",
    )
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--attention", default="auto", help="auto (within documents) | causal | sdpa | flex")
    parser.add_argument("--only", choices=["nexa", "baseline"], default=None, help="run one side")
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler table per side")
    parser.add_argument(
        "--ds-config",
        default=None,
        help="a configs/deepspeed/ file for both sides (default "
        "zero1_bf16.json on cuda, zero1_cpu.json on cpu)",
    )
    parser.add_argument("--side", choices=["nexa", "baseline"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    args.preset = args.preset or ("nexa-moe-mini" if cuda else "tiny")
    args.seq = args.seq or (1024 if cuda else 256)
    args.micro_batch = args.micro_batch or (64 if cuda else 4)
    args.baseline_micro_batch = args.baseline_micro_batch or (16 if cuda else 4)
    args.steps = args.steps or (30 if cuda else 8)
    args.warmup = args.warmup if args.warmup is not None else (10 if cuda else 2)
    if args.side:
        print(json.dumps(run_side(args)), flush=True)
        return
    if args.only:
        print(json.dumps(spawn(args, args.only)))
        return
    nexa_batch = args.micro_batch
    args.micro_batch = args.baseline_micro_batch
    baseline = spawn(args, "baseline")
    print(f"baseline, micro-batch {args.micro_batch} (HF Mixtral + DeepSpeed ZeRO-1): {baseline}", flush=True)
    args.micro_batch = nexa_batch
    same = baseline if nexa_batch == args.baseline_micro_batch else spawn(args, "baseline")
    print(f"baseline, micro-batch {nexa_batch}: {same}", flush=True)
    nexa = spawn(args, "nexa")
    print(f"nexa, micro-batch {nexa_batch} (this project's training path): {nexa}", flush=True)
    device_name = "cpu"
    if cuda:
        import torch

        device_name = torch.cuda.get_device_name(0)
    print(
        json.dumps(
            {
                "device": device_name,
                "preset": args.preset,
                "seq": args.seq,
                "micro_batch": nexa_batch,
                "baseline_micro_batch": args.baseline_micro_batch,
                "attention": args.attention,
                "tokens_per_s": nexa["tokens_per_s"],
                "baseline_tokens_per_s": baseline["tokens_per_s"],
                "speedup": round(nexa["tokens_per_s"] / baseline["tokens_per_s"], 3),
                "baseline_same_micro_batch_tokens_per_s": same["tokens_per_s"],
                "speedup_same_micro_batch": round(nexa["tokens_per_s"] / same["tokens_per_s"], 3),
                "baseline_same_micro_batch_peak_mem_gb": same["peak_mem_gb"],
                "mfu": nexa["mfu"],
                "baseline_mfu": baseline["mfu"],
                "peak_mem_gb": nexa["peak_mem_gb"],
                "baseline_peak_mem_gb": baseline["peak_mem_gb"],
                "parameters_total": nexa["parameters_total"],
                "parameters_active": nexa["parameters_active"],
            }
        )
    )


if __name__ == "__main__":
    main()
