"""Evaluation of a checkpoint on the frozen eval set, and of production on the same examples.

Loss is the mean next-token negative log-likelihood over the eval set's assistant tokens (the loss mask), exactly
what training optimises, kept *per example* so that the promotion gate can pair the candidate's and production's
values on each example (``core.paired``). The models run where a model can run: ``score_model`` is what the
evaluation worker (``core.evaluation_worker``, launched by the GPU-cluster resource) does for each model; the
judge, any endpoint, then scores the answers in the Dagster process (``judge_answers``, ``pairwise_verdicts``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nexa_dagster.core.common import storage
from nexa_dagster.core.common.config import read_text
from nexa_dagster.core.common.progress import Progress
from nexa_dagster.core.common.spans import span, span_line
from nexa_dagster.core.distill.judge import Judge
from nexa_dagster.core.distill.sample_gate import JudgeConfig, load_gate_config
from nexa_dagster.core.evaluation.benchmarks import markdown_table
from nexa_dagster.core.evaluation.paired import (
    DEFAULT_INTERVAL_METHOD,
    LengthControlled,
    PairedLoss,
    Verdict,
    WinRate,
    length_controlled_win_rate,
    order_consistent_win_rate,
    paired_loss_difference,
    pointwise_verdicts,
    pointwise_win_rate,
)
from nexa_dagster.core.llm.base import ChatMessage, LLMClient, SamplingParams
from nexa_dagster.core.llm.local import LocalTransformersClient


def perplexity_of(loss: float) -> float:
    """``e ** loss``, not capped: a diverged model shows its real perplexity (``inf`` only past float's range,
    a loss above ~709), where a silent cap at e^50 used to report the same number for every bad model."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


@dataclass
class HeldoutLoss:
    loss: float
    perplexity: float
    tokens: int
    sequences: int  # eval-set examples scored


@dataclass
class ModelScores:
    """What one model produced on the eval set: per-example summed NLL and scored tokens, and its answers."""

    nll: list[float]
    tokens: list[int]
    answers: list[str]
    benchmarks: dict[str, Any] | None = None  # core.benchmarks.run_benchmarks: lm-evaluation-harness scores
    # k sampled answers per prompt (``AnswerSampling``), for a reward estimated as pass@1 from k samples
    sampled_answers: list[list[str]] | None = None

    @property
    def loss(self) -> HeldoutLoss:
        total = sum(self.tokens)
        loss = sum(self.nll) / total
        return HeldoutLoss(loss, perplexity_of(loss), total, len(self.tokens))

    def to_json(self) -> dict[str, Any]:
        return {
            "nll": self.nll,
            "tokens": self.tokens,
            "answers": self.answers,
            "benchmarks": self.benchmarks,
            "sampled_answers": self.sampled_answers,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelScores:
        return cls(
            [float(v) for v in data["nll"]],
            [int(v) for v in data["tokens"]],
            list(data["answers"]),
            data.get("benchmarks"),
            data.get("sampled_answers"),
        )


def example_losses(
    model: Any,
    examples_path: str,
    batch_size: int = 8,
    device: str = "cpu",
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[float], list[int]]:
    """Summed NLL and count of the loss-masked tokens of every eval-set example, in the file's order.

    Examples are right-padded per batch (a causal mask keeps padding from touching earlier positions) and scored
    in length order, so a batch pads little. ``progress(done, total)`` follows the examples.
    """
    # seconds to import, only where a model is scored (the worker): not at the code location's load
    import torch

    frame = storage.read_parquet(examples_path)
    if frame.empty:
        raise ValueError(f"eval set {examples_path} has no examples")
    ids_list = [np.asarray(v, dtype=np.int64) for v in frame["input_ids"]]
    mask_list = [np.asarray(v, dtype=np.int64) for v in frame["loss_mask"]]
    order = sorted(range(len(ids_list)), key=lambda i: len(ids_list[i]))
    nll_out, tok_out = [0.0] * len(order), [0] * len(order)
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            width = max(len(ids_list[i]) for i in idx)
            ids = torch.zeros((len(idx), width), dtype=torch.long)
            attn = torch.zeros((len(idx), width), dtype=torch.long)
            lmask = torch.zeros((len(idx), width), dtype=torch.float32)
            for row, i in enumerate(idx):
                n = len(ids_list[i])
                ids[row, :n] = torch.from_numpy(ids_list[i])
                attn[row, :n] = 1
                lmask[row, :n] = torch.from_numpy(mask_list[i]).float()
            ids, attn, lmask = ids.to(device), attn.to(device), lmask.to(device)
            logits = model(input_ids=ids, attention_mask=attn).logits
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            nll = -logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
            m = lmask[:, 1:]
            for row, i in enumerate(idx):
                nll_out[i] = float((nll[row] * m[row]).sum())
                tok_out[i] = int(m[row].sum())
            if progress:
                progress(min(start + batch_size, len(order)), len(order))
    empty = [str(frame["sample_id"].iloc[i]) for i, t in enumerate(tok_out) if t == 0]
    if empty:
        raise ValueError(f"eval set {examples_path}: examples {empty[:3]} have no loss-masked tokens")
    return nll_out, tok_out


@dataclass(frozen=True)
class AnswerSampling:
    """k answers per prompt sampled at ``temperature`` (nucleus ``top_p``) with a fixed ``seed``, the same for every
    model scored: the reward of a prompt is then the mean over its k answers, pass@1 estimated from k samples (Chen
    et al. 2021; DeepSeek-R1 reports pass@1 so, at temperature 0.6, rather than greedy answers)."""

    samples: int
    temperature: float
    top_p: float = 1.0
    seed: int = 0
    batch_size: int = 64  # answers per generate call (whole prompts' groups; at least one group)
    engine: str = "transformers"  # or "vllm": a vLLM engine on the same checkpoint (sample_answers_on_vllm)
    log_dir: str = ""  # where a vLLM engine's log goes (the evaluation's output folder)


def sample_answers(
    client: LocalTransformersClient, prompts: Sequence[str], max_new_tokens: int, sampling: AnswerSampling
) -> list[list[str]]:
    """``sampling.samples`` answers to each prompt, grouped by prompt. A prompt's k answers are rows of one
    ``generate`` call, and each call is seeded ``seed + its index``: a seed set once per batch would give two
    calls the same random draws, so one prompt split over two calls would repeat its own answers."""
    k = sampling.samples
    per_call = max(1, sampling.batch_size // k)  # prompts per generate call
    batch_size = client.batch_size
    out: list[list[str]] = []
    try:
        for call, start in enumerate(range(0, len(prompts), per_call)):
            chunk = prompts[start : start + per_call]
            client.batch_size = k * len(chunk)
            params = SamplingParams(
                max_new_tokens, sampling.temperature, sampling.top_p, sampling.seed + call
            )
            conversations = [[{"role": "user", "content": p}] for p in chunk for _ in range(k)]
            texts = [c.text for c in client.chat_many(conversations, params)]
            out += [texts[i * k : (i + 1) * k] for i in range(len(chunk))]
    finally:
        client.batch_size = batch_size
    return out


def sample_answers_on_vllm(
    model_dir: str | Path,
    tokenizer: Any,
    prompts: Sequence[str],
    max_new_tokens: int,
    sampling: AnswerSampling,
    label: str = "model",
) -> list[list[str]]:
    """``sample_answers`` on a vLLM engine started on ``model_dir`` for the call: the prompts rendered with the
    chat template and tokenized as the transformers client does, k rows per prompt in one batch, each row seeded
    by its position (``row_seed``: the same draws for every model scored with the same seed), decoded alike."""
    # the engine's pipe and process: only where answers are sampled on vLLM
    from nexa_dagster.core.llm.vllm_engine import VLLMEngine

    k = sampling.samples
    rendered = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in prompts
    ]
    ids = [tokenizer.encode(text, add_special_tokens=False) for text in rendered]
    rows = [p for p in ids for _ in range(k)]
    log_dir = Path(sampling.log_dir or Path(model_dir).parent)
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in label)
    engine = VLLMEngine(
        model_dir,
        log_dir / f"{safe}.vllm-answers.log",
        max(len(r) for r in rows) + max_new_tokens,
        label=label,
        instead="sample the gate's answers with rl.rollout_engine: transformers, which runs it",
    )
    try:
        completions, _ = engine.generate(
            rows,
            max_new_tokens,
            sampling.temperature,
            sampling.top_p,
            sampling.seed,
            [tokenizer.eos_token_id],
        )
    finally:
        engine.close()
    texts = [tokenizer.decode(c, skip_special_tokens=True).strip() for c in completions]
    return [texts[i * k : (i + 1) * k] for i in range(len(prompts))]


def score_model(
    model_dir: str | Path,
    examples_path: str,
    prompts: Sequence[str],
    max_new_tokens: int,
    device: str = "cpu",
    batch_size: int = 8,
    log: Callable[[str], None] = print,
    label: str = "model",
    sampling: AnswerSampling | None = None,
) -> ModelScores:
    """Per-example eval-set losses, greedy answers to ``prompts`` and, with ``sampling``, k sampled answers to each
    of one model (loaded once)."""

    loading = time.perf_counter()
    with LocalTransformersClient(model_dir, batch_size=batch_size, device=device) as client:
        log(span_line("fixed", "model_load", time.perf_counter() - loading))
        with span(log, "work", "scoring"):
            with Progress(log, f"{label}: eval-set examples scored") as progress:
                nll, tokens = example_losses(client.model, examples_path, batch_size, device, progress)
            params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
            answers = [
                c.text for c in client.chat_many([[{"role": "user", "content": p}] for p in prompts], params)
            ]
            sampled = None
            if sampling is not None and sampling.engine != "vllm":
                sampled = sample_answers(client, prompts, max_new_tokens, sampling)
            tokenizer = client.tokenizer
    if sampling is not None and sampling.engine == "vllm":  # the scoring's model released first
        with span(log, "work", "sampled_answers_vllm"):
            sampled = sample_answers_on_vllm(model_dir, tokenizer, prompts, max_new_tokens, sampling, label)
    scores = ModelScores(nll, tokens, answers, sampled_answers=sampled)
    log(
        f"{label}: eval-set loss {scores.loss.loss:.4f} (ppl {scores.loss.perplexity:.1f}) over "
        f"{scores.loss.tokens} tokens of {len(tokens)} examples"
    )
    return scores


@dataclass(frozen=True)
class JudgeRubric:
    """How the judge scores an answer: the score prompt, the JSON-verdict prompt and SampleGate's judge settings
    (method, max_tokens, retries), so evaluation's judge and the data gate's judge are the same instrument."""

    template: str
    verdict_template: str
    settings: JudgeConfig

    @classmethod
    def from_files(
        cls,
        gate_file: str = "filters.yaml",
        template: str = "prompts/judge.jinja",
        verdict_template: str = "prompts/judge_verdict.jinja",
    ) -> JudgeRubric:
        return cls(read_text(template), read_text(verdict_template), load_gate_config(gate_file).judge)


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
    benchmarks: dict[str, Any] | None = None  # lm-evaluation-harness scores (core.benchmarks)
    production_benchmarks: dict[str, Any] | None = None

    @property
    def judge_score(self) -> float | None:
        scores = [a.score for a in self.answers if a.score is not None]
        return sum(scores) / len(scores) if scores else None


def judge_answers(
    judge: LLMClient,
    prompts: Sequence[str],
    answers: Sequence[str],
    rubric: JudgeRubric,
    log: Callable[[str], None] = print,
    progress: Callable[[int, int], None] | None = None,
    method: str | None = None,
) -> list[JudgedAnswer]:
    """The judge scores each answer (1-5) by ``rubric`` (its method, or ``method``); ``progress(judged, total)``
    follows it, the slow part with a remote judge."""
    s = rubric.settings
    scorer = Judge(
        judge, rubric.template, rubric.verdict_template, s.max_tokens, method or s.method, s.retries
    )
    out = []
    for prompt, answer in zip(prompts, answers, strict=True):
        verdict = scorer.judge(prompt, answer)
        out.append(JudgedAnswer(prompt, answer, verdict.score, verdict.method))
        if progress:
            progress(len(out), len(prompts))
    log(f"judged {len(out)} held-out answers")
    return out


def render_markdown(result: EvalResult, lineage: dict[str, Any], win_rate: WinRate | None = None) -> str:
    judge = f"{result.judge_score:.3f}" if result.judge_score is not None else "n/a"
    versus = [f"| judge vs production | {describe_win_rate(win_rate)} |"] if win_rate is not None else []
    lines = [
        f"# Evaluation of checkpoint `{result.checkpoint_id}`",
        "",
        "| metric | value |",
        "|---|---|",
        f"| eval-set loss (assistant tokens) | {result.loss.loss:.4f} |",
        f"| perplexity | {result.loss.perplexity:.2f} |",
        f"| eval-set examples / tokens | {result.loss.sequences} / {result.loss.tokens} |",
        f"| judge score (1-5, mean) | {judge} |",
        *versus,
        "",
        *markdown_table(result.benchmarks, result.production_benchmarks),
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


def write_report(
    result: EvalResult, lineage: dict[str, Any], report_dir: str, win_rate: WinRate | None = None
) -> tuple[str, str]:
    """Write ``report.json`` and ``report.md`` (atomically) and return their paths."""
    payload = {
        "checkpoint_id": result.checkpoint_id,
        "eval_loss": result.loss.loss,
        "perplexity": result.loss.perplexity,
        "eval_tokens": result.loss.tokens,
        "eval_examples": result.loss.sequences,
        "judge_score": result.judge_score,
        "benchmarks": result.benchmarks,
        "production_benchmarks": result.production_benchmarks,
        "answers": [a.__dict__ for a in result.answers],
        "lineage": lineage,
    }
    json_path = storage.join(report_dir, "report.json")
    md_path = storage.join(report_dir, "report.md")
    storage.write_json(payload, json_path)
    storage.write_text(render_markdown(result, lineage, win_rate), md_path)
    return json_path, md_path


PAIRWISE_TEMPLATE = """You compare two answers to the same question. Reply with the letter of the better answer only.

QUESTION:
{question}

ANSWER A:
{a}

ANSWER B:
{b}

Better answer (A or B):"""


def _preference(judge: LLMClient, question: str, a: str, b: str) -> str | None:
    """ "A", "B", or None when the judge gives no usable verdict (an even split, an unreadable reply)."""
    msgs: list[ChatMessage] = [
        {"role": "user", "content": PAIRWISE_TEMPLATE.format(question=question, a=a, b=b)}
    ]
    if judge.capabilities().logprobs:
        lp = judge.choice_logprobs(msgs, ("A", "B"))
        return "A" if lp["A"] > lp["B"] else "B" if lp["B"] > lp["A"] else None
    text = judge.chat(msgs, SamplingParams(max_tokens=4, temperature=0.0)).text.strip().upper()
    return "A" if text.startswith("A") else "B" if text.startswith("B") else None


def pairwise_verdicts(
    judge: LLMClient, prompts: Sequence[str], candidate: Sequence[str], production: Sequence[str]
) -> tuple[list[Verdict], list[Verdict]]:
    """The judge's preferred model for every prompt, asked twice: candidate's answer shown first, then
    production's shown first (judges favour a position; ``core.paired.order_consistent_win_rate`` keeps only the
    verdicts that survive the swap)."""
    first: list[Verdict] = []
    second: list[Verdict] = []
    for q, cand, prod in zip(prompts, candidate, production, strict=True):
        p1 = _preference(judge, q, cand, prod)
        first.append("candidate" if p1 == "A" else "production" if p1 == "B" else None)
        p2 = _preference(judge, q, prod, cand)
        second.append("production" if p2 == "A" else "candidate" if p2 == "B" else None)
    return first, second


def pairwise_win_rate(
    judge: LLMClient, prompts: Sequence[str], candidate: Sequence[str], production: Sequence[str]
) -> float:
    """The candidate's win rate among the order-consistent verdicts (0.5 when there is none)."""
    return order_consistent_win_rate(*pairwise_verdicts(judge, prompts, candidate, production)).rate.estimate


def pointwise_method(judge: LLMClient, rubric: JudgeRubric) -> str:
    """How the pointwise judge scores an answer: the expected score under the judge's own probabilities where the
    engine gives log-probabilities (graded: two answers rarely tie), else the rubric's method (a parsed 1-5)."""
    return "logprobs" if judge.capabilities().logprobs else rubric.settings.method


JUDGE_MODE_NAMES = ("pairwise", "pointwise")


@dataclass
class CheckpointEvaluation:
    """Everything measured about one checkpoint on one eval-set version: what the report, MLflow and the
    promotion gate are built from. ``paired_loss`` and ``win_rate`` exist when a production model was compared."""

    result: EvalResult
    eval_set_version: int
    candidate: ModelScores
    production: ModelScores | None = None
    paired_loss: PairedLoss | None = None
    win_rate: WinRate | None = None
    length_controlled: LengthControlled | None = None
    # pointwise mode: the judge's score of each prompt's two answers (candidate's, production's), for the guards
    judge_scores: tuple[list[float | None], list[float | None]] | None = None

    @property
    def win_rate_vs_production(self) -> float | None:
        return self.win_rate.rate.estimate if self.win_rate else None


def compare(
    checkpoint_id: str,
    eval_set_version: int,
    candidate: ModelScores,
    production: ModelScores | None,
    prompts: Sequence[str],
    judge: LLMClient,
    rubric: JudgeRubric,
    confidence: float = 0.95,
    resamples: int = 2000,
    log: Callable[[str], None] = print,
    interval_method: str = DEFAULT_INTERVAL_METHOD,
    judge_mode: str = "pairwise",
    tie_epsilon: float = 0.0,
) -> CheckpointEvaluation:
    """Judge the candidate's answers and, given production's scores on the same eval set, pair the two models:
    per-example loss differences with their interval (``interval_method``) and the judge's win rate, by
    ``judge_mode``: ``pairwise`` (both answers shown, in both orders; order-consistent verdicts count) or
    ``pointwise`` (each answer scored alone by ``pointwise_method``; the higher score wins, within ``tie_epsilon``
    a tie)."""
    if judge_mode not in JUDGE_MODE_NAMES:
        raise ValueError(f"judge_mode must be one of {JUDGE_MODE_NAMES}, not {judge_mode!r}")
    method = pointwise_method(judge, rubric) if judge_mode == "pointwise" and production is not None else None
    with Progress(log, f"{checkpoint_id}: held-out answers judged") as progress:
        answers = judge_answers(
            judge, prompts, candidate.answers, rubric, log=log, progress=progress, method=method
        )
    result = EvalResult(
        checkpoint_id,
        candidate.loss,
        answers,
        candidate.benchmarks,
        production.benchmarks if production else None,
    )
    evaluation = CheckpointEvaluation(result, eval_set_version, candidate, production)
    if production is None:
        return evaluation
    evaluation.paired_loss = paired_loss_difference(
        candidate.nll,
        production.nll,
        candidate.tokens,
        confidence=confidence,
        resamples=resamples,
        method=interval_method,
    )
    log(f"{checkpoint_id}: {_describe_paired_loss(evaluation.paired_loss, confidence)}")
    first, second = _judge_both_models(
        evaluation, production, judge, prompts, rubric, method, judge_mode, tie_epsilon, confidence, log
    )
    evaluation.length_controlled = length_controlled_win_rate(
        first, second, [len(a) for a in candidate.answers], [len(a) for a in production.answers]
    )
    log(f"{checkpoint_id}: {describe_win_rate(evaluation.win_rate)}")
    return evaluation


def _describe_paired_loss(paired: PairedLoss, confidence: float) -> str:
    """Both models' eval-set loss and the difference with its interval, in one line."""
    d = paired.difference
    return (
        f"eval-set loss {paired.candidate:.4f} vs production {paired.production:.4f}: difference "
        f"{d.estimate:+.4f} [{d.low:+.4f}, {d.high:+.4f}] ({confidence:.0%} {paired.method}-interval, "
        f"n = {paired.examples})"
    )


def _judge_both_models(
    evaluation: CheckpointEvaluation,
    production: ModelScores,
    judge: LLMClient,
    prompts: Sequence[str],
    rubric: JudgeRubric,
    method: str | None,
    judge_mode: str,
    tie_epsilon: float,
    confidence: float,
    log: Callable[[str], None],
) -> tuple[list[Verdict], list[Verdict]]:
    """Set ``evaluation.win_rate`` (and, pointwise, ``judge_scores``: production's answers judged too) and return
    the verdicts in both answer orders, which the length control reads; pointwise, one verdict per prompt (a tie:
    None) serves as both, having no order to be consistent across."""
    if judge_mode != "pointwise":
        first, second = pairwise_verdicts(judge, prompts, evaluation.candidate.answers, production.answers)
        evaluation.win_rate = order_consistent_win_rate(first, second, confidence)
        return first, second
    with Progress(log, "production: held-out answers judged") as progress:
        theirs = judge_answers(
            judge, prompts, production.answers, rubric, log=log, progress=progress, method=method
        )
    ours_scores, their_scores = [a.score for a in evaluation.result.answers], [a.score for a in theirs]
    evaluation.win_rate = pointwise_win_rate(ours_scores, their_scores, tie_epsilon, confidence)
    evaluation.judge_scores = (ours_scores, their_scores)
    verdicts: list[Verdict] = [
        v if v != "tie" else None for v in pointwise_verdicts(ours_scores, their_scores, tie_epsilon)
    ]
    return verdicts, verdicts


def describe_win_rate(w: WinRate) -> str:
    """The judge's verdicts in one line: the conditional rate with its n, the headline rate, how many verdicts
    flipped with the answer order (pairwise) or tied (pointwise), and how many replies were unreadable."""
    if w.mode == "pairwise":
        consistency = (
            f"order consistency {w.order_consistency:.0%}"
            if w.order_consistency is not None
            else "nothing readable"
        )
        apart = f"{w.inconsistent} flipped with the answer order ({consistency})"
    else:
        apart = f"{w.ties} ties"
    return (
        f"{w.mode} judge win rate vs production {w.rate.estimate:.3f} [{w.rate.low:.3f}, {w.rate.high:.3f}] over "
        f"n = {w.consistent} usable verdicts of {w.prompts} prompts ({w.wins} wins, {w.losses} losses); "
        f"headline {w.headline:.3f} ({'flips' if w.mode == 'pairwise' else 'ties'} count half); {apart}; "
        f"{w.unreadable} unreadable"
    )


def evaluate_checkpoint(
    checkpoint_id: str,
    checkpoint_path: str,
    eval_set: dict[str, Any],
    prompts: Sequence[str],
    judge: LLMClient,
    rubric: JudgeRubric,
    max_new_tokens: int,
    production_path: str | None = None,
    log: Callable[[str], None] = print,
    batch_size: int = 16,
    device: str = "cpu",
    confidence: float = 0.95,
    resamples: int = 2000,
) -> CheckpointEvaluation:
    """The whole evaluation in this process (a notebook, a benchmark, the tiny scale): both models scored on the
    eval set (``eval_set``: a manifest from ``core.eval_set.load_eval_set``), then judged and compared."""
    candidate = score_model(
        checkpoint_path, eval_set["path"], prompts, max_new_tokens, device, batch_size, log, checkpoint_id
    )
    production = (
        None
        if production_path is None
        else score_model(
            production_path, eval_set["path"], prompts, max_new_tokens, device, batch_size, log, "production"
        )
    )
    return compare(
        checkpoint_id,
        int(eval_set["version"]),
        candidate,
        production,
        prompts,
        judge,
        rubric,
        confidence,
        resamples,
        log,
    )
