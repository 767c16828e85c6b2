"""DPO in the project's training worker: its throughput against SFT's on the same documents and TRL's, and whether
it learns a preference.

    .venv/bin/python bench/preference.py [--work DIR] [--steps 100] [--train-pairs 1200] [--val-pairs 180]

One run, one machine, the tiny preset (a random tiny Mixtral built here with the project's tokenizer), CPU, fp32.
Pairs vary in length as the demo's do (prompts of half to twice ``--prompt`` text tokens, chosen and rejected
completions of independent log-normal lengths around ``--completion``): per-batch padding would pay for the longest
pair of every batch, and every new batch shape would be a FlexAttention recompile on a GPU.

1. ``dpo`` learning run: the project's worker (``python -m nexa_dagster.core.training.worker``, ``objective: dpo``,
   DeepSpeed ZeRO-1) trains ``--steps`` steps on micro-batches of ``2 x --micro`` packed rows; before its loop it
   computes and stores the reference log-probabilities (their time is reported apart). Its held-out reward accuracy
   (the share of validation pairs whose chosen reward is above the rejected one) is reported with its Wilson 95%
   interval.
2. Training throughput, three sides stepped in turn in one process, so that all three see the same machine load
   step for step (on a shared machine, runs one after the other measure the other tenants as much as the code):
   * ``dpo``: the worker's own loop step (``loop.optimizer_step`` with the ``DPOLoss`` objective, its packed
     batches through the prefetching loader) with the reference values the learning run stored;
   * ``sft``: the same step with the language-model objective on the same documents (prompt + chosen and prompt +
     rejected, loss on the completion) packed by SFT's own packer (``pack_table``) into rows of the same length,
     ``2 x --micro`` rows a step;
   * ``trl``: TRL 1.16 ``DPOTrainer`` (the dev extra) on ``transformers.MixtralForCausalLM`` with the same
     weights, the same pairs as pre-tokenized rows with the same reference values, batches of ``--micro`` pairs
     from its own dataloader (right-padded per batch); a step is what ``Trainer.train`` runs per step (the router
     aux loss at the preset's 0.02, as in the worker). Its tokens per step are ``--micro`` x a pair's mean tokens.
   tokens/s counts real tokens (padding left out): the median over the timed steps of a step's tokens over its
   wall-clock time (each side's first step left out). Median CPU time per step (this process's) is reported too.
3. Scoring throughput, on the DPO engine's model in eval mode: the reference log-probabilities of the first
   ``--score-pairs`` training pairs (``preference.score_pairs``, the worker's batches) against SFT's forward pass
   (the LM loss, no gradients) over the same documents SFT-packed; a micro-batch of each in turn, twice over,
   which first alternating, the median of the micro-batches' tokens/s.

The last line printed is one JSON object.
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
from nexa_dagster.core.tiny.model import build_tiny_causal_lm, default_corpus  # noqa: E402
from nexa_dagster.core.training.job import DPOObjective, TrainingJob, TrainingResult  # noqa: E402

BETA = 0.1
AUX_COEF = 0.02  # configs/models/tiny.yaml


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


# -- data: pairs of varied lengths, chosen in order, rejected shuffled ---------------------------------------------
def make_pairs(tokenizer, n_train: int, n_val: int, prompt_len: int, completion_len: int, seed: int = 0):  # noqa: ANN001
    """(train, validation) token records whose lengths vary as the demo's do: a prompt of ``prompt_len / 2`` to
    ``2 x prompt_len`` text tokens, chosen and rejected completions of independent log-normal lengths (median
    ``completion_len``, clipped to 4..3 x ``completion_len``); validation passages come from documents no training
    pair uses."""
    rng = random.Random(seed)
    head = tokenizer.encode("<|im_start|>user\n", add_special_tokens=False)
    tail = tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    end = tokenizer.encode("<|im_end|>\n", add_special_tokens=False)
    special = set(tokenizer.all_special_ids)
    longest_completion = 3 * completion_len
    span = 2 * prompt_len + longest_completion
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

    def length() -> int:
        return max(4, min(longest_completion, round(completion_len * rng.lognormvariate(0.0, 0.6))))

    def records(spans: list[list[int]], n: int, prefix: str) -> list[dict]:
        if len(spans) < n:
            raise SystemExit(f"only {len(spans)} text windows for {n} {prefix} pairs: lower the counts")
        rows = []
        for i, ids in enumerate(spans[:n]):
            p = rng.randint(max(1, prompt_len // 2), 2 * prompt_len)
            completion, shuffled = ids[p : p + length()], ids[p : p + length()]
            rng.shuffle(shuffled)
            if shuffled == completion:  # the shuffle left the order as it was: the pair would teach nothing
                shuffled = shuffled[::-1] if shuffled[::-1] != completion else shuffled[:-1]
            rows.append(
                {
                    "pair_id": f"{prefix}-{i:05d}",
                    "prompt_input_ids": head + ids[:p] + tail,
                    "chosen_input_ids": completion + end,
                    "rejected_input_ids": shuffled + end,
                    "day": "2025-01-01",
                }
            )
        return rows

    # training windows overlap; held-out ones do not (each held-out pair its own text)
    return (
        records(windows(train_docs, span // 4), n_train, "train"),
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


def write_sft_rows(records: list[dict], path: Path, pack_size: int, pad_id: int) -> str:
    """The pairs' documents (prompt + chosen, prompt + rejected; loss on the completion) packed into rows of
    ``pack_size`` tokens by SFT's own packer (``core.packaging.packing.pack_table``)."""
    import pyarrow.parquet as pq

    from nexa_dagster.core.packaging.packing import pack_table

    documents = []
    for r in records:
        for completion in (r["chosen_input_ids"], r["rejected_input_ids"]):
            ids = np.asarray(r["prompt_input_ids"] + completion, dtype=np.int32)
            documents.append(
                (ids, np.asarray([0] * len(r["prompt_input_ids"]) + [1] * len(completion), np.int8))
            )
    table, _ = pack_table(documents, pack_size, pad_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
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


def recording(batches, tokens: list[int], real) -> object:  # noqa: ANN001
    """The batches, each one's real tokens appended to ``tokens`` as it is handed on (the step pulls them)."""
    for batch in batches:
        tokens.append(real(batch))
        yield batch


def interleaved(dpo_job: TrainingJob, sft_job: TrainingJob, steps: int, score_pairs_n: int) -> dict:
    """TRL's ``trainer.train()`` drives; after each of its steps a callback runs one step of the worker's DPO and one
    of its SFT (each timed); a TRL step is the time between two callbacks. Then, on the DPO engine's model, the
    reference scoring of ``score_pairs_n`` pairs and SFT's forward pass over the same documents, in turn, 3 times.
    Per side: the median of per-step tokens/s (real tokens: padding left out)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer, TrainerCallback

    from nexa_dagster.core.training.data import Prefetcher, labels_for, load_packed, micro_batches
    from nexa_dagster.core.training.lm_objective import LanguageModelLoss
    from nexa_dagster.core.training.loop import Control, build_engine, build_model, optimizer_step
    from nexa_dagster.core.training.nonfinite import NonFiniteGuard
    from nexa_dagster.core.training.preference import DPOLoss, sequence_logps
    from nexa_dagster.core.training.preference_data import REAL_TOKENS, Pairs, scoring_batches
    from nexa_dagster.core.training.worker import configure_environment

    cpu = torch.device("cpu")
    micro = dpo_job.settings.micro_batch_size
    tokenizer = AutoTokenizer.from_pretrained(dpo_job.tokenizer_path)
    quiet = lambda message: None  # noqa: E731
    dpo = DPOLoss(dpo_job, tokenizer, quiet)  # the pairs, their layout, the reference values stored
    assert dpo.reference is not None, "the learning run stores the reference values"
    dpo.train.with_reference(dpo.reference)
    sft_rows = load_packed(sft_job.train_path)
    sft = LanguageModelLoss(sft_rows, sft_rows, 2 * micro)
    trl_pair_tokens = float(
        np.mean(
            [
                2 * p.size + c.size + r.size
                for p, c, r in zip(dpo.train.prompt, dpo.train.chosen, dpo.train.rejected, strict=True)
            ]
        )
    )
    reference_file = next(Path(dpo_job.train_path).parent.glob("ref_logps-*.parquet"))
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
    tokens: dict[str, list[int]] = {"dpo": [], "sft": []}
    try:
        engines = {
            "dpo": build_engine(build_model(dpo_job, len(tokenizer), tokenizer), dpo_job, 1),
            "sft": build_engine(build_model(sft_job, len(tokenizer), tokenizer), sft_job, 1),
        }
        loaders = {
            "dpo": Prefetcher(
                recording(dpo.batches(micro, 0, 0, 1, 0), tokens["dpo"], lambda b: int(b[REAL_TOKENS])),
                cpu,
                host_keys=dpo.host_keys,
            ),
            "sft": Prefetcher(
                recording(
                    micro_batches(sft_rows, 2 * micro, 0, 0, 1),
                    tokens["sft"],
                    lambda b: int(b["attention_mask"].sum()),
                ),
                cpu,
            ),
        }
        guards = {k: NonFiniteGuard(e, cpu) for k, e in engines.items()}
        control = Control(1)
        objectives = {"dpo": dpo, "sft": sft}

        def run(side: str, step: int) -> None:
            optimizer_step(engines[side], loaders[side], 1, control, guards[side], step, objectives[side])

        class Interleave(TrainerCallback):
            left_at: tuple[float, float] | None = None

            def on_step_end(self, args, state, control_, **kwargs) -> None:  # noqa: ANN001, ANN003
                arrived = (time.perf_counter(), time.process_time())
                if self.left_at is not None:  # TRL's step 1 (from train()'s start) is left out, as ours
                    times["trl"].append(arrived[0] - self.left_at[0])
                    cpu_times["trl"].append(arrived[1] - self.left_at[1])
                for side in ("dpo", "sft") if state.global_step % 2 else ("sft", "dpo"):
                    start = (time.perf_counter(), time.process_time())
                    run(side, state.global_step)
                    if state.global_step > 1:
                        times[side].append(time.perf_counter() - start[0])
                        cpu_times[side].append(time.process_time() - start[1])
                self.left_at = (time.perf_counter(), time.process_time())

        trainer.add_callback(Interleave())
        trainer.train()
        for loader in loaders.values():
            loader.close()

        # reference scoring vs SFT's forward pass, the same documents, the same model (no gradients, eval mode)
        model = engines["dpo"].module
        subset = Pairs(
            "subset",
            dpo.train.pair_ids[:score_pairs_n],
            dpo.train.prompt[:score_pairs_n],
            dpo.train.chosen[:score_pairs_n],
            dpo.train.rejected[:score_pairs_n],
        )
        subset_tokens = sum(
            2 * p.size + c.size + r.size
            for p, c, r in zip(subset.prompt, subset.chosen, subset.rejected, strict=True)
        )
        forward_rows = load_packed(sft_job.validation_path)  # the subset's documents, SFT-packed
        rows = forward_rows["input_ids"].shape[0]
        sft_chunks = [
            {k: v[i : i + 2 * micro] for k, v in forward_rows.items()} for i in range(0, rows, 2 * micro)
        ]

        def reference_batch(batch: dict) -> int:
            """One micro-batch of ``score_pairs``'s work (collated beforehand): score it, values to the host."""
            sequence_logps(model, batch)[0].double().cpu()
            return int(batch[REAL_TOKENS])

        def sft_batch(chunk: dict) -> int:
            model(input_ids=chunk["input_ids"], position_ids=chunk["position_ids"], labels=labels_for(chunk))
            return int(chunk["attention_mask"].sum())

        # batch by batch in turn (one of each, which first alternating, then the next pair), twice over: on a
        # loaded machine whole passes one after the other measure the other tenants' bursts more than the code
        scoring: dict[str, list[float]] = {"reference": [], "sft_forward": []}
        model.eval()
        with torch.no_grad():
            for _ in range(2):
                batches = scoring_batches(subset, dpo.layout, dpo.pad_id, 0, 1)
                for k, chunk in enumerate(sft_chunks):
                    pulled = next(batches, None)
                    if pulled is None:
                        break
                    sides = {
                        "reference": lambda b=pulled[0]: reference_batch(b),
                        "sft_forward": lambda c=chunk: sft_batch(c),
                    }
                    for side in sorted(sides, reverse=bool(k % 2)):  # which goes first alternates
                        start = time.perf_counter()
                        scoring[side].append(sides[side]() / (time.perf_counter() - start))
        model.train()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved_environment)
    forward_tokens = int(forward_rows["attention_mask"].sum())
    assert forward_tokens == subset_tokens, (forward_tokens, subset_tokens)
    per_step = {
        side: float(np.median([t / s for t, s in zip(tokens[side][1:], times[side], strict=False)]))
        for side in ("dpo", "sft")
    }
    per_step["trl"] = float(np.median([micro * trl_pair_tokens / s for s in times["trl"]]))
    return {
        "tokens_per_s": per_step,
        "step_s": {k: float(np.median(v)) for k, v in times.items()},
        "step_cpu_s": {k: float(np.median(v)) for k, v in cpu_times.items()},
        "tokens_per_step": {k: float(np.median(v[1:])) for k, v in tokens.items()},
        "scoring_tokens_per_s": {k: float(np.median(v)) for k, v in scoring.items()},
        "scoring_pairs": len(subset),
        "scoring_tokens": subset_tokens,
        "layout": [dpo.layout.rows, dpo.layout.length],
        "sft_rows": [int(sft_rows["input_ids"].shape[0]), int(sft_rows["input_ids"].shape[1])],
        "trl_implementation": trl_implementation,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="", help="working folder (default: a temporary one)")
    parser.add_argument("--steps", type=int, default=100, help="DPO steps (the learning run)")
    parser.add_argument("--throughput-steps", type=int, default=20, help="timed steps of each side")
    parser.add_argument("--train-pairs", type=int, default=1200)
    parser.add_argument("--val-pairs", type=int, default=180)
    parser.add_argument("--score-pairs", type=int, default=400, help="pairs of the scoring comparison")
    parser.add_argument("--micro", type=int, default=8, help="pairs per micro-batch at least (2x rows)")
    parser.add_argument("--prompt", type=int, default=24, help="median prompt text tokens")
    parser.add_argument("--completion", type=int, default=24, help="median completion text tokens")
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from nexa_dagster.core.training.preference_data import load_pairs, pair_layout

    work = Path(args.work or tempfile.mkdtemp(prefix="bench-preference-"))
    work.mkdir(parents=True, exist_ok=True)
    loads = {"start": load()}
    model = build_tiny_causal_lm(work / "model")
    tokenizer = AutoTokenizer.from_pretrained(model)
    train, heldout = make_pairs(tokenizer, args.train_pairs, args.val_pairs, args.prompt, args.completion)
    snapshot = work / "pairs" / "bench0001"
    train_path, val_path = (
        write_pairs(train, snapshot / "train.parquet"),
        write_pairs(heldout, snapshot / "validation.parquet"),
    )
    layout = pair_layout([load_pairs(p, tokenizer, 1 << 30) for p in (train_path, val_path)], args.micro)
    documents = [
        len(r["prompt_input_ids"]) + len(r[f"{side}_input_ids"])
        for r in train
        for side in ("chosen", "rejected")
    ]
    spread = np.percentile(documents, [0, 50, 90, 100]).astype(int).tolist()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {loads['start']}; "
        f"{len(train)} training pairs, {len(heldout)} held-out pairs; documents (prompt + completion) of "
        f"{spread[0]}/{spread[1]}/{spread[2]}/{spread[3]} tokens (min/median/p90/max); micro-batches of "
        f"{layout.rows} rows x {layout.length} tokens",
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
        objective=DPOObjective(beta=BETA),
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

    # 2. throughput: DPO, SFT (the same documents packed by SFT's packer to the same row length, the LM loss) and
    #    TRL stepped in turn; then reference scoring against SFT's forward pass on the same documents
    pad = tokenizer.pad_token_id
    sft_job = job_for(
        args,
        model,
        work,
        "sft",
        micro=2 * args.micro,
        steps=args.throughput_steps + 1,
        train_path=write_sft_rows(train, work / "sft" / "train.parquet", layout.length, pad),
        validation_path=write_sft_rows(
            train[: args.score_pairs], work / "sft" / "forward.parquet", layout.length, pad
        ),
    )
    measured = interleaved(dpo_job, sft_job, args.throughput_steps, args.score_pairs)
    loads["after_throughput"] = load()
    tps, cpu = measured["tokens_per_s"], measured["step_cpu_s"]
    for side in ("dpo", "sft", "trl"):
        print(
            f"{side:4s} {measured['step_s'][side] * 1000:6.1f} ms/step, {tps[side]:8,.0f} tokens/s (median of "
            f"{args.throughput_steps}; CPU {cpu[side] * 1000:6.1f} ms/step)"
            + (f", {measured['tokens_per_step'][side]:,.0f} real tokens/step" if side != "trl" else "")
            + (f" ({measured['trl_implementation']})" if side == "trl" else ""),
            flush=True,
        )
    scoring = measured["scoring_tokens_per_s"]
    print(
        f"reference log-probabilities {scoring['reference']:,.0f} tokens/s, SFT forward pass "
        f"{scoring['sft_forward']:,.0f} tokens/s ({measured['scoring_pairs']} pairs, {measured['scoring_tokens']:,} "
        "tokens, median over micro-batches in turn)",
        flush=True,
    )

    n = dpo.validation_pairs or 0
    accuracy = dpo.reward_accuracy or 0.0
    low, high = wilson_interval(round(accuracy * n), n)
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(
        f"held-out reward accuracy {accuracy:.3f} (95% Wilson [{low:.3f}, {high:.3f}], n={n}), margin "
        f"{dpo.reward_margin:.4f}; DPO/SFT training {tps['dpo'] / tps['sft']:.2f}x, reference/SFT forward "
        f"{scoring['reference'] / scoring['sft_forward']:.2f}x, DPO/TRL {tps['dpo'] / tps['trl']:.2f}x; "
        f"uptime: {uptime}",
        flush=True,
    )
    import torch
    import transformers

    print(
        json.dumps(
            {
                "dpo_tokens_per_s": round(tps["dpo"], 1),
                "sft_tokens_per_s": round(tps["sft"], 1),
                "trl_tokens_per_s": round(tps["trl"], 1),
                "dpo_vs_sft": round(tps["dpo"] / tps["sft"], 3),
                "reference_tokens_per_s": round(scoring["reference"], 1),
                "sft_forward_tokens_per_s": round(scoring["sft_forward"], 1),
                "reference_vs_sft_forward": round(scoring["reference"] / scoring["sft_forward"], 3),
                "dpo_vs_trl": round(tps["dpo"] / tps["trl"], 3),
                "dpo_vs_sft_cpu_time": round(cpu["sft"] / cpu["dpo"], 3),
                "tokens_per_step": measured["tokens_per_step"],
                "layout_rows_x_length": measured["layout"],
                "heldout_reward_accuracy": round(accuracy, 4),
                "heldout_reward_accuracy_ci": [round(low, 4), round(high, 4)],
                "heldout_reward_margin": round(dpo.reward_margin or 0.0, 5),
                "n": n,
                "train_pairs": len(train),
                "document_tokens_min_median_p90_max": spread,
                "dpo_steps": args.steps,
                "throughput_steps": args.throughput_steps,
                "dpo_worker_process_tokens_per_s": round(worker_tps, 1),
                "reference_logps_s": reference_s,
                "load": loads,
                "uptime": uptime,
                "cpus": os.cpu_count(),
                "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            }
        )
    )


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    # DeepSpeed's engines and TRL's trainer share this process: tearing their native threads down at interpreter
    # exit aborts ("terminate called without an active exception") after everything is printed; skip the teardown
    os._exit(0)
