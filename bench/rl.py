"""GRPO's two costs on the project's tiny model: the rollout (generation) and the update (training), each against
its baseline in the same run.

    .venv/bin/python bench/rl.py [--work DIR] [--prompts 8] [--k 8] [--max-new 32] [--steps 12]

One process, one machine, the shipped pretrained tiny model (``core/tiny``), CPU, fp32. Prompts are the chat
prompts of an RL stage: a passage of a standard-library module's docstring (a real text; lengths vary from 12 to
~100 words, and one passage is asked twice, as documents repeat) and the question which module it documents.

1. Rollout tokens/s: the K x B completions of a step sampled by the GRPO objective's own sampler
   (``grpo_rollout.BatchedSampler``: one left-padded ``generate`` call on the training tensors) against the *same*
   completions generated prompt by prompt (one ``generate`` call per prompt for its K completions, each forced to
   the recorded tokens with ``prefix_allowed_tokens_fn``, so both sides produce exactly the same tokens) and one
   completion at a time; and against the same batched call with every row's prompt prefilled on its own
   (``share_prefill = False``, the sampler before issue 49's shared prefill: ``shared_prefill_speedup``, and how
   many completions came out different, ``shared_prefill_rows_differing``). Tokens: completion tokens up to and
   with the end of turn. Each side three times, in turn; the median.
2. Training tokens/s: ``loop.optimizer_step`` with the GRPO objective (the micro-batches of that rollout, one
   prompt's group each as one row, its prompt shared by the K completions' branches, with advantages from the
   reference-F1 reward) against the same step on the same group laid out as K rows of prompt + completion
   (``share_prompt=False``, the layout before: ``shared_prompt_speedup``); the rows' step against SFT's
   language-model objective on the same rows (same tokens, same padding, loss on the completions:
   ``grpo_over_sft``) and against the same rows with the LM head run on every position (``head_on_learned_only =
   False``: the model before issue 49 ran the head and its softmax on prompt and padding positions too;
   ``learned_only_speedup``). Four engines from the same weights, stepped in turn so that all see the same machine
   load; the median over the timed steps (the first ``--warmup`` left out). Tokens: the rows' real (non-padding)
   tokens, the same count in both layouts (a shared prompt counts K times), so the rates compare the work done.

3. Rollout engines (``--vllm auto``, the default: when ``make vllm`` installed it): the same K x B rollout sampled by
   GRPO's two engines on the same weights, in turn, three rounds each, the median: ``BatchedSampler`` (transformers
   on the training tensors) and ``VLLMSampler`` (a vLLM engine, the weights synced to it before every rollout, as
   in training). The policy is the tiny model with its heads widened to 32 (``core/llm/widen_heads``: the same
   function; vLLM's CPU attention has no head size 16), on both sides. Wall-clock seconds here, whatever
   ``--clock`` says: the engine runs in other processes. vLLM's figure is given with and without the weight sync.

Seconds are this process's CPU seconds by default (``--clock cpu``; ``--clock wall`` for wall-clock): on the shared
2-core machine wall time swung 3x between identical passes at a load average of 12, CPU time by under 5%.

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [str(REPO)] + [
    p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent
]

MODULES = ["json", "pickle", "csv", "heapq", "bisect", "shelve", "textwrap", "difflib", "string", "fractions"]


def passages(count: int) -> list[dict[str, Any]]:
    """``count`` prompts in rl_prompts' format from stdlib docstrings, 12..100 words, the first asked twice."""
    import importlib

    rows = []
    for i in range(count - 1):
        module = MODULES[i % len(MODULES)]
        words = (importlib.import_module(module).__doc__ or module).split()
        size = 12 + (i * 29) % 88
        passage = " ".join(words[:size])
        rows.append(
            {
                "prompt": f'Which standard-library module does this documentation belong to? "{passage}"',
                "system_prompt": "Answer with the module name only.",
                "answer": module,
                "reference": f"The {module} module.",
            }
        )
    return [rows[0], *rows]


def time_it(fn: Any) -> tuple[float, Any]:
    """(seconds, result) of ``fn()``: this process's CPU seconds (``--clock cpu``, the default: on a machine shared
    with other tenants wall time measures them as much as the code) or wall-clock seconds (``--clock wall``)."""
    clock = time.process_time if CLOCK["name"] == "cpu" else time.perf_counter
    start = clock()
    out = fn()
    return clock() - start, out


CLOCK = {"name": "cpu"}


def forced(sampler: Any, prompts: list[list[int]], completions: list[list[int]]) -> None:
    """Generate exactly ``completions`` for ``prompts`` in one ``generate`` call (prompts of one group)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), sampler.pad_id)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :], mask[row, width - len(p) :] = torch.tensor(p), 1

    def allowed(row: int, sofar: torch.Tensor) -> list[int]:
        done = sofar.shape[0] - width
        target = completions[row]
        return [target[done]] if done < len(target) else [sampler.pad_id]

    with torch.no_grad():
        sampler.hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max(len(c) for c in completions),
            do_sample=False,
            prefix_allowed_tokens_fn=allowed,
            pad_token_id=sampler.pad_id,
            eos_token_id=sampler.eos_id,
        )


def rollout_bench(
    sampler: Any, token_ids: list[list[int]], k: int, max_new: int, rounds: int = 3
) -> dict[str, Any]:
    """Batched rollout against the same completions per prompt and one at a time (see the module docstring)."""
    prompts = [p for p in token_ids for _ in range(k)]
    times: dict[str, list[float]] = {"batched": [], "prefill_per_row": [], "per_prompt": [], "one_by_one": []}
    tokens, differing = [], 0
    for r in range(rounds):
        elapsed, completions = time_it(lambda r=r: sampler.generate(prompts, max_new, 1.0, 1.0, seed=r))
        times["batched"].append(elapsed)
        sampler.share_prefill = False  # the same call as before the shared prefill: every row prefilled
        elapsed, unshared = time_it(lambda r=r: sampler.generate(prompts, max_new, 1.0, 1.0, seed=r))
        sampler.share_prefill = True
        # the same tokens but where a draw falls within rounding of a boundary (the prefill's batch size differs)
        differing += sum(a != b for a, b in zip(unshared, completions, strict=True))
        times["prefill_per_row"].append(elapsed)
        tokens.append(sum(len(c) for c in completions))
        groups = [
            (prompts[g * k : (g + 1) * k], completions[g * k : (g + 1) * k]) for g in range(len(token_ids))
        ]
        times["per_prompt"].append(time_it(lambda groups=groups: [forced(sampler, *g) for g in groups])[0])
        times["one_by_one"].append(
            time_it(
                lambda c=completions: [forced(sampler, [p], [x]) for p, x in zip(prompts, c, strict=True)]
            )[0]
        )
    rate = {
        side: statistics.median(t / s for t, s in zip(tokens, spent, strict=True))
        for side, spent in times.items()
    }
    return {
        "completions_per_call": len(prompts),
        "completion_tokens_per_round": tokens,
        "tokens_per_s": {side: round(v, 1) for side, v in rate.items()},
        "shared_prefill_speedup": round(rate["batched"] / rate["prefill_per_row"], 2),
        "shared_prefill_rows_differing": differing,  # over all rounds; 0 in every run on the AVX-512 machine
        "speedup_vs_per_prompt": round(rate["batched"] / rate["per_prompt"], 2),
        "speedup_vs_one_by_one": round(rate["batched"] / rate["one_by_one"], 2),
        "last_completions": completions,
    }


def engine_bench(
    work: Path, objective: Any, token_ids: list[list[int]], k: int, max_new: int, rounds: int = 3
) -> dict[str, Any]:
    """GRPO's rollout on transformers and on vLLM, same weights, same prompts (see the module docstring)."""
    from nexa_dagster.core.llm.widen_heads import widen_checkpoint
    from nexa_dagster.core.training.grpo_rollout import BatchedSampler
    from nexa_dagster.core.training.init import load_mixtral_checkpoint
    from nexa_dagster.core.training.vllm_sampler import VLLMSampler

    wide = widen_checkpoint(objective.job.init_from, work / "tiny-policy-h32", 32)
    model = load_mixtral_checkpoint(str(wide)).eval()
    eos = objective.tokenizer.eos_token_id
    engines = {"transformers": BatchedSampler(model, objective.pad_id, eos)}
    started = time.perf_counter()
    engines["vllm"] = VLLMSampler(model, str(wide), work / "engine-bench", eos, objective.seq_len)
    start_s = time.perf_counter() - started
    prompts = [p for p in token_ids for _ in range(k)]
    rates: dict[str, list[float]] = {"transformers": [], "vllm": [], "vllm_with_sync": []}
    sync_s = []
    try:
        for r in range(rounds):
            for name, sampler in engines.items():
                synced = getattr(sampler, "sync_s", None) or 0.0
                begin = time.perf_counter()
                completions = sampler.generate(prompts, max_new, 1.0, 1.0, seed=r)
                elapsed = time.perf_counter() - begin
                tokens = sum(len(c) for c in completions)
                if name == "vllm":
                    sync = engines["vllm"].sync_s - synced
                    sync_s.append(sync)
                    rates["vllm_with_sync"].append(tokens / elapsed)
                    elapsed -= sync
                rates[name].append(tokens / elapsed)
    finally:
        engines["vllm"].close()
    median = {name: statistics.median(v) for name, v in rates.items()}
    return {
        "model": wide.name,
        "completions_per_call": len(prompts),
        "tokens_per_s": {name: round(v, 1) for name, v in median.items()},
        "vllm_vs_transformers": round(median["vllm"] / median["transformers"], 2),
        "vllm_with_sync_vs_transformers": round(median["vllm_with_sync"] / median["transformers"], 2),
        "weight_sync_s": round(statistics.median(sync_s), 3),
        "vllm_start_s": round(start_s, 1),
        "vllm": engines["vllm"].version,
    }


def training_batches(
    objective: Any, token_ids: list[list[int]], completions: list[list[int]], k: int
) -> tuple[list, list, list]:
    """(GRPO micro-batches with each group's prompt shared, the same as K rows each, SFT micro-batches of those
    rows): one prompt's group each."""
    import torch

    from nexa_dagster.core.training.data import LOSS_TOKENS
    from nexa_dagster.core.training.grpo import completion_batch, group_advantages

    texts = [objective.tokenizer.decode(c, skip_special_tokens=True) for c in completions]
    rewards, _ = objective.reward(texts, **objective.train.rows(range(len(token_ids)), k))
    advantages, _ = group_advantages(torch.tensor(rewards), k, "group")
    grpo, grpo_rows, sft = [], [], []
    for g, prompt in enumerate(token_ids):
        rows = slice(g * k, (g + 1) * k)
        group = (prompt, completions[rows], advantages[rows], objective.pad_id, torch.device("cpu"))
        grpo.append(completion_batch(*group))
        batch = completion_batch(*group, share_prompt=False)
        grpo_rows.append(batch)
        labels = batch["labels"]
        sft.append(
            {
                "input_ids": batch["input_ids"],
                "position_ids": batch["position_ids"],
                "labels": labels,
                LOSS_TOKENS: labels[:, 1:].ne(-100).sum(),
            }
        )
    return grpo, grpo_rows, sft


def train_bench(
    job: Any, objective: Any, batches: tuple[list, list, list], steps: int, warmup: int
) -> dict[str, Any]:
    """GRPO and SFT optimizer steps on the same rows, the engines stepped in turn."""
    import torch

    from nexa_dagster.core.training.lm_objective import LanguageModelLoss
    from nexa_dagster.core.training.loop import Control, build_engine, build_model, optimizer_step
    from nexa_dagster.core.training.nonfinite import NonFiniteGuard

    grpo, grpo_rows, sft = batches
    lm = LanguageModelLoss(sft[0], sft[0], micro_batch=len(sft[0]["input_ids"]))
    tokens = sum(int(b["real_tokens"]) for b in grpo)  # the rows' real tokens: the same in both layouts
    sides = {
        "grpo": (objective, grpo),
        "grpo_rows": (objective, grpo_rows),
        "sft": (lm, sft),
        "grpo_head_everywhere": (objective, grpo_rows),
    }
    engines = {
        name: build_engine(build_model(job, len(objective.tokenizer), objective.tokenizer), job, 1)
        for name in sides
    }
    # the LM head on every position, as before issue 49's cut
    engines["grpo_head_everywhere"].module.head_on_learned_only = False
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for step in range(1, steps + 1):
        for name, (obj, batches) in sides.items():
            engine = engines[name]
            guard = NonFiniteGuard(engine, torch.device("cpu"))
            elapsed, _ = time_it(
                lambda e=engine, o=obj, b=batches, g=guard, n=step: optimizer_step(
                    e, iter(b), len(b), Control(1), g, n, o
                )
            )
            if step > warmup:
                rates[name].append(tokens / elapsed)
    median = {name: statistics.median(v) for name, v in rates.items()}
    return {
        "tokens_per_step": tokens,
        "timed_steps": steps - warmup,
        "tokens_per_s": {name: round(v, 1) for name, v in median.items()},
        "grpo_over_sft": round(median["grpo_rows"] / median["sft"], 3),
        "learned_only_speedup": round(median["grpo_rows"] / median["grpo_head_everywhere"], 2),
        "shared_prompt_speedup": round(median["grpo"] / median["grpo_rows"], 2),
    }


def setup(work: Path, prompts: int, k: int, max_new: int) -> tuple[Any, Any]:
    """The job and the GRPO objective (prompts written in rl_prompts' format, the tiny model as init_from)."""
    from nexa_dagster.core.common.config import TrainingSettings, load_deepspeed_config
    from nexa_dagster.core.tiny.pretrain import build_pretrained_tiny_lm
    from nexa_dagster.core.training.grpo import GRPOLoss
    from nexa_dagster.core.training.job import GRPOObjective, TrainingJob
    from nexa_dagster.core.training.loop import load_tokenizer
    from nexa_dagster.core.training.worker import configure_environment

    model = build_pretrained_tiny_lm(work / "tiny-policy")
    path = work / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in passages(prompts)))
    settings = {
        "max_steps": 1000,
        "micro_batch_size": k,
        "gradient_accumulation_steps": prompts,
        "learning_rate": 1e-4,
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "grad_clip": 1.0,
        "log_every": 1,
        "num_procs": 1,
    }
    job = TrainingJob(
        run_id="bench-rl",
        tokenizer_path=str(model),
        model_preset="tiny",
        deepspeed_config=load_deepspeed_config("zero1_cpu.json"),
        settings=TrainingSettings(**settings),
        output_dir=str(work / "out"),
        data_kind="rl_prompts",
        init_from=str(model),
        objective=GRPOObjective(
            prompts_path=str(path),
            rewards=[{"name": "reference_f1"}],
            num_generations=k,
            prompts_per_step=prompts,
            max_completion_tokens=max_new,
        ),
    )
    configure_environment(job)

    class FixedRollouts(GRPOLoss):
        def rollout(self, engine: Any, micro: list, step: int) -> list:
            return micro  # the bench hands the step its micro-batches made from one recorded rollout

    return job, FixedRollouts(job, load_tokenizer(job), print)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", default="/tmp/nexa-bench-rl")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=32)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    parser.add_argument(
        "--vllm",
        choices=["auto", "yes", "no"],
        default="auto",
        help="compare the rollout engines (auto: if installed)",
    )
    args = parser.parse_args()
    CLOCK["name"] = args.clock
    import torch
    import transformers

    from nexa_dagster.core.training.grpo_rollout import BatchedSampler
    from nexa_dagster.core.training.init import load_mixtral_checkpoint

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    job, objective = setup(work, args.prompts, args.k, args.max_new)
    model = load_mixtral_checkpoint(job.init_from).eval()
    sampler = BatchedSampler(model, objective.pad_id, objective.tokenizer.eos_token_id)
    rollout = rollout_bench(sampler, objective.train.token_ids, args.k, args.max_new)
    completions = rollout.pop("last_completions")
    print(f"rollout: {json.dumps(rollout)}", flush=True)
    batches = training_batches(objective, objective.train.token_ids, completions, args.k)
    training = train_bench(job, objective, batches, args.steps, args.warmup)
    print(f"training: {json.dumps(training)}", flush=True)
    from nexa_dagster.core.llm.vllm_env import vllm_python

    engines = None
    if args.vllm == "yes" or (args.vllm == "auto" and vllm_python() is not None):
        engines = engine_bench(work, objective, objective.train.token_ids, args.k, args.max_new)
        print(f"engines: {json.dumps(engines)}", flush=True)
    print(
        json.dumps(
            {
                "bench": "rl",
                "device": "cpu",
                "model": Path(job.init_from).name,
                "prompts": args.prompts,
                "k": args.k,
                "max_new_tokens": args.max_new,
                "rollout": rollout,
                "training": training,
                "engines": engines,
                "load_average": os.getloadavg(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "python": platform.python_version(),
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
