"""Teacher generation: documents become prompts (Jinja templates in ``configs/prompts``), the teacher answers.

Each sample's id hashes what determines its answer (prompt, system prompt, model, sampling parameters and
generation index), so a changed model or sampling setting gives new ids and an unchanged one the same ids. That
id is also the key of the durable answer store (``core.generation_store``): a resumed run reuses every stored
answer whose inputs did not change and asks only for the rest.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import jinja2
import pandas as pd

from nexa_dagster.core.distill.generation_store import GenerationStore
from nexa_dagster.core.llm.base import ChatMessage, ChatRequest, Completion, LLMClient, SamplingParams

TEACHER_COLUMNS = [
    "sample_id",
    "doc_id",
    "day",
    "generation_index",
    "system_prompt",
    "prompt",
    "response",
    "reasoning",
    "model",
    "prompt_tokens",
    "completion_tokens",
    "latency_s",
    "finish_reason",
    "error",
]

_ENV = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=False, autoescape=False)


def render(template: str, **values: object) -> str:
    return _ENV.from_string(template).render(**values).strip()


@dataclass(frozen=True)
class PromptSpec:
    sample_id: str
    doc_id: str
    day: str
    generation_index: int
    system_prompt: str
    prompt: str

    def messages(self) -> list[ChatMessage]:
        msgs: list[ChatMessage] = []
        if self.system_prompt:
            msgs.append({"role": "system", "content": self.system_prompt})
        msgs.append({"role": "user", "content": self.prompt})
        return msgs


def for_generation(params: SamplingParams, generation_index: int) -> SamplingParams:
    """Each generation of the same prompt gets its own seed, so n generations are n different samples."""
    seed = None if params.seed is None else params.seed + generation_index
    return SamplingParams(params.max_tokens, params.temperature, params.top_p, seed)


def sample_key(
    prompt: str, system_prompt: str, model: str, params: SamplingParams, generation_index: int
) -> str:
    payload = json.dumps(
        {"p": prompt, "s": system_prompt, "m": model, "sp": asdict(params), "g": generation_index},
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:24]


def build_prompts(
    documents: pd.DataFrame,
    template: str,
    system_prompt: str,
    model: str,
    params: SamplingParams,
    generations_per_prompt: int,
) -> list[PromptSpec]:
    """One prompt per document and generation index, rendered from the teacher template."""
    specs = []
    for doc in documents.itertuples(index=False):
        prompt = render(template, title=doc.title or "untitled", text=doc.text)
        for g in range(generations_per_prompt):
            specs.append(
                PromptSpec(
                    sample_key(prompt, system_prompt, model, for_generation(params, g), g),
                    doc.doc_id,
                    doc.day,
                    g,
                    system_prompt,
                    prompt,
                )
            )
    return specs


@dataclass
class GenerationStats:
    """What one call of ``generate_teacher_samples`` did and cost, for the asset's metadata."""

    requested: int = 0  # distinct keys asked for
    reused: int = 0  # answered from the store (paid for by an earlier run)
    generated: int = 0  # answered by the teacher in this run (and stored)
    failed: int = 0  # still failing after the client's retries (kept with ``error``; retried by the next run)
    prompt_tokens: int = 0  # of the requests sent in this run
    completion_tokens: int = 0  # generated in this run
    wall_s: float = 0.0  # time spent waiting for the teacher in this run

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def cost(self, usd_per_1m_input: float, usd_per_1m_output: float) -> float:
        return (self.prompt_tokens * usd_per_1m_input + self.completion_tokens * usd_per_1m_output) / 1e6


def _row(spec: PromptSpec, answer: Completion | None, error: str | None) -> dict[str, object]:
    return {
        "sample_id": spec.sample_id,
        "doc_id": spec.doc_id,
        "day": spec.day,
        "generation_index": spec.generation_index,
        "system_prompt": spec.system_prompt,
        "prompt": spec.prompt,
        "response": answer.text if answer else "",
        "reasoning": answer.reasoning if answer else None,
        "model": answer.model if answer else "",
        "prompt_tokens": answer.prompt_tokens if answer else 0,
        "completion_tokens": answer.completion_tokens if answer else 0,
        "latency_s": answer.latency_s if answer else 0.0,
        "finish_reason": answer.finish_reason if answer else None,
        "error": error,
    }


def generate_teacher_samples(
    client: LLMClient,
    prompts: list[PromptSpec],
    params: SamplingParams,
    store: GenerationStore,
    batch_size: int = 16,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[pd.DataFrame, GenerationStats]:
    """Ask the teacher for every prompt whose key has no stored answer, and return the ``teacher_samples`` table.

    Answers are committed to ``store`` (under the prompt's day) one by one as they arrive, so a killed run is
    resumed by calling this again: stored keys are reused, only the rest is sent. The table has exactly one row
    per distinct key, in prompt order. Failed requests stay in the table with ``error`` set (the judge stage
    rejects them with that reason) and are not stored, so the next run asks again; a flaky endpoint costs rows,
    never the whole partition, and the failure is visible.
    """
    seen: set[str] = set()
    specs = [
        s for s in prompts if not (s.sample_id in seen or seen.add(s.sample_id))
    ]  # one per key, first wins
    stats = GenerationStats(requested=len(specs))
    answers: dict[str, Completion] = {}
    by_day: dict[str, list[PromptSpec]] = {}
    for spec in specs:
        by_day.setdefault(spec.day, []).append(spec)
    for day, day_specs in by_day.items():
        answers.update(store.get_many(day, [s.sample_id for s in day_specs]))
    stats.reused = len(answers)
    pending = [s for s in specs if s.sample_id not in answers]
    errors: dict[str, str] = {}
    requests = [ChatRequest(s.messages(), for_generation(params, s.generation_index)) for s in pending]
    t0 = time.perf_counter()
    for done, (i, c) in enumerate(client.stream_chat(requests, chunk=batch_size), start=1):
        spec = pending[i]
        if c.error is not None:
            errors[spec.sample_id] = c.error
            stats.failed += 1
        else:
            store.put(spec.day, spec.sample_id, c)
            answers[spec.sample_id] = c
            stats.generated += 1
            stats.prompt_tokens += c.prompt_tokens
            stats.completion_tokens += c.completion_tokens
        if progress:
            progress(stats.reused + done, len(specs))
    stats.wall_s = time.perf_counter() - t0
    rows = [_row(s, answers.get(s.sample_id), errors.get(s.sample_id)) for s in specs]
    frame = pd.DataFrame(rows, columns=TEACHER_COLUMNS)
    frame["model"] = frame["model"].where(frame["model"] != "", client.model_id)
    return frame, stats
