"""Evaluation of a checkpoint from a notebook, no Dagster: held-out loss, judged answers, win rate, progress."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pandas as pd

from nexa_dagster.core.config import read_text
from nexa_dagster.core.evaluation import evaluate_checkpoint
from nexa_dagster.core.llm.local import LocalTransformersClient
from nexa_dagster.core.sft_dataset import build_sft_dataset

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def test_a_checkpoint_is_evaluated_against_itself(tiny_model_dir: Path, tiny_tokenizer, tmp_path: Path) -> None:
    """The tiny model as student, judge and 'production': a finite loss over the validation split's loss tokens,
    one judged answer per prompt, and a win rate of exactly 0.5 against an identical model (each pair is judged in
    both orders, so a judge's position bias cancels)."""
    n = 24
    samples = pd.DataFrame({"sample_id": [f"id{i:03d}" for i in range(n)], "day": ["2026-11-20"] * n,
                            "system_prompt": ["Be brief."] * n, "prompt": [f"What is {i} + 1?" for i in range(n)],
                            "response": [f"It is {i + 1}." for i in range(n)]})
    dataset, _ = build_sft_dataset(samples, tiny_tokenizer, str(tiny_model_dir), str(tmp_path), 128, 0.2,
                                   log=lambda m: None)
    lines: list[str] = []
    prompts = ["What is a tuple?", "Name a prime number."]
    with LocalTransformersClient(str(tiny_model_dir)) as judge:
        evaluation = evaluate_checkpoint("ckpt-test", str(tiny_model_dir), dataset.validation_path, prompts, judge,
                                         read_text("prompts/judge.jinja"), max_new_tokens=8,
                                         production_path=str(tiny_model_dir), log=lines.append)
    loss = evaluation.result.loss
    assert math.isfinite(loss.loss) and loss.perplexity > 1 and loss.tokens > 0
    assert loss.sequences == dataset.num_validation_sequences
    assert [a.prompt for a in evaluation.result.answers] == prompts
    assert evaluation.win_rate_vs_production == 0.5
    assert any(line.startswith("ckpt-test: validation sequences scored: ") for line in lines), lines
    assert any(line.startswith("ckpt-test: held-out answers judged: 2/2 ") for line in lines), lines
