"""Teacher generation: documents become prompts (Jinja templates in ``configs/prompts``), the teacher answers.

Each sample's id hashes what determines its answer (prompt, system prompt, model, sampling parameters and
generation index), so a changed model or sampling setting gives new ids and an unchanged one the same ids.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass

import jinja2
import pandas as pd

from nexa_dagster.core.llm.base import ChatMessage, LLMClient, SamplingParams

TEACHER_COLUMNS = [
    "sample_id", "doc_id", "day", "generation_index", "system_prompt", "prompt", "response", "reasoning", "model",
    "prompt_tokens", "completion_tokens", "latency_s", "finish_reason", "error",
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


def sample_key(prompt: str, system_prompt: str, model: str, params: SamplingParams, generation_index: int) -> str:
    payload = json.dumps({"p": prompt, "s": system_prompt, "m": model, "sp": asdict(params), "g": generation_index},
                         sort_keys=True)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:24]


def build_prompts(documents: pd.DataFrame, template: str, system_prompt: str, model: str, params: SamplingParams,
                  generations_per_prompt: int) -> list[PromptSpec]:
    """One prompt per document and generation index, rendered from the teacher template."""
    specs = []
    for doc in documents.itertuples(index=False):
        prompt = render(template, title=doc.title or "untitled", text=doc.text)
        for g in range(generations_per_prompt):
            specs.append(PromptSpec(sample_key(prompt, system_prompt, model, for_generation(params, g), g),
                                    doc.doc_id, doc.day, g,
                                    system_prompt, prompt))
    return specs


def generate_teacher_samples(client: LLMClient, prompts: list[PromptSpec], params: SamplingParams,
                             batch_size: int = 16, progress: Callable[[int, int], None] | None = None) -> pd.DataFrame:
    """Ask the teacher for every prompt, in batches, and return the ``teacher_samples`` table.

    Failed requests stay in the table with ``error`` set (the judge stage rejects them with that reason), so a
    flaky endpoint costs rows, never the whole partition, and the failure is visible.
    """
    rows = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        by_generation: dict[int, list[PromptSpec]] = {}
        for spec in batch:
            by_generation.setdefault(spec.generation_index, []).append(spec)
        for g, specs in by_generation.items():
            completions = client.chat_many([s.messages() for s in specs], for_generation(params, g))
            for spec, c in zip(specs, completions, strict=True):
                rows.append({
                    "sample_id": spec.sample_id, "doc_id": spec.doc_id, "day": spec.day,
                    "generation_index": spec.generation_index, "system_prompt": spec.system_prompt,
                    "prompt": spec.prompt, "response": c.text, "reasoning": c.reasoning, "model": c.model,
                    "prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
                    "latency_s": c.latency_s, "finish_reason": c.finish_reason, "error": c.error,
                })
        if progress:
            progress(min(start + batch_size, len(prompts)), len(prompts))
    return pd.DataFrame(rows, columns=TEACHER_COLUMNS)
