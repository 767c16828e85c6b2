"""Evaluation of a checkpoint: held-out loss and perplexity, and the judge's score of its answers.

Loss is the mean next-token negative log-likelihood over the validation split's assistant tokens (the loss mask),
exactly what training optimises, so the two are comparable. The judge uses the same scoring as SampleGate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nexa_dagster.core import storage
from nexa_dagster.core.config import read_text
from nexa_dagster.core.judge import Judge
from nexa_dagster.core.llm.base import ChatMessage, LLMClient, SamplingParams
from nexa_dagster.core.sample_gate import load_gate_config


@dataclass
class HeldoutLoss:
    loss: float
    perplexity: float
    tokens: int
    sequences: int


def heldout_loss(model_dir: str | Path, validation_path: str, batch_size: int = 8,
                 progress: Callable[[int, int], None] | None = None) -> HeldoutLoss:
    """Mean NLL of the model on the loss-masked tokens of the packed validation split.

    ``progress(sequences_done, total)`` is called after every batch (a `core.progress.Progress` logs it).
    """
    import torch
    from transformers import AutoModelForCausalLM

    frame = storage.read_parquet(validation_path)
    if frame.empty:
        raise ValueError(f"validation split {validation_path} is empty")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    total_nll, total_tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(frame), batch_size):
            chunk = frame.iloc[start:start + batch_size]
            ids = torch.from_numpy(np.stack(chunk["input_ids"].to_numpy())).long()
            mask = torch.from_numpy(np.stack(chunk["loss_mask"].to_numpy())).long()
            positions = torch.from_numpy(np.stack(chunk["position_ids"].to_numpy())).long()
            logits = model(input_ids=ids, position_ids=positions).logits
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            target = ids[:, 1:]
            nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
            m = mask[:, 1:].float()
            total_nll += float((nll * m).sum())
            total_tokens += int(m.sum())
            if progress:
                progress(min(start + batch_size, len(frame)), len(frame))
    if total_tokens == 0:
        raise ValueError(f"validation split {validation_path} has no loss-masked tokens")
    loss = total_nll / total_tokens
    return HeldoutLoss(loss, math.exp(min(loss, 50.0)), total_tokens, len(frame))


@dataclass
class JudgedAnswer:
    prompt: str
    answer: str
    score: float | None
    method: str


@dataclass
class EvalResult:
    checkpoint_id: str
    loss: HeldoutLoss
    answers: list[JudgedAnswer] = field(default_factory=list)

    @property
    def judge_score(self) -> float | None:
        scores = [a.score for a in self.answers if a.score is not None]
        return sum(scores) / len(scores) if scores else None


def judge_answers(student: LLMClient, judge: LLMClient, prompts: Sequence[str], judge_template: str,
                  max_new_tokens: int, log: Callable[[str], None] = print,
                  progress: Callable[[int, int], None] | None = None) -> list[JudgedAnswer]:
    """The student answers every prompt (one batched call), then the judge scores each answer with SampleGate's
    judge settings (``configs/filters.yaml``: method, max_tokens, retries);
    ``progress(judged, total)`` follows the judging, the slow part with a remote judge."""
    conversations: list[list[ChatMessage]] = [[{"role": "user", "content": p}] for p in prompts]
    completions = student.chat_many(conversations, SamplingParams(max_tokens=max_new_tokens, temperature=0.0))
    settings = load_gate_config().judge  # the same judge settings as SampleGate (configs/filters.yaml)
    scorer = Judge(judge, judge_template, read_text("prompts/judge_verdict.jinja"), settings.max_tokens,
                   settings.method, settings.retries)
    out = []
    for prompt, c in zip(prompts, completions, strict=True):
        verdict = scorer.judge(prompt, c.text)
        out.append(JudgedAnswer(prompt, c.text, verdict.score, verdict.method))
        if progress:
            progress(len(out), len(prompts))
    log(f"judged {len(out)} held-out answers")
    return out


def render_markdown(result: EvalResult, lineage: dict[str, Any]) -> str:
    judge = f"{result.judge_score:.3f}" if result.judge_score is not None else "n/a"
    lines = [
        f"# Evaluation of checkpoint `{result.checkpoint_id}`",
        "",
        "| metric | value |",
        "|---|---|",
        f"| validation loss (assistant tokens) | {result.loss.loss:.4f} |",
        f"| perplexity | {result.loss.perplexity:.2f} |",
        f"| validation tokens | {result.loss.tokens} |",
        f"| judge score (1-5, mean) | {judge} |",
        "",
        "## Lineage",
        "",
        *[f"- **{k}**: `{v}`" for k, v in lineage.items()],
        "",
        "## Held-out answers",
        "",
    ]
    for a in result.answers:
        score = f"{a.score:.2f}" if a.score is not None else "no verdict"
        answer = a.answer.replace("\n", " ")[:300]
        lines += [f"**Q:** {a.prompt}", "", f"**A:** {answer}", "", f"*judge ({a.method}):* {score}", ""]
    return "\n".join(lines)


def write_report(result: EvalResult, lineage: dict[str, Any], report_dir: str) -> tuple[str, str]:
    """Write ``report.json`` and ``report.md`` (atomically) and return their paths."""
    payload = {
        "checkpoint_id": result.checkpoint_id,
        "validation_loss": result.loss.loss,
        "perplexity": result.loss.perplexity,
        "validation_tokens": result.loss.tokens,
        "validation_sequences": result.loss.sequences,
        "judge_score": result.judge_score,
        "answers": [a.__dict__ for a in result.answers],
        "lineage": lineage,
    }
    json_path = storage.join(report_dir, "report.json")
    md_path = storage.join(report_dir, "report.md")
    storage.write_json(payload, json_path)
    storage.write_text(render_markdown(result, lineage), md_path)
    return json_path, md_path


PAIRWISE_TEMPLATE = """You compare two answers to the same question. Reply with the letter of the better answer only.

QUESTION:
{question}

ANSWER A:
{a}

ANSWER B:
{b}

Better answer (A or B):"""


def pairwise_win_rate(judge: LLMClient, prompts: Sequence[str], candidate: Sequence[str],
                      production: Sequence[str]) -> float:
    """Share of prompts on which the judge prefers the candidate's answer over production's.

    Each pair is judged twice with the positions swapped (judges favour a position) and the two preferences are
    averaged; with log-probabilities the preference is P(candidate) rather than a hard vote.
    """
    wins = 0.0
    for q, cand, prod in zip(prompts, candidate, production, strict=True):
        for cand_is_a in (True, False):
            a, b = (cand, prod) if cand_is_a else (prod, cand)
            msgs: list[ChatMessage] = [{"role": "user", "content": PAIRWISE_TEMPLATE.format(question=q, a=a, b=b)}]
            if judge.capabilities().logprobs:
                lp = judge.choice_logprobs(msgs, ("A", "B"))
                p_a = math.exp(lp["A"]) / (math.exp(lp["A"]) + math.exp(lp["B"]))
            else:
                text = judge.chat(msgs, SamplingParams(max_tokens=4, temperature=0.0)).text.strip().upper()
                p_a = 1.0 if text.startswith("A") else 0.0 if text.startswith("B") else 0.5
            wins += p_a if cand_is_a else 1.0 - p_a
    return wins / (2 * len(prompts)) if prompts else 0.5


@dataclass
class CheckpointEvaluation:
    """Everything measured about one checkpoint: what the report, MLflow and the promotion gate are built from."""

    result: EvalResult
    win_rate_vs_production: float | None = None


def evaluate_checkpoint(checkpoint_id: str, checkpoint_path: str, validation_path: str, prompts: Sequence[str],
                        judge: LLMClient, judge_template: str, max_new_tokens: int,
                        production_path: str | None = None, log: Callable[[str], None] = print,
                        batch_size: int = 16) -> CheckpointEvaluation:
    """Held-out loss, the judge's scores of the checkpoint's answers and, given a production model's directory,
    the pairwise win rate against it. Both models run in-process (they are ours); the judge is any endpoint.
    Progress of the scoring and the judging goes to ``log`` on a clock (``core.progress``)."""
    from nexa_dagster.core.llm.local import LocalTransformersClient
    from nexa_dagster.core.progress import Progress

    with Progress(log, f"{checkpoint_id}: validation sequences scored") as progress:
        loss = heldout_loss(checkpoint_path, validation_path, progress=progress)
    log(f"{checkpoint_id}: validation loss {loss.loss:.4f} (ppl {loss.perplexity:.1f}) over {loss.tokens} tokens")
    with LocalTransformersClient(checkpoint_path, batch_size=batch_size) as student, \
            Progress(log, f"{checkpoint_id}: held-out answers judged") as progress:
        answers = judge_answers(student, judge, prompts, judge_template, max_new_tokens, log=log, progress=progress)
    evaluation = CheckpointEvaluation(EvalResult(checkpoint_id, loss, answers))
    if production_path is not None:
        with LocalTransformersClient(production_path, batch_size=batch_size) as production:
            params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
            production_answers = [c.text for c in production.chat_many(
                [[{"role": "user", "content": p}] for p in prompts], params)]
        evaluation.win_rate_vs_production = pairwise_win_rate(judge, prompts, [a.answer for a in answers],
                                                              production_answers)
        log(f"{checkpoint_id}: pairwise win rate vs production: {evaluation.win_rate_vs_production:.2f}")
    return evaluation
