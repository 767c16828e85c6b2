"""Does a pretrained base (and a night of new data) give a better model? Measured on one fixed held-out eval set.

    .venv/bin/python bench/learning.py [--work DIR] [--pretrain-steps N] [--sft-steps N]

On the tiny profile (``configs/scales/tiny.yaml``: model preset, pack size, batch, learning rate and steps), in one
run, every model trained by the project's training worker (DeepSpeed, the same process the ``gpu_cluster``
resource launches; forked from a warm Python, as `make run`'s workers are):

* ``base``: the MoE pretrained on a bin/idx corpus (``data_kind: pretrain_corpus``, the ``base_model`` stage);
* ``scratch``: SFT on nights 1+2 from random weights (``init_from: scratch``);
* ``base-sft``: the same SFT from the base (``init_from: base``);
* ``continual``: night 1's SFT from the base, then night 2 (nights 1+2, as ``sft_dataset`` holds every sample so
  far) from night 1's model (``init_from: production``).

The data is the text that ships with Python (``pydoc_data.topics``, the demo's sample corpus). Each topic is one
document; a hash of its title puts it on the eval side, the SFT side of night 1 or of night 2. Eval topics never
enter the pretraining corpus nor any SFT set. An SFT sample asks about a topic and the answer is the topic's text
(the first ``max_chars_per_doc`` characters): a teacher that quotes the reference, since the tiny demo's own
teacher is a random model. Every model is scored on the same eval conversations (assistant tokens only): each
model's mean loss with a 95% bootstrap interval over examples, and the paired differences
(``core/evaluation/paired.py``: examples resampled with both models' values together). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# bench/packaging.py would shadow the ``packaging`` library that transformers imports: run from the repository root
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from nexa_dagster import settings  # noqa: E402
from nexa_dagster.core.cluster import warm_python  # noqa: E402
from nexa_dagster.core.common.artifacts import COMPLETION_MARKER  # noqa: E402
from nexa_dagster.core.common.config import load_deepspeed_config, load_scale  # noqa: E402
from nexa_dagster.core.data.splits import is_validation  # noqa: E402
from nexa_dagster.core.evaluation.paired import bootstrap_mean_loss, paired_loss_difference  # noqa: E402
from nexa_dagster.core.packaging.formats.indexed_dataset import IndexedDatasetWriter, best_fitting_dtype  # noqa: E402
from nexa_dagster.core.packaging.packing import ChatTokenizer, conversation, pack_table  # noqa: E402
from nexa_dagster.core.tiny.model import build_tiny_causal_lm  # noqa: E402
from nexa_dagster.core.training.job import TrainingJob, TrainingResult  # noqa: E402
from nexa_dagster.resources.gpu_cluster.local import WARM_PRELOAD  # noqa: E402

LOG = logging.getLogger("learning")  # on stderr: stdout's last line is the JSON object

EVAL_FRACTION = 0.2
SPLIT_SEED = 11


def topics() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics as all_topics

    return [(k, all_topics[k]) for k in sorted(all_topics)]


def side(title: str) -> str:
    """eval / night1 / night2, by a hash of the topic's title (stable whatever else is added)."""
    if is_validation(title, EVAL_FRACTION, SPLIT_SEED):
        return "eval"
    return "night1" if int(hashlib.sha256(title.encode()).hexdigest()[:8], 16) % 2 == 0 else "night2"


Example = tuple[
    np.ndarray, np.ndarray
]  # (input_ids, loss_mask) of one conversation, as the packer tokenizes it


def sft_examples(
    chat: ChatTokenizer, docs: list[tuple[str, str]], max_chars: int, pack_size: int
) -> list[Example]:
    conversations = [
        conversation("", f"Explain the Python topic '{title}'.", text.strip()[:max_chars])
        for title, text in docs
    ]
    return [(ids[:pack_size], mask[:pack_size]) for ids, mask in chat.encode_conversations(conversations)]


def write_packed(examples: list[Example], path: Path, pack_size: int, pad_id: int) -> str:
    import pyarrow.parquet as pq

    table, _ = pack_table(examples, pack_size, pad_id)
    pq.write_table(table, path)
    return str(path)


def write_corpus(tokenizer, docs: list[tuple[str, str]], root: Path) -> str:
    prefix = str(root / "shards" / "00000")
    with IndexedDatasetWriter(prefix, best_fitting_dtype(len(tokenizer))) as writer:
        for _, text in docs:
            writer.add_document(
                np.asarray(
                    tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id],
                    dtype=writer.dtype,
                )
            )
    (root / "megatron_blend.json").write_text(json.dumps({"data_paths": [writer.num_tokens, prefix]}))
    return str(root)


# the training workers forked from a warm Python (``core/cluster/warm_python.py``, as `make run`'s): torch,
# transformers and DeepSpeed imported once, not by each of the five trainings (~5 s each on the 2-core machine); a
# worker that could not be the process a cold start is starts cold (said on stderr). Their environment is the one the
# project gives a child (``settings.environ``, as the local backend's workers), not this process's: what this
# bench's own imports added (MLflow's telemetry id) would differ from the warm Python's.
WORKERS = warm_python.WorkerStarter(sys.executable, settings.environ(), LOG, WARM_PRELOAD)


def train(job: TrainingJob, work: Path) -> TrainingResult:
    """Train ``job`` in the project's worker process; a checkpoint already complete in ``--work`` (a rerun) is
    reused as it is."""
    summary = Path(job.output_dir) / "training_summary.json"
    if (Path(job.output_dir) / COMPLETION_MARKER).exists() and summary.exists():
        result = TrainingResult.model_validate_json(summary.read_text())
        print(f"reused  {job.run_id:10s} from {job.parent:22s} (complete in {job.output_dir})", flush=True)
        return result
    job_file = work / f"{job.run_id}.json"
    job_file.write_text(job.model_dump_json())
    start = time.perf_counter()
    log = work / f"{job.run_id}.log"
    command = [sys.executable, "-m", "nexa_dagster.core.training.worker", "--job", str(job_file)]
    if WORKERS.launch(command, os.getcwd(), log).wait() != 0:
        raise SystemExit(f"training {job.run_id} failed:\n{log.read_text(errors='replace')[-6000:]}")
    result = TrainingResult.model_validate_json((Path(job.output_dir) / "training_summary.json").read_text())
    print(
        f"trained {job.run_id:10s} from {job.parent:22s} {job.settings.max_steps:4d} steps, loss "
        f"{result.first_loss:.3f} -> {result.final_loss:.3f}, validation {result.validation_loss:.3f} "
        f"({time.perf_counter() - start:.0f} s)",
        flush=True,
    )
    return result


@torch.no_grad()
def per_example_nll(model_dir: str, examples: list[Example]) -> tuple[list[float], list[int]]:
    """Summed NLL of each example's assistant tokens (each predicted from what precedes it) and their count."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    nll, tokens = [], []
    for input_ids, loss_mask in examples:
        ids = torch.tensor(input_ids, dtype=torch.long)[None]
        logits = model(input_ids=ids).logits[0, :-1].float()
        targets = ids[0, 1:]
        learn = torch.tensor(loss_mask[1:], dtype=torch.bool)
        losses = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
        nll.append(float(losses[learn].sum()))
        tokens.append(int(learn.sum()))
    return nll, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="", help="working directory (default: a temporary one)")
    parser.add_argument(
        "--pretrain-steps", type=int, default=0, help="default: the tiny preset's pretraining"
    )
    parser.add_argument(
        "--sft-steps", type=int, default=0, help="default: the tiny preset's training.max_steps"
    )
    parser.add_argument("--resamples", type=int, default=5000)
    args = parser.parse_args()
    t0 = time.perf_counter()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    WORKERS.start()  # it imports while the data is prepared; the first training waits for it
    work = Path(args.work or tempfile.mkdtemp(prefix="nexa-learning-"))
    work.mkdir(parents=True, exist_ok=True)
    scale = load_scale("tiny")
    assert scale.pretraining is not None
    pretrain_settings = scale.pretraining.settings(scale.training)
    sft_settings = scale.training
    if args.pretrain_steps:
        pretrain_settings = pretrain_settings.model_copy(update={"max_steps": args.pretrain_steps})
    if args.sft_steps:
        sft_settings = sft_settings.model_copy(update={"max_steps": args.sft_steps})

    from transformers import AutoTokenizer

    tokenizer_dir = build_tiny_causal_lm(
        work / "tiny-tokenizer"
    )  # the demo's tokenizer (+ an unused random model)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    docs = topics()
    sides = {title: side(title) for title, _ in docs}
    by_side = {s: [d for d in docs if sides[d[0]] == s] for s in ("eval", "night1", "night2")}
    print(
        f"{len(docs)} Python documentation topics: {', '.join(f'{len(v)} {k}' for k, v in by_side.items())}; "
        f"machine: {platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}",
        flush=True,
    )
    pack_size, pad = scale.pack_size, tokenizer.pad_token_id
    chat = ChatTokenizer.from_hf(tokenizer, str(work / "tokenizer.json"))
    examples = {s: sft_examples(chat, v, scale.max_chars_per_doc, pack_size) for s, v in by_side.items()}
    eval_path = write_packed(examples["eval"], work / "eval.parquet", pack_size, pad)
    night1 = write_packed(examples["night1"], work / "night1.parquet", pack_size, pad)
    nights12 = write_packed(
        examples["night1"] + examples["night2"], work / "nights12.parquet", pack_size, pad
    )
    corpus = write_corpus(tokenizer, by_side["night1"] + by_side["night2"], work / "corpus")

    def job(run_id: str, train_path: str, settings, **extra) -> TrainingJob:
        return TrainingJob(
            run_id=run_id,
            train_path=train_path,
            validation_path=eval_path,
            tokenizer_path=str(tokenizer_dir),
            model_preset=scale.model_preset,
            deepspeed_config=load_deepspeed_config(scale.deepspeed_config),
            settings=settings,
            output_dir=str(work / "checkpoints" / run_id),
            accelerator="cpu",
            **extra,
        )

    base = job(
        "base",
        corpus,
        pretrain_settings,
        data_kind="pretrain_corpus",
        pack_size=pack_size,
        heldout_fraction=scale.pretraining.heldout_fraction,
    )
    base_result = train(base, work)
    print(
        f"base: held-out corpus loss {base_result.validation_loss:.3f} over {base_result.validation_documents} "
        "documents",
        flush=True,
    )
    runs = {
        "scratch": job("scratch", nights12, sft_settings),
        "base-sft": job("base-sft", nights12, sft_settings, init_from=base.output_dir, parent="base:base"),
        "night1": job("night1", night1, sft_settings, init_from=base.output_dir, parent="base:base"),
    }
    with ThreadPoolExecutor(max_workers=len(runs)) as pool:  # independent trainings, one process each
        list(pool.map(lambda run: train(run, work), runs.values()))
    runs["continual"] = job(
        "continual", nights12, sft_settings, init_from=runs["night1"].output_dir, parent="production:night1"
    )
    train(runs["continual"], work)
    WORKERS.close()

    scores = {
        name: per_example_nll(runs[name].output_dir, examples["eval"])
        for name in ("scratch", "base-sft", "continual")
    }
    tokens = scores["scratch"][1]
    print(
        f"\neval set: {len(tokens)} held-out conversations, {sum(tokens)} assistant tokens, "
        f"{args.resamples} bootstrap resamples, 95% intervals"
    )
    losses = {}
    for name, (nll, tok) in scores.items():
        interval = bootstrap_mean_loss(nll, tok, resamples=args.resamples)
        losses[name] = interval
        print(f"  {name:10s} loss {interval.estimate:.4f}  [{interval.low:.4f}, {interval.high:.4f}]")
    pairs = {}
    for a, b in (("base-sft", "scratch"), ("continual", "scratch"), ("continual", "base-sft")):
        diff = paired_loss_difference(scores[a][0], scores[b][0], tokens, resamples=args.resamples).difference
        pairs[(a, b)] = diff
        verdict = "excludes 0" if diff.excludes(0.0) else "includes 0"
        print(f"  {a} - {b}: {diff.estimate:+.4f}  [{diff.low:+.4f}, {diff.high:+.4f}]  ({verdict})")
    d = pairs[("base-sft", "scratch")]
    summary = {
        "scratch_loss": round(losses["scratch"].estimate, 5),
        "base_loss": round(losses["base-sft"].estimate, 5),
        "continual_loss": round(losses["continual"].estimate, 5),
        "scratch_ci": [round(losses["scratch"].low, 5), round(losses["scratch"].high, 5)],
        "base_ci": [round(losses["base-sft"].low, 5), round(losses["base-sft"].high, 5)],
        "continual_ci": [round(losses["continual"].low, 5), round(losses["continual"].high, 5)],
        "base_minus_scratch": round(d.estimate, 5),
        "base_minus_scratch_ci": [round(d.low, 5), round(d.high, 5)],
        "continual_minus_scratch": round(pairs[("continual", "scratch")].estimate, 5),
        "continual_minus_scratch_ci": [
            round(pairs[("continual", "scratch")].low, 5),
            round(pairs[("continual", "scratch")].high, 5),
        ],
        "continual_minus_base": round(pairs[("continual", "base-sft")].estimate, 5),
        "continual_minus_base_ci": [
            round(pairs[("continual", "base-sft")].low, 5),
            round(pairs[("continual", "base-sft")].high, 5),
        ],
        "base_heldout_corpus_loss": round(base_result.validation_loss, 5),
        "eval_examples": len(tokens),
        "eval_tokens": int(sum(tokens)),
        "pretrain_steps": pretrain_settings.max_steps,
        "sft_steps": sft_settings.max_steps,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
