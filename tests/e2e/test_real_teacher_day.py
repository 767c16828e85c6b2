"""A day of data with a real teacher and judge, and the real model as the student: SmolLM2-135M-Instruct
(``nexa-dagster real-model``) in place of the tiny model is a configuration change (``NEXA_SCALE=smollm2``,
``NEXA_TEACHER_MODEL``, ``NEXA_JUDGE_MODEL``; for the student ``model_preset: smollm2-upcycled``, ``init_from`` its
directory, ``models.student_tokenizer`` the same), and what comes out is what a person would check:

* the answers are about their prompt's document. Measured as the share of an answer's content words (4+ letters,
  not stop words) found in its own document, against the same share for each *other* document of the day: the
  other documents are a baseline measured on the same answers in the same run, so words every answer about
  Python shares ("function", "value") cancel out, and an answer that ignored its document (a generic or
  degenerate one) scores the same against all of them. Decided by a sign test: at least 7 of 8 answers closer to
  their own document (a coin would do that with probability 9/256 = 0.035);
* the judge's pass rate and score spread, read from the day's materialization and its judge_prefers_real_answers
  check and held against the stored tables: SmolLM2-135M's expected scores sit in a narrow band near the bottom
  (mean 1.47, std 0.06 when measured), so the demo's cut is lowered to 1 here: the answers are packaged whatever
  it says;
* whether the judge ranks the teacher's answers above the same answers' words shuffled: the asset check every
  judged day carries, whatever the judge (``core/distill/judge_validity.py``). SmolLM2-135M does not (measured:
  3 wins of 8, 0 of 8 on another run), and the check fails it; ``tests/integration/test_judge_stage.py`` shows
  the same check passing a judge that reads answers, through the same asset;
* ``training_job``'s ``moe_checkpoint`` upcycles SmolLM2 into the MoE and fine-tunes it on the day's packaged
  answers (tokenized with SmolLM2's tokenizer): three steps, finite and falling loss, a checkpoint plain
  transformers loads.

Eight documents, answers of at most 32 tokens: SmolLM2 generates ~15 tokens/s on a loaded 2-core CPU; a step of
the upcycled MoE (214M parameters) on the two 512-token rows the day packs into takes 25-50 s there.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any

import pandas as pd
from support.pipeline_runs import configs_with, run_jobs
from support.sandbox import make_sandbox

from nexa_dagster.core.llm.packaged_model import SMOLLM2, link_into

DAY = "2026-11-20"
DOCUMENTS = 8
TRAINING = ("eval_set", "sft_dataset", "moe_checkpoint")
SFT_STEPS = {"max_steps": 3, "micro_batch_size": 2, "learning_rate": 1e-4, "warmup_steps": 1, "log_every": 1}
STOP_WORDS = frozenset(
    [
        "this",
        "that",
        "with",
        "from",
        "have",
        "will",
        "your",
        "when",
        "which",
        "what",
        "their",
        "there",
        "these",
        "those",
        "them",
        "then",
        "than",
        "into",
        "also",
        "each",
        "more",
        "most",
        "other",
        "some",
        "such",
        "only",
        "over",
        "very",
        "just",
        "like",
        "about",
        "would",
        "could",
        "should",
        "been",
        "being",
        "were",
        "does",
    ]
)


def content_words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z_]{4,}", text.lower()) if w not in STOP_WORDS}


def overlap(answer: str, document: str) -> float:
    words = content_words(answer)
    return len(words & content_words(document)) / len(words) if words else 0.0


def test_a_day_with_smollm2_as_teacher_and_judge(tmp_path: Path, smollm2_dir: Path) -> None:
    root = make_sandbox(tmp_path / "sandbox", [DAY])
    model = link_into(smollm2_dir, root / "data" / "models" / SMOLLM2.name)
    env = {
        "NEXA_CONFIG_DIR": str(smollm2_configs(tmp_path / "configs", model)),
        "NEXA_SCALE": "smollm2",
        "NEXA_TEACHER_MODEL": str(model),
        "NEXA_JUDGE_MODEL": str(model),
    }
    started = time.monotonic()
    day, packaging = run_jobs(root, f"daily_data_job:{DAY}", f"training_job[{','.join(TRAINING)}]", **env)
    assert day["success"] and packaging["success"], day["errors"] + packaging["errors"]
    assert {"teacher_samples", "filtered_samples"} <= set(day["materialized"])
    assert set(TRAINING) <= set(packaging["materialized"])
    assets = root / "data" / "assets"
    closer = answers_are_about_their_documents(assets)
    judge = the_judge_as_measured(assets, day)
    losses = the_upcycled_sft(packaging, model)
    print(
        f"\nSmolLM2 day ({time.monotonic() - started:.0f} s): answers closer to their own document on "
        f"{closer}/{DOCUMENTS}; {judge}; upcycled SmolLM2 SFT losses {losses}"
    )


def smollm2_configs(out: Path, model: Path) -> Path:
    """The repository's configs with SmolLM2 as teacher and judge (``NEXA_SCALE=smollm2``) and as the student,
    upcycled: the data is tokenized with its tokenizer, ``moe_checkpoint`` starts from its directory with the
    ``smollm2-upcycled`` preset, for a few steps of a cheap size (on a loaded 2-core CPU a step of this 214M MoE
    on two 512-token rows takes tens of seconds)."""
    return configs_with(
        out,
        {
            "scales/smollm2.yaml": {
                "max_docs_per_day": DOCUMENTS,
                "teacher.max_new_tokens": 32,
                "model_preset": "smollm2-upcycled",
                "init_from": str(model),
                # every step the same two rows (the day's few training answers pack into about two): the loss
                # of one batch falls under gradient descent at a fine-tuning rate, whatever the answers say
                **{f"training.{key}": value for key, value in SFT_STEPS.items()},
            },
            # a handful of samples: at 0.3 the held-out side of the few that pass is often empty, which the eval
            # set refuses (it would gate nothing); half and half keeps both sides of the packaging fed
            "pipeline.yaml": {"eval_set.fraction": 0.5, "models.student_tokenizer": str(model)},
            # SmolLM2-135M as a logprobs judge scores in a narrow band about the demo's cut of 1.5 (1.39-1.56 on
            # these eight answers when measured): the cut would pass a coin flip's share. Everything the heuristics
            # keep is packaged here; the judge is measured (spread, validity check), not trusted
            "filters.yaml": {"judge.min_score": 1.0},
        },
    )


def answers_are_about_their_documents(assets: Path) -> int:
    """How many of the day's answers share more content words with their own document than with the others'
    (module docstring); at least 7 of 8."""
    samples = pd.read_parquet(assets / "teacher_samples" / f"{DAY}.parquet")
    documents = pd.read_parquet(assets / "raw_documents" / f"{DAY}.parquet").set_index("doc_id")["text"]
    assert len(samples) == DOCUMENTS and samples["error"].isna().all()
    own = [overlap(r.response, documents[r.doc_id]) for r in samples.itertuples()]
    others = [
        sum(overlap(r.response, text) for doc_id, text in documents.items() if doc_id != r.doc_id)
        / (len(documents) - 1)
        for r in samples.itertuples()
    ]
    closer = sum(o > b for o, b in zip(own, others, strict=True))
    assert closer >= 7, (own, others, samples["response"].tolist())
    return closer


def the_judge_as_measured(assets: Path, day: dict[str, Any]) -> str:
    """The judge's figures as the day's materialization and check report them, against the stored tables; and
    what was measured of SmolLM2-135M as a judge: a low, narrow band of scores, and real answers not ranked above
    their shuffled words (3 wins of 8 on 2026-12-01), so the validity check fails it. A judge that passes the same check through the
    same asset: ``tests/integration/test_judge_stage.py``."""
    kept = pd.read_parquet(assets / "filtered_samples" / f"{DAY}.parquet")
    judged = pd.concat([kept, pd.read_parquet(assets / "rejected_samples" / f"{DAY}.parquet")])
    scores = judged["judge_score"].dropna()
    pass_rate = day["metadata"]["filtered_samples"]["pass_rate"]
    validity = day["checks"]["judge_prefers_real_answers"]
    assert pass_rate == round(len(kept) / len(judged), 4) and len(kept) > 0, (pass_rate, len(kept))
    assert validity["judge_score_std"] == round(scores.std(), 3) and len(scores) >= 2, validity
    assert validity["judge_score_mean"] == round(scores.mean(), 3), validity
    # the grades of a weak judge: they differ (it does not answer one number) but stay in a narrow band near the
    # bottom of 1..5 (measured mean 1.47, std 0.06: every answer a "1 or 2")
    assert 0 < validity["judge_score_std"] < 0.3 and validity["judge_score_mean"] < 2.5, validity
    # every answer was ranked against its shuffled words, and the judge did not rank the real ones reliably higher:
    # passing needs 7 wins of 8 (p = 9/256); measured 3 of 8 (2026-12-01), 0 of 8 on 2026-11-28
    assert validity["pairs"] == DOCUMENTS and validity["decided"], validity
    assert not validity["passed"] and validity["p_value"] > 0.05, validity
    return (
        f"judge pass rate {pass_rate:.2f}, scores mean {validity['judge_score_mean']:.2f} std "
        f"{validity['judge_score_std']:.2f} (n={len(scores)}); vs shuffled answers {validity['wins']} wins "
        f"{validity['ties']} ties {validity['losses']} losses of {validity['pairs']}, p={validity['p_value']}"
    )


def the_upcycled_sft(packaging: dict[str, Any], model: Path) -> list[float]:
    """``moe_checkpoint`` upcycled SmolLM2 (the preset's 2 experts, top-1) and fine-tuned it on the day's data:
    finite losses, falling, and a Mixtral checkpoint that plain transformers loads."""
    meta = packaging["metadata"]["moe_checkpoint"]
    summary = json.loads((Path(meta["checkpoint_path"]) / "training_summary.json").read_text())
    losses = [round(loss, 4) for _, loss in summary["loss_curve"]]
    assert len(losses) == SFT_STEPS["max_steps"] and all(math.isfinite(v) for v in losses), losses
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses  # falling, step after step
    assert meta["parent"] == f"path:{model}", meta
    assert meta["parameters_total"] == 214_175_808 and meta["parameters_active"] == 134_549_568, meta
    assert packaging["checks"]["checkpoint_loads_with_transformers"]["passed"], packaging["checks"]
    return losses
