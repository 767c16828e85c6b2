"""DPO in the project's training worker: its throughput against SFT and TRL, and whether it learns a preference.

    .venv/bin/python bench/preference.py [--work DIR] [--steps 100] [--train-pairs 1200] [--val-pairs 400]

One run, one machine, the tiny preset (a random tiny Mixtral built here with the project's tokenizer), CPU, fp32:

1. ``dpo`` learning run: the project's worker (``python -m nexa_dagster.core.training.worker``, ``data_kind:
   preference``, DeepSpeed ZeRO-1) trains ``--steps`` steps of ``--micro`` pairs; before its loop it computes and
   stores the reference log-probabilities (their time is reported apart). Its held-out reward accuracy (the share
   of validation pairs whose chosen reward is above the rejected one) is reported with its Wilson 95% interval.
2. Throughput, three sides stepped in turn in one process, so that all three see the same machine load step for
   step (on a shared machine, runs one after the other measure the other tenants as much as the code):
   * ``dpo``: the worker's own functions (``build_model``/``build_engine``, ``pair_batches`` through the
     prefetching loader, ``preference_step``) with the reference values the learning run stored;
   * ``sft``: the worker's SFT path (``micro_batches``, ``optimizer_step``) on packed rows that are the DPO batch's
     rows (prompt + chosen and prompt + rejected, one per row, loss on the completion), ``2 x micro`` rows a step:
     the same tensors, the LM loss instead of DPO's;
   * ``trl``: TRL 1.16 ``DPOTrainer`` (the dev extra) on ``transformers.MixtralForCausalLM`` with the same
     weights, the same pairs as pre-tokenized rows with the same reference values, batches of ``micro`` pairs from
     its own dataloader; a step is what ``Trainer.train`` runs per step: ``training_step`` (loss and backward),
     gradient clipping, the optimizer and scheduler steps (the router aux loss at the preset's 0.02, as in the
     worker).
   tokens/s = a step's tokens over the median wall-clock step time (each side's first step left out); the ratios
   of median CPU time per step (this process's, all threads) are reported too: less sensitive to the other
   tenants of a shared machine.

Every pair has the same length (a prompt of ``--prompt`` text tokens, a completion of ``--completion`` text tokens +
the end of turn), so no side pays for padding and the three sides run the same batch shapes. The chosen completion
is the passage's next ``--completion`` tokens, the rejected one the same tokens shuffled (only the order tells them
apart); held-out pairs come from a third of the documents that no training pair uses, in windows that do not
overlap (training windows overlap by half). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")
# bench/packaging.py would shadow the ``packaging`` library that transformers imports: run from the repository root
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from nexa_dagster.core.common.config import TrainingSettings, load_deepspeed_config  # noqa: E402
from nexa_dagster.core.evaluation.paired import wilson_interval  # noqa: E402
from nexa_dagster.core.packaging.packing import labels_of  # noqa: E402
from nexa_dagster.core.tiny.model import build_tiny_causal_lm, default_corpus  # noqa: E402
from nexa_dagster.core.training.job import TrainingJob, TrainingResult  # noqa: E402

BETA = 0.1
AUX_COEF = 0.02  # configs/models/tiny.yaml


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


# -- data: fixed-length pairs, chosen in order, rejected shuffled ------------------------------------------------
def make_pairs(tokenizer, n_train: int, n_val: int, prompt_len: int, completion_len: int, seed: int = 0):  # noqa: ANN001
    """(train, validation) token records; validation passages come from documents no training pair uses."""
    rng = random.Random(seed)
    head = tokenizer.encode("<|im_start|>user\n", add_special_tokens=False)
    tail = tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    end = tokenizer.encode("<|im_end|>\n", add_special_tokens=False)
    special = set(tokenizer.all_special_ids)
    span = prompt_len + completion_len
    docs = default_corpus()
    order = list(range(len(docs)))
    rng.shuffle(order)
    val_docs, train_docs = order[: len(order) // 3], order[len(order) // 3 :]

    def windows(doc_ids: list[int], stride: int) -> list[list[int]]:
        out = []
        for d in doc_ids:
            ids = [t for t in tokenizer.encode(docs[d], add_special_tokens=False) if t not in special]
            out += [ids[s : s + span] for s in range(0, len(ids) - span, stride)]
        rng.shuffle(out)
        return out

    def records(spans: list[list[int]], n: int, prefix: str) -> list[dict]:
        if len(spans) < n:
            raise SystemExit(f"only {len(spans)} text windows for {n} {prefix} pairs: lower the counts")
        rows = []
        for i, ids in enumerate(spans[:n]):
            completion = ids[prompt_len:]
            shuffled = completion[:]
            while shuffled == completion:
                rng.shuffle(shuffled)
            rows.append(
                {
                    "pair_id": f"{prefix}-{i:05d}",
                    "prompt_input_ids": head + ids[:prompt_len] + tail,
                    "chosen_input_ids": completion + end,
                    "rejected_input_ids": shuffled + end,
                    "day": "2025-01-01",
                }
            )
        return rows

    # training windows overlap by half; held-out ones do not (each held-out pair its own text)
    return (
        records(windows(train_docs, span // 2), n_train, "train"),
        records(windows(val_docs, span), n_val, "heldout"),
    )


def write_pairs(records: list[dict], path: Path) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    schema = pa.schema(
        [("pair_id", pa.string())]
        + [(f"{k}_input_ids", pa.list_(pa.int32())) for k in ("prompt", "chosen", "rejected")]
        + [("day", pa.string())]
    )
    pq.write_table(pa.Table.from_pylist(records, schema=schema), path)
    return str(path)


def write_sft_rows(records: list[dict], path: Path) -> str:
    """Each pair's two rows as packed SFT rows (one document per row, loss on the completion)."""
    rows = []
    for r in records:
        for completion in (r["chosen_input_ids"], r["rejected_input_ids"]):
            ids = np.asarray(r["prompt_input_ids"] + completion)
            loss = np.asarray([0] * len(r["prompt_input_ids"]) + [1] * len(completion))
            position, attention = np.arange(ids.size), np.ones(ids.size, dtype=np.int64)
            rows.append(
                {
                    "input_ids": ids,
                    "loss_mask": loss,
                    "position_ids": position,
                    "attention_mask": attention,
                    "labels": labels_of(ids, loss, attention, position),
                }
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)
    return str(path)


# -- the worker sides -------------------------------------------------------------------------------------------
def run_worker(job: TrainingJob, work: Path) -> tuple[TrainingResult, str, float]:
    job_file = work / f"{job.run_id}.json"
    job_file.write_text(job.model_dump_json())
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "nexa_dagster.core.training.worker", "--job", str(job_file)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"training {job.run_id} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = TrainingResult.model_validate_json((Path(job.output_dir) / "training_summary.json").read_text())
    return result, proc.stdout, time.perf_counter() - start


def steady_tokens_per_s(checkpoint: str) -> float:
    """Tokens of a step over the median step time, step 1 (warm-up) left out: the worker logs every step here, and
    the median shrugs off the other tenants' bursts on a shared machine."""
    lines = [json.loads(line) for line in (Path(checkpoint) / "metrics.jsonl").read_text().splitlines()]
    later = [m for m in lines if m["step"] > 1]
    return float(np.median([m["tokens"] for m in later])) / float(np.median([m["step_s"] for m in later]))


def job_for(args: argparse.Namespace, model: Path, work: Path, run_id: str, **fields) -> TrainingJob:  # noqa: ANN003
    micro = fields.pop("micro")
    steps = fields.pop("steps")
    return TrainingJob(
        run_id=run_id,
        tokenizer_path=str(model),
        model_preset="tiny",
        deepspeed_config=load_deepspeed_config("zero1_cpu.json"),
        settings=TrainingSettings(
            max_steps=steps,
            micro_batch_size=micro,
            gradient_accumulation_steps=1,
            learning_rate=args.lr,
            warmup_steps=5,
            weight_decay=0.0,
            grad_clip=1.0,
            log_every=1,
            seed=0,
            num_procs=1,
            progress_every_s=3600,
        ),
        output_dir=str(work / "checkpoints" / run_id),
        accelerator="cpu",
        init_from=str(model),
        parent=f"path:{model}",
        **fields,
    )


# -- throughput: three sides in turn ----------------------------------------------------------------------------
def trl_trainer(model_dir: str, pairs_path: str, reference_path: str, micro: int, steps: int, lr: float):  # noqa: ANN201
    """TRL's DPOTrainer on the same weights, the same pre-tokenized pairs and the same reference values."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, MixtralForCausalLM, PrinterCallback
    from trl import DPOConfig, DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    records = pd.read_parquet(pairs_path)
    reference = pd.read_parquet(reference_path).set_index("pair_id").loc[records["pair_id"]]
    data = Dataset.from_dict(
        {
            "prompt_ids": [list(map(int, v)) for v in records["prompt_input_ids"]],
            "chosen_ids": [list(map(int, v)) for v in records["chosen_input_ids"]],
            "rejected_ids": [list(map(int, v)) for v in records["rejected_input_ids"]],
            "ref_chosen_logps": reference["ref_chosen_logps"].astype("float32").tolist(),
            "ref_rejected_logps": reference["ref_rejected_logps"].astype("float32").tolist(),
        }
    )
    config = DPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"),
        beta=BETA,
        loss_type=["sigmoid"],
        router_aux_loss_coef=AUX_COEF,
        precompute_ref_log_probs=False,
        per_device_train_batch_size=micro,
        max_steps=steps,
        learning_rate=lr,
        max_grad_norm=1.0,
        bf16=False,  # TRL's defaults (bf16 autocast, gradient checkpointing) off: fp32 like the worker on CPU
        gradient_checkpointing=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=10**6,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        max_length=None,
    )
    placeholder = [  # DPOTrainer tokenizes its dataset when built: one conversational row, replaced below
        {
            "prompt": [{"role": "user", "content": "hi"}],
            "chosen": [{"role": "assistant", "content": "a"}],
            "rejected": [{"role": "assistant", "content": "b"}],
        }
    ]
    trainer = DPOTrainer(
        model=MixtralForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        ref_model=MixtralForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        args=config,
        train_dataset=Dataset.from_list(placeholder),
        processing_class=tokenizer,
    )
    trainer.train_dataset = data
    trainer.precompute_ref_logps = True  # the reference values come with the rows (the ref model never runs)
    trainer.remove_callback(PrinterCallback)  # its end-of-training dict would land among the bench's lines
    config_ = trainer.model.config
    implementation = (
        f"experts {getattr(config_, '_experts_implementation', None) or 'default'}, attention "
        f"{getattr(config_, '_attn_implementation', None) or 'default'}"
    )
    return trainer, implementation


def interleaved(dpo_job: TrainingJob, sft_job: TrainingJob, steps: int) -> dict:
    """TRL's ``trainer.train()`` drives; after each of its steps a callback runs one step of the worker's DPO and one
    of its SFT (each timed); a TRL step is the time between two callbacks. Median step time per side."""
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer, TrainerCallback

    from nexa_dagster.core.training.data import Prefetcher, load_packed, micro_batches
    from nexa_dagster.core.training.loop import Control, build_engine, build_model, optimizer_step
    from nexa_dagster.core.training.nonfinite import NonFiniteGuard
    from nexa_dagster.core.training.preference import preference_step
    from nexa_dagster.core.training.preference_data import (
        PAIR_HOST_KEYS,
        load_pairs,
        pair_batches,
        read_reference_logps,
    )
    from nexa_dagster.core.training.worker import configure_environment

    cpu = torch.device("cpu")
    micro = dpo_job.settings.micro_batch_size
    tokenizer = AutoTokenizer.from_pretrained(dpo_job.tokenizer_path)
    pairs = load_pairs(dpo_job.train_path, tokenizer, 1 << 30)
    reference_file = next(Path(dpo_job.train_path).parent.glob("ref_logps-*.parquet"))
    meta = json.loads(reference_file.with_suffix(".json").read_text())
    pairs.with_reference(
        read_reference_logps(
            str(reference_file), meta["reference_id"], meta["dataset_run_hash"], pairs.pair_ids
        )
    )
    trainer, trl_implementation = trl_trainer(  # built before DeepSpeed's world of one is in the environment
        dpo_job.init_from,
        dpo_job.train_path,
        str(reference_file),
        micro,
        steps + 1,
        dpo_job.settings.learning_rate,
    )
    saved_environment = dict(os.environ)
    configure_environment(dpo_job)  # RANK, MASTER_PORT, ...: for this process only
    times: dict[str, list[float]] = {"dpo": [], "sft": [], "trl": []}
    cpu_times: dict[str, list[float]] = {"dpo": [], "sft": [], "trl": []}  # this process's CPU seconds
    try:
        engines = {
            "dpo": build_engine(build_model(dpo_job, len(tokenizer), tokenizer), dpo_job, 1),
            "sft": build_engine(build_model(sft_job, len(tokenizer), tokenizer), sft_job, 1),
        }
        loaders = {
            "dpo": Prefetcher(
                pair_batches(pairs, micro, 0, 0, 1, tokenizer.pad_token_id), cpu, host_keys=PAIR_HOST_KEYS
            ),
            "sft": Prefetcher(micro_batches(load_packed(sft_job.train_path), 2 * micro, 0, 0, 1), cpu),
        }
        guards = {k: NonFiniteGuard(e, cpu) for k, e in engines.items()}
        control = Control(1)
        run = {
            "dpo": lambda step: preference_step(
                engines["dpo"], loaders["dpo"], 1, control, guards["dpo"], step, BETA, "sigmoid"
            ),
            "sft": lambda step: optimizer_step(
                engines["sft"], loaders["sft"], 1, control, guards["sft"], step
            ),
        }

        class Interleave(TrainerCallback):
            left_at: tuple[float, float] | None = None

            def on_step_end(self, args, state, control_, **kwargs) -> None:  # noqa: ANN001, ANN003
                arrived = (time.perf_counter(), time.process_time())
                if self.left_at is not None:  # TRL's step 1 (from train()'s start) is left out, as ours
                    times["trl"].append(arrived[0] - self.left_at[0])
                    cpu_times["trl"].append(arrived[1] - self.left_at[1])
                for side in ("dpo", "sft") if state.global_step % 2 else ("sft", "dpo"):
                    start = (time.perf_counter(), time.process_time())
                    run[side](state.global_step)
                    if state.global_step > 1:
                        times[side].append(time.perf_counter() - start[0])
                        cpu_times[side].append(time.process_time() - start[1])
                self.left_at = (time.perf_counter(), time.process_time())

        trainer.add_callback(Interleave())
        trainer.train()
        for loader in loaders.values():
            loader.close()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved_environment)
    return {
        "step_s": {k: float(np.median(v)) for k, v in times.items()},
        "step_cpu_s": {k: float(np.median(v)) for k, v in cpu_times.items()},
        "trl_implementation": trl_implementation,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="", help="working folder (default: a temporary one)")
    parser.add_argument("--steps", type=int, default=100, help="DPO steps (the learning run)")
    parser.add_argument("--throughput-steps", type=int, default=20, help="timed steps of each side")
    parser.add_argument("--train-pairs", type=int, default=1200)
    parser.add_argument("--val-pairs", type=int, default=400)
    parser.add_argument("--micro", type=int, default=8, help="pairs per step (2x rows)")
    parser.add_argument("--prompt", type=int, default=24, help="prompt text tokens")
    parser.add_argument("--completion", type=int, default=24, help="completion text tokens")
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    work = Path(args.work or tempfile.mkdtemp(prefix="bench-preference-"))
    work.mkdir(parents=True, exist_ok=True)
    loads = {"start": load()}
    model = build_tiny_causal_lm(work / "model")
    tokenizer = AutoTokenizer.from_pretrained(model)
    train, heldout = make_pairs(tokenizer, args.train_pairs, args.val_pairs, args.prompt, args.completion)
    row_tokens = len(train[0]["prompt_input_ids"]) + len(train[0]["chosen_input_ids"])
    snapshot = work / "pairs" / "bench0001"
    train_path, val_path = (
        write_pairs(train, snapshot / "train.parquet"),
        write_pairs(heldout, snapshot / "validation.parquet"),
    )
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {loads['start']}; "
        f"{len(train)} training pairs, {len(heldout)} held-out pairs, rows of {row_tokens} tokens, "
        f"{args.micro} pairs ({2 * args.micro} rows) per step",
        flush=True,
    )

    # 1. the learning run: the project's worker, reference values computed before its loop
    dpo_job = job_for(
        args,
        model,
        work,
        "dpo",
        micro=args.micro,
        steps=args.steps,
        train_path=train_path,
        validation_path=val_path,
        data_kind="preference",
        dpo_beta=BETA,
        dataset_run_hash="bench0001",
    )
    dpo, out, dpo_wall = run_worker(dpo_job, work)
    worker_tps = steady_tokens_per_s(dpo.checkpoint_dir)
    loads["after_learning_run"] = load()
    reference_line = next(line for line in out.splitlines() if line.startswith("reference log-probabilities"))
    reference_s = float(reference_line.split(" computed in ")[1].split(" s ")[0])
    print(
        f"dpo worker, {args.steps} steps: loss {dpo.first_loss:.4f} -> {dpo.final_loss:.4f}, {worker_tps:,.0f} "
        f"tokens/s (median step), process {dpo_wall:.0f} s, reference values of {len(train) + len(heldout)} pairs "
        f"{reference_s:.1f} s",
        flush=True,
    )

    # 2. throughput: DPO, SFT (the same rows, the LM loss) and TRL stepped in turn
    sft_rows = write_sft_rows(
        train[: args.micro * (args.throughput_steps + 1)], work / "sft" / "train.parquet"
    )
    sft_job = job_for(
        args,
        model,
        work,
        "sft",
        micro=2 * args.micro,
        steps=args.throughput_steps + 1,
        train_path=sft_rows,
        validation_path=sft_rows,
    )
    measured = interleaved(dpo_job, sft_job, args.throughput_steps)
    loads["after_throughput"] = load()
    step_tokens = 2 * args.micro * row_tokens
    tps = {side: step_tokens / seconds for side, seconds in measured["step_s"].items()}
    cpu = measured["step_cpu_s"]
    for side in ("dpo", "sft", "trl"):
        print(
            f"{side:4s} {measured['step_s'][side] * 1000:6.1f} ms/step, {tps[side]:8,.0f} tokens/s (median of "
            f"{args.throughput_steps}; CPU {cpu[side] * 1000:6.1f} ms/step)"
            + (f" ({measured['trl_implementation']})" if side == "trl" else ""),
            flush=True,
        )

    n = dpo.validation_pairs or 0
    accuracy = dpo.reward_accuracy or 0.0
    low, high = wilson_interval(round(accuracy * n), n)
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(
        f"held-out reward accuracy {accuracy:.3f} (95% Wilson [{low:.3f}, {high:.3f}], n={n}), margin "
        f"{dpo.reward_margin:.4f}; DPO/SFT {tps['dpo'] / tps['sft']:.2f}x, DPO/TRL {tps['dpo'] / tps['trl']:.2f}x; "
        f"uptime: {uptime}",
        flush=True,
    )
    print(
        json.dumps(
            {
                "dpo_tokens_per_s": round(tps["dpo"], 1),
                "sft_tokens_per_s": round(tps["sft"], 1),
                "trl_tokens_per_s": round(tps["trl"], 1),
                "dpo_vs_sft": round(tps["dpo"] / tps["sft"], 3),
                "dpo_vs_trl": round(tps["dpo"] / tps["trl"], 3),
                "dpo_vs_sft_cpu_time": round(cpu["sft"] / cpu["dpo"], 3),
                "dpo_vs_trl_cpu_time": round(cpu["trl"] / cpu["dpo"], 3),
                "heldout_reward_accuracy": round(accuracy, 4),
                "heldout_reward_accuracy_ci": [round(low, 4), round(high, 4)],
                "heldout_reward_margin": round(dpo.reward_margin or 0.0, 5),
                "n": n,
                "train_pairs": len(train),
                "dpo_steps": args.steps,
                "throughput_steps": args.throughput_steps,
                "pairs_per_step": args.micro,
                "row_tokens": row_tokens,
                "dpo_worker_process_tokens_per_s": round(worker_tps, 1),
                "reference_logps_s": reference_s,
                "load": loads,
                "uptime": uptime,
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    # DeepSpeed's engines and TRL's trainer share this process: tearing their native threads down at interpreter
    # exit aborts ("terminate called without an active exception") after everything is printed; skip the teardown
    os._exit(0)
