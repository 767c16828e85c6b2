"""In-process ``transformers`` backend: small local models behind the same interface as a served model.

On a CPU this is both the fastest way to run a tiny model (no HTTP, batched ``generate``) and the only way to get
log-probabilities of chosen tokens from ``transformers`` (``transformers serve`` ignores ``logprobs``), which the
judge needs for a well-formed verdict from a weak model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nexa_dagster.core.llm.base import (
    Capabilities,
    ChatMessage,
    Completion,
    LLMClient,
    LLMError,
    SamplingParams,
)
from nexa_dagster.core.tiny_model import ensure_model


class LocalTransformersClient(LLMClient):
    """A causal LM loaded with ``from_pretrained`` from a local directory, answering chat requests in batches."""

    def __init__(self, model_path: str | Path, batch_size: int = 16, device: str = "cpu") -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = ensure_model(model_path)
        self.model_id = str(path)
        self.batch_size = batch_size
        self.device = device
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(path))
            self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).eval()
        except Exception as e:  # a corrupt or partial directory
            raise LLMError(f"cannot load model from {path}: {e}") from e
        if getattr(self.model.config, "output_router_logits", False):
            self.model.config.output_router_logits = False  # a training-time setting; breaks padded generation
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "left"  # generation continues at the right edge of every row
        self._lock = threading.Lock()

    def capabilities(self) -> Capabilities:
        return Capabilities(logprobs=True, json_schema=False, engine="transformers-local")

    def _render(self, messages: Sequence[ChatMessage]) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)

    def chat(self, messages: Sequence[ChatMessage], params: SamplingParams) -> Completion:
        return self.chat_many([messages], params)[0]

    def chat_many(self, conversations: Sequence[Sequence[ChatMessage]], params: SamplingParams) -> list[Completion]:
        out: list[Completion] = []
        for start in range(0, len(conversations), self.batch_size):
            out += self._generate_batch(conversations[start:start + self.batch_size], params)
        return out

    def _generate_batch(self, batch: Sequence[Sequence[ChatMessage]], params: SamplingParams) -> list[Completion]:
        import torch

        prompts = [self._render(m) for m in batch]
        enc = self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
        sample = params.temperature > 0
        kwargs: dict[str, Any] = {"max_new_tokens": params.max_tokens, "do_sample": sample,
                                  "pad_token_id": self.tokenizer.pad_token_id,
                                  "eos_token_id": self.tokenizer.eos_token_id}
        if sample:
            kwargs.update(temperature=params.temperature, top_p=params.top_p)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        t0 = time.perf_counter()
        with self._lock, torch.no_grad():
            if params.seed is not None:
                torch.manual_seed(params.seed)
            generated = self.model.generate(**enc, **kwargs)
        latency = (time.perf_counter() - t0) / max(1, len(batch))  # the batch's time shared per request
        new = generated[:, enc["input_ids"].shape[1]:]
        completions = []
        for row, prompt_mask in zip(new, enc["attention_mask"], strict=True):
            ids = row.tolist()
            finish = "length"
            if self.tokenizer.eos_token_id in ids:
                ids = ids[: ids.index(self.tokenizer.eos_token_id)]
                finish = "stop"
            ids = [i for i in ids if i != self.tokenizer.pad_token_id]
            completions.append(Completion(
                text=self.tokenizer.decode(ids, skip_special_tokens=True).strip(), model=self.model_id,
                prompt_tokens=int(prompt_mask.sum()), completion_tokens=len(ids) + (finish == "stop"),
                latency_s=latency, finish_reason=finish,
            ))
        return completions

    def choice_logprobs(self, messages: Sequence[ChatMessage], choices: Sequence[str]) -> dict[str, float]:
        """Sum of the log-probabilities of each choice's tokens as the start of the assistant's answer."""
        import torch

        prompt_ids = self.tokenizer.encode(self._render(messages), add_special_tokens=False)
        rows = [prompt_ids + self.tokenizer.encode(c, add_special_tokens=False) for c in choices]
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=self.device)
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=self.device)
        with self._lock, torch.no_grad():
            logp = torch.log_softmax(self.model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
        out = {}
        for k, (choice, row) in enumerate(zip(choices, rows, strict=True)):
            total = 0.0
            for pos in range(len(prompt_ids), len(row)):
                total += float(logp[k, pos - 1, row[pos]])
            out[choice] = total
        return out

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]
