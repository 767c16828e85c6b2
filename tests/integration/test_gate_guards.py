"""A fine-tune that is better on most examples but breaks one slice is held back, on real models scored on a frozen
eval set: production is the tiny model trained on three days of answers; the candidate continues from it on the
same days with one day's answers' words shuffled (the negative control's transform, on that day only)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from support.tiny_training import train_steps

from nexa_dagster.core.data.splits import is_held_out
from nexa_dagster.core.evaluation.eval_set import eval_slices, freeze_eval_set, load_eval_set
from nexa_dagster.core.evaluation.paired import paired_loss_difference
from nexa_dagster.core.evaluation.promotion import ProductionEntry, PromotionPolicy, decide, eval_loss_guard
from nexa_dagster.core.evaluation.scoring import example_losses
from nexa_dagster.core.packaging.packing import ChatTokenizer, conversation
from nexa_dagster.core.packaging.transforms import shuffle_answer_words

FRACTION = 0.5
DAYS = ("2026-11-20", "2026-11-21", "2026-11-22")
BROKEN = DAYS[1]
WORDS = ["red", "green", "blue", "amber", "violet", "silver", "golden", "black"]


def _samples(per_day: int = 40) -> pd.DataFrame:
    """Three days of short answers, each day in a phrasing of its own (so a day is a slice a model can break)."""
    rows = []
    for d, day in enumerate(DAYS):
        for i in range(per_day):
            colour, other = WORDS[i % 8], WORDS[(i * 3 + d) % 8]
            prompt, response = [
                (f"What is {i} plus one?", f"The sum of {i} and one is {i + 1}, a number."),
                (f"Name the colour of box {i}.", f"Box number {i} is painted {colour} and {other} today."),
                (
                    f"Which word comes after {colour}?",
                    f"After the word {colour} comes the word {other} here.",
                ),
            ][d]
            rows.append(
                {
                    "sample_id": f"{day}-{i:03d}",
                    "day": day,
                    "system_prompt": "Be brief.",
                    "prompt": prompt,
                    "response": response,
                }
            )
    return pd.DataFrame(rows)


def _train(model_dir: Path, out: Path, conversations: list, tokenizer, root: Path, steps: int) -> Path:
    """``steps`` AdamW steps (one conversation each, in one seeded shuffled order, cycling: the days interleaved, so
    that no day is forgotten for being first) from ``model_dir``, saved to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    if out != model_dir:
        shutil.copytree(model_dir, out)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    chat = ChatTokenizer.from_hf(tokenizer, str(root / "tokenizer.json"))
    encoded = [(ids.tolist(), mask.tolist()) for ids, mask in chat.encode_conversations(conversations)]
    encoded = [encoded[i] for i in np.random.default_rng(0).permutation(len(encoded))]
    train_steps(model, encoded, steps)
    model.save_pretrained(str(out))
    return out


@pytest.mark.timeout(900)
def test_a_fine_tune_that_breaks_one_day_is_held_back_although_better_on_the_others(
    tiny_model_dir: Path, tiny_tokenizer, tmp_path: Path
) -> None:
    samples = _samples()
    freeze_eval_set(
        samples, tiny_tokenizer, str(tmp_path / "eval_sets"), 1, FRACTION, 128, log=lambda m: None
    )
    manifest = load_eval_set(str(tmp_path / "eval_sets"), 1)
    days = eval_slices(manifest, "day")
    assert manifest["examples"] >= 45 and all(days.count(d) >= 10 for d in DAYS), days
    train = [r for r in samples.itertuples() if not is_held_out(r.sample_id, FRACTION)]
    clean = [conversation(r.system_prompt, r.prompt, r.response) for r in train]
    production = _train(tiny_model_dir, tmp_path / "production", clean, tiny_tokenizer, tmp_path, 120)
    shuffle = shuffle_answer_words(seed=0)
    damaged = [
        shuffle({"messages": c})["messages"] if r.day == BROKEN else c
        for r, c in zip(train, clean, strict=True)
    ]
    candidate = _train(production, tmp_path / "candidate", damaged, tiny_tokenizer, tmp_path, 60)

    scores = {}
    for name, path in (("candidate", candidate), ("production", production)):
        from transformers import AutoModelForCausalLM

        scores[name] = example_losses(AutoModelForCausalLM.from_pretrained(str(path)), manifest["path"])
    (cand, tokens), (prod, _) = scores["candidate"], scores["production"]
    policy = PromotionPolicy()
    guard = eval_loss_guard(cand, prod, tokens, policy, days)
    by_day = {s.label: s for s in guard.slices}
    # better on most examples: the two days it trained on as they are got better, the shuffled one worse
    assert by_day[DAYS[0]].worse_by < 0 and by_day[DAYS[2]].worse_by < 0, by_day
    assert by_day[BROKEN].worse_by > 0 and by_day[BROKEN].significant, by_day
    assert not (by_day[DAYS[0]].significant or by_day[DAYS[2]].significant), by_day
    better = np.mean((np.asarray(cand) - np.asarray(prod)) < 0)
    assert better > 0.5, f"the candidate is better on {better:.0%} of the examples only"

    entry = ProductionEntry(checkpoint_id="production", checkpoint_path=str(production), metric="eval_loss")
    decision = decide("candidate", entry, policy, paired_loss_difference(cand, prod, tokens), guard=guard)
    assert decision.outcome == "hold back" and not decision.passed, decision.reason
    assert f"slice day={BROKEN} worse" in decision.reason and "Holm" in decision.reason, decision.reason
    meta = decision.metadata()
    assert any(r.startswith(f"slice day={BROKEN}") for r in meta["guard_reasons"]), meta
    # the hold-back is the slice guard's: without the slices the other guards find exactly what they found with
    # them (the same findings, in order), the broken day's finding is the one that goes, and the decision is no
    # longer a hold-back on a slice
    unsliced = decide(
        "candidate",
        entry,
        policy,
        paired_loss_difference(cand, prod, tokens),
        guard=eval_loss_guard(cand, prod, tokens, policy),
    )
    assert list(unsliced.guards) == [g for g in decision.guards if not g.startswith("slice ")], (
        unsliced.guards
    )
    assert len(unsliced.guards) < len(decision.guards) and f"day={BROKEN}" not in unsliced.reason
