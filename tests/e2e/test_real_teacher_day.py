"""A day of data with a real teacher and judge: SmolLM2-135M-Instruct (``nexa-dagster real-model``) in place of the
tiny model is a configuration change (``NEXA_SCALE=smollm2``, ``NEXA_TEACHER_MODEL``, ``NEXA_JUDGE_MODEL``), and
what comes out is what a person would check:

* the answers are about their prompt's document. Measured as the share of an answer's content words (4+ letters,
  not stop words) found in its own document, against the same share for each *other* document of the day: the
  other documents are a baseline measured on the same answers in the same run, so words every answer about
  Python shares ("function", "value") cancel out, and an answer that ignored its document (a generic or
  degenerate one) scores the same against all of them. Decided by a sign test: at least 7 of 8 answers closer to
  their own document (a coin would do that with probability 9/256 = 0.035);
* the judge's pass rate and score spread are reported (printed, and on the judge_prefers_real_answers check);
  SmolLM2-135M's expected scores sit in a narrow band (mean 1.47, std 0.06 when measured), so the demo's cut
  is lowered to 1 here: the answers are packaged whatever it says;
* whether the judge ranks the teacher's answers above the same answers' words shuffled: the asset check every
  judged day carries, whatever the judge (``core/distill/judge_validity.py``). SmolLM2-135M does not (measured:
  it prefers the shuffled words), and the check says so; ``tests/integration/test_judge_validity.py`` shows the
  check passing a judge that reads answers and failing one that does not.

Eight documents, answers of at most 32 tokens: SmolLM2 generates ~15 tokens/s on a loaded 2-core CPU.
"""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
from support.pipeline_runs import configs_with, run_jobs
from support.sandbox import make_sandbox

from nexa_dagster.core.llm.packaged_model import SMOLLM2, link_into

DAY = "2026-11-20"
DOCUMENTS = 8
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
    configs = configs_with(
        tmp_path / "configs",
        {
            "scales/smollm2.yaml": {"max_docs_per_day": DOCUMENTS, "teacher.max_new_tokens": 32},
            # a handful of samples: at 0.3 the held-out side of the few that pass is often empty, which the eval
            # set refuses (it would gate nothing); half and half keeps both sides of the packaging fed
            "pipeline.yaml": {"eval_set.fraction": 0.5},
            # SmolLM2-135M as a logprobs judge scores in a narrow band about the demo's cut of 1.5 (1.39-1.56 on
            # these eight answers when measured): the cut would pass a coin flip's share. Everything the heuristics
            # keep is packaged here; the judge is measured (spread, validity check), not trusted
            "filters.yaml": {"judge.min_score": 1.0},
        },
    )
    env = {
        "NEXA_CONFIG_DIR": str(configs),
        "NEXA_SCALE": "smollm2",
        "NEXA_TEACHER_MODEL": str(model),
        "NEXA_JUDGE_MODEL": str(model),
    }
    day, packaging = run_jobs(root, f"daily_data_job:{DAY}", "training_job[eval_set,sft_dataset]", **env)
    assert day["success"] and packaging["success"], day["errors"] + packaging["errors"]
    assert {"teacher_samples", "filtered_samples"} <= set(day["materialized"])
    assert "sft_dataset" in packaging["materialized"]

    assets = root / "data" / "assets"
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

    judged = pd.concat(
        pd.read_parquet(assets / name / f"{DAY}.parquet") for name in ("filtered_samples", "rejected_samples")
    )
    scores = judged["judge_score"].dropna()
    validity = day["checks"]["judge_prefers_real_answers"]
    print(
        f"\nSmolLM2 day: content-word overlap with the own document {sum(own) / len(own):.2f} vs the other "
        f"documents {sum(others) / len(others):.2f} (closer on {closer}/{len(own)}); judge pass rate "
        f"{len(pd.read_parquet(assets / 'filtered_samples' / f'{DAY}.parquet')) / len(judged):.2f}, scores "
        f"mean {scores.mean():.2f} std {scores.std():.2f} (n={len(scores)}); judge vs shuffled answers: "
        f"{validity['wins']} wins {validity['ties']} ties {validity['losses']} losses of {validity['pairs']}, "
        f"p={validity['p_value']}"
    )
    assert closer >= 7, (own, others, samples["response"].tolist())
    assert len(scores) >= 2 and scores.std() > 0  # the judge grades, it does not answer one number
    # the check decided on every answer, and its verdict is the sign test's. Measured (2026-11-28): SmolLM2-135M
    # as a logprobs judge scores the shuffled words *higher* than the real answer on 8 of 8 pairs, so the check
    # fails (a warning on the day): this judge does not read answers, and a lab would see it on the first day
    assert validity["pairs"] == DOCUMENTS and validity["decided"], validity
    assert validity["passed"] == (validity["p_value"] <= 0.05), validity
