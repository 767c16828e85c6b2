"""Packaging benchmark: this project's sharded tokenize-and-pack vs. the Hugging Face ``datasets`` baseline.

Run (from the repo root)::

    .venv/bin/python bench/packaging.py --mb 200 --procs 2 --pack-size 4096

It generates (once, cached in ``--workdir``) a JSONL corpus of at least ``--mb`` MB of chat conversations
(``{"sample_id", "messages"}``; text cut from the CPython documentation that ships with Python, prompt and answer
lengths drawn log-normally), trains the project's tiny BPE tokenizer, then runs in separate processes:

* **ours**: ``package_sft`` (plan, ``--procs`` spawned workers, per-message chat tokenization, best-fit-decreasing
  packing to ``--pack-size``, packed Parquet + receipts, shards concatenated);
* **baseline**: what a user would write with ``datasets``: ``load_dataset("json")``, ``map(batched=True,
  num_proc=--procs)`` rendering the chat template and tokenizing (prompt-prefix loss mask), padding/truncating each
  conversation to ``--pack-size`` (no packing), ``to_parquet``.

Both count the real (non-padding) tokens they emit and are timed from reading the JSONL to a Parquet file on disk.
Peak memory is the largest summed RSS of the side's process tree (sampled every 50 ms). Every process is
single-threaded in the tokenizer (``TOKENIZERS_PARALLELISM=false``) so both sides use the same number of cores.
The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# this file is named like the `packaging` distribution that transformers imports: keep its folder off the path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


class PeakRSS:
    """Largest summed RSS of this process and all its descendants, sampled on a background thread."""

    def __init__(self, interval: float = 0.05) -> None:
        import psutil

        self._proc = psutil.Process()
        self._interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        import psutil

        total = 0
        for p in [self._proc, *self._proc.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):  # a worker that exited between listing and reading
                total += p.memory_info().rss
        self.peak = max(self.peak, total)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self._interval)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


# -- corpus --------------------------------------------------------------------------------------------------------


def generate_corpus(path: Path, megabytes: float, seed: int = 0) -> dict[str, Any]:
    """Write chat records until their text reaches ``megabytes`` MB; returns counts."""
    from nexa_dagster.core.tiny.model import default_corpus

    text = "\n\n".join(default_corpus())
    rng = random.Random(seed)
    target = int(megabytes * 1_000_000)
    chars = rows = 0
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        while chars < target:
            q_len = min(int(rng.lognormvariate(math.log(400), 0.8)), 6000)
            a_len = min(int(rng.lognormvariate(math.log(2500), 0.9)), 30000)
            qs, as_ = rng.randrange(len(text) - q_len), rng.randrange(len(text) - a_len)
            messages = [
                {"role": "user", "content": text[qs : qs + q_len]},
                {"role": "assistant", "content": text[as_ : as_ + a_len]},
            ]
            if rng.random() < 0.3:
                messages.insert(0, {"role": "system", "content": "You are a concise Python expert."})
            f.write(json.dumps({"sample_id": f"b{rows:08d}", "messages": messages}) + "\n")
            chars += q_len + a_len
            rows += 1
    tmp.replace(path)
    return {"rows": rows, "text_chars": chars, "bytes": path.stat().st_size}


def prepare(workdir: Path, megabytes: float) -> tuple[Path, Path, dict[str, Any]]:
    corpus = workdir / f"corpus-{megabytes:g}mb.jsonl"
    meta_path = corpus.with_suffix(".json")
    if not corpus.exists() or not meta_path.exists():
        t = time.perf_counter()
        meta = generate_corpus(corpus, megabytes)
        meta["generate_s"] = round(time.perf_counter() - t, 1)
        meta_path.write_text(json.dumps(meta))
    meta = json.loads(meta_path.read_text())
    tok_dir = workdir / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        from nexa_dagster.core.tiny.model import build_tokenizer, default_corpus

        build_tokenizer(default_corpus()).save_pretrained(str(tok_dir))
    return corpus, tok_dir, meta


# -- the two sides -------------------------------------------------------------------------------------------------


def run_ours(corpus: Path, tok_dir: Path, out: Path, procs: int, pack_size: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from nexa_dagster.core.packaging.blend import BlendSource, DataBlend
    from nexa_dagster.core.packaging.sft_dataset import PackagingSettings, package_sft

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    blend = DataBlend(name="bench", sources=[BlendSource(name="corpus", path=str(corpus))])
    settings = PackagingSettings(
        pack_size=pack_size,
        validation_fraction=0.01,
        seed=0,
        rows_per_shard=4000,
        workers=procs,
        write_jsonl=False,
    )
    t = time.perf_counter()
    run = package_sft(blend, tok, str(out), settings, log=lambda m: print(f"  [ours] {m}", flush=True))
    seconds = time.perf_counter() - t
    real = sum(s.real_tokens for s in run.stats.values())
    return {
        "seconds": seconds,
        "tokens": real,
        "rows": run.rows_read,
        "sequences": sum(s.sequences for s in run.stats.values()),
        "packing_efficiency": run.packing_efficiency,
        "shards": run.num_shards,
        "truncated": sum(s.truncated_documents for s in run.stats.values()),
    }


def _baseline_batch(batch: dict[str, list], tokenizer: Any, pack_size: int, pad_id: int) -> dict[str, list]:
    """What a user writes: render the template, tokenize, mask the prompt prefix, pad/truncate to pack_size."""
    full = [tokenizer.apply_chat_template(m, tokenize=False) for m in batch["messages"]]
    prompts = [
        tokenizer.apply_chat_template(m[:-1], tokenize=False, add_generation_prompt=True)
        for m in batch["messages"]
    ]
    full_ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    out: dict[str, list] = {"input_ids": [], "loss_mask": [], "attention_mask": [], "num_tokens": []}
    for ids, p in zip(full_ids, prompt_ids, strict=True):
        ids = ids[:pack_size]
        n = len(ids)
        start = min(len(p), n)
        pad = pack_size - n
        out["input_ids"].append(ids + [pad_id] * pad)
        out["loss_mask"].append([0] * start + [1] * (n - start) + [0] * pad)
        out["attention_mask"].append([1] * n + [0] * pad)
        out["num_tokens"].append(n)
    return out


def run_baseline(corpus: Path, tok_dir: Path, out: Path, procs: int, pack_size: int) -> dict[str, Any]:
    import datasets
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    cache = out / "hf-cache"
    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "loss_mask": datasets.Sequence(datasets.Value("int8")),
            "attention_mask": datasets.Sequence(datasets.Value("int8")),
            "num_tokens": datasets.Value("int64"),
        }
    )
    t = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=str(corpus), split="train", cache_dir=str(cache))
    mapped = ds.map(
        _baseline_batch,
        batched=True,
        batch_size=1000,
        num_proc=procs,
        remove_columns=ds.column_names,
        features=features,
        fn_kwargs={"tokenizer": tok, "pack_size": pack_size, "pad_id": tok.pad_token_id},
        desc="baseline",
    )
    mapped.to_parquet(str(out / "baseline.parquet"))
    seconds = time.perf_counter() - t
    real = int(sum(mapped["num_tokens"]))
    return {
        "seconds": seconds,
        "tokens": real,
        "rows": len(ds),
        "sequences": len(mapped),
        "packing_efficiency": real / (len(mapped) * pack_size),
    }


def side_main(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fn = run_ours if args.side == "ours" else run_baseline
    with PeakRSS() as rss:
        result = fn(Path(args.corpus), Path(args.tokenizer), out, args.procs, args.pack_size)
    result["peak_rss_mb"] = rss.peak / 2**20
    print(json.dumps(result))


def run_side(
    side: str, corpus: Path, tok_dir: Path, workdir: Path, procs: int, pack_size: int
) -> dict[str, Any]:
    out = workdir / f"out-{side}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable,
        __file__,
        "--side",
        side,
        "--corpus",
        str(corpus),
        "--tokenizer",
        str(tok_dir),
        "--out",
        str(out),
        "--procs",
        str(procs),
        "--pack-size",
        str(pack_size),
    ]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    lines = proc.stdout.strip().splitlines()
    for line in lines[:-1]:
        print(line)
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{side} side failed with exit code {proc.returncode}")
    shutil.rmtree(out, ignore_errors=True)
    return json.loads(lines[-1])


def sample_data_efficiency(tok_dir: Path, workdir: Path, pack_size: int) -> float:
    """Packing efficiency on the shipped sample documents (prompt = first half, answer = second half)."""
    from transformers import AutoTokenizer

    from nexa_dagster.core.common.config import REPO_ROOT
    from nexa_dagster.core.data.ingest import ingest_day
    from nexa_dagster.core.packaging.blend import BlendSource, DataBlend
    from nexa_dagster.core.packaging.sft_dataset import PackagingSettings, package_sft

    path = workdir / "sample_data.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for day_dir in sorted((REPO_ROOT / "sample_data" / "landing").iterdir()):
            for d in ingest_day(day_dir, day_dir.name, max_docs=None, max_chars=pack_size * 3).itertuples():
                half = len(d.text) // 2
                f.write(
                    json.dumps(
                        {
                            "sample_id": d.doc_id,
                            "messages": [
                                {"role": "user", "content": d.text[:half]},
                                {"role": "assistant", "content": d.text[half:]},
                            ],
                        }
                    )
                    + "\n"
                )
    run = package_sft(
        DataBlend(name="sample", sources=[BlendSource(name="sample", path=str(path))]),
        AutoTokenizer.from_pretrained(str(tok_dir)),
        str(workdir / "out-sample"),
        PackagingSettings(pack_size, 0.0001, write_jsonl=False),
        log=lambda m: None,
    )
    shutil.rmtree(workdir / "out-sample", ignore_errors=True)
    return run.stats["train"].efficiency


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--mb", type=float, default=200.0, help="corpus size in MB of text (>= 200 for the figure)"
    )
    parser.add_argument("--procs", type=int, default=os.cpu_count() or 1, help="processes for both sides")
    parser.add_argument("--pack-size", type=int, default=4096)
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "nexa-bench-packaging"))
    parser.add_argument("--side", choices=["ours", "baseline"], help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        side_main(args)
        return
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    corpus, tok_dir, meta = prepare(workdir, args.mb)
    print(
        f"corpus: {corpus} ({meta['bytes'] / 1e6:.0f} MB JSONL, {meta['text_chars'] / 1e6:.0f} MB of text, "
        f"{meta['rows']} conversations); pack size {args.pack_size}; {args.procs} processes per side",
        flush=True,
    )
    ours = run_side("ours", corpus, tok_dir, workdir, args.procs, args.pack_size)
    base = run_side("baseline", corpus, tok_dir, workdir, args.procs, args.pack_size)
    sample_eff = sample_data_efficiency(tok_dir, workdir, args.pack_size)
    figures = {
        "tokens_per_s": round(ours["tokens"] / ours["seconds"]),
        "baseline_tokens_per_s": round(base["tokens"] / base["seconds"]),
        "speedup": round((ours["tokens"] / ours["seconds"]) / (base["tokens"] / base["seconds"]), 2),
        "packing_efficiency": round(ours["packing_efficiency"], 4),
        "baseline_packing_efficiency": round(base["packing_efficiency"], 4),
        "sample_data_packing_efficiency": round(sample_eff, 4),
        "peak_rss_mb": round(ours["peak_rss_mb"]),
        "baseline_peak_rss_mb": round(base["peak_rss_mb"]),
        "seconds": round(ours["seconds"], 1),
        "baseline_seconds": round(base["seconds"], 1),
        "tokens": ours["tokens"],
        "baseline_tokens": base["tokens"],
        "sequences": ours["sequences"],
        "baseline_sequences": base["sequences"],
        "conversations": meta["rows"],
        "corpus_text_mb": round(meta["text_chars"] / 1e6, 1),
        "shards": ours["shards"],
        "procs": args.procs,
        "pack_size": args.pack_size,
    }
    width = max(map(len, figures))
    for k, v in figures.items():
        print(f"{k:>{width}}: {v}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
