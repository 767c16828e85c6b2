"""In-process ``transformers`` backend: small local models behind the same interface as a served model.

On a CPU this is both the fastest way to run a tiny model (no HTTP, batched ``generate``) and the only way to get
log-probabilities of chosen tokens from ``transformers`` (``transformers serve`` ignores ``logprobs``), which the
judge needs for a well-formed verdict from a weak model.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from nexa_dagster.core.common.artifacts import require_model_dir
from nexa_dagster.core.llm.base import (
    Capabilities,
    ChatMessage,
    Completion,
    LLMClient,
    LLMError,
    SamplingParams,
)
from nexa_dagster.core.llm.model_identity import model_fingerprint


def unreadable_file(path: Path) -> str:
    """The first file of a model directory that does not parse (JSON configs, safetensors weights), or ``""``:
    transformers' own errors often name neither (a truncated safetensors file says only "invalid header")."""
    from safetensors import safe_open  # only to name a bad file: the code location's load need not pay for it

    for file in sorted(path.glob("*.json")):
        try:
            json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return file.name
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as weights:
                for key in weights.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    weights.get_slice(key)
        except Exception:  # safetensors raises its own SafetensorError for a bad header or a short file
            return file.name
    return ""


SMALL_MODEL_PARAMETERS = 50_000_000  # below this, one CPU thread computes as fast as two, and never spins


class LocalTransformersClient(LLMClient):
    """A causal LM loaded with ``from_pretrained`` from a local directory, answering chat requests in batches.

    One lock guards the tokenizer and the model: fast tokenizers are not safe to pad from several threads at once
    ("Already borrowed"), and interleaved ``generate`` calls would only compete for the same cores anyway.
    """

    def __init__(
        self, model_path: str | Path, batch_size: int = 16, device: str = "cpu", threads: int | None = None
    ) -> None:
        # torch and transformers (seconds to import) only when a model is loaded: not at the code location's load
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        path = require_model_dir(model_path)
        self.model_path = str(path)
        self.model_id = model_fingerprint(path)  # what it is, not where it lies: answers carry this id
        self.batch_size = batch_size
        self.device = device
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(path))
            self.model: Any = (
                AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).eval()
            )
        except Exception as e:  # a corrupt or partial directory: loading it again fails the same way
            raise LLMError(
                f"cannot load model from {path}: {unreadable_file(path) or 'unreadable'}: {e}", permanent=True
            ) from e
        if getattr(self.model.config, "output_router_logits", False):
            self.model.config.output_router_logits = (
                False  # a training-time setting; breaks padded generation
            )
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "left"  # generation continues at the right edge of every row
        self._lock = threading.Lock()
        # A model under SMALL_MODEL_PARAMETERS gains nothing from a second CPU thread, and on a busy machine (tests,
        # runs beside it) OpenMP threads spin-wait for each other: measured 4.8 answers/s with one thread against
        # 0.7/s with two, the tiny teacher at a load average of 8 on 2 cores (README: docs/measurements.md).
        small = sum(p.numel() for p in self.model.parameters()) < SMALL_MODEL_PARAMETERS
        self.threads = threads or (1 if small and device == "cpu" else torch.get_num_threads())

    def __repr__(self) -> str:
        return f"LocalTransformersClient(model={self.model_path!r}, batch_size={self.batch_size}, device={self.device!r})"

    def capabilities(self) -> Capabilities:
        return Capabilities(
            logprobs=True,
            json_schema=False,
            engine="transformers-local",
            extra={"model_path": self.model_path, "fingerprint": self.model_id},
        )

    # -- helpers ----------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _threads(self) -> Iterator[None]:
        """torch's CPU threads set to ``self.threads`` while this client computes, and given back after."""
        import torch  # as in __init__ (imported once, then a lookup)

        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _model(self) -> Any:
        if self.model is None:
            raise LLMError(f"{self.model_path}: client is closed")
        return self.model

    def _render(self, messages: Sequence[ChatMessage]) -> str:
        if not messages:
            raise ValueError("a conversation needs at least one message")
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)

    def _encode(self, text: str) -> list[int]:
        # the chat template already writes every special token the model expects
        return self.tokenizer.encode(text, add_special_tokens=False)

    # -- generation -------------------------------------------------------------------------------------------
    def chat(self, messages: Sequence[ChatMessage], params: SamplingParams) -> Completion:
        return self.chat_many([messages], params)[0]

    def chat_many(
        self, conversations: Sequence[Sequence[ChatMessage]], params: SamplingParams
    ) -> list[Completion]:
        """Generate for many conversations in left-padded batches of ``batch_size``, answers in input order.

        Conversations are grouped by prompt length first so that a batch pads as little as possible (padding is
        compute spent on nothing); the answers are put back in the order they were asked.
        """
        if not conversations:
            return []
        prompts = [self._render(m) for m in conversations]
        with self._lock:
            lengths = [len(self._encode(p)) for p in prompts]
        order = sorted(range(len(prompts)), key=lambda i: lengths[i])
        out: list[Completion | None] = [None] * len(prompts)
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            for i, completion in zip(
                idx, self._generate_batch([prompts[i] for i in idx], params), strict=True
            ):
                out[i] = completion
        return [c for c in out if c is not None]

    def _generation_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        """OpenAI semantics: greedy at temperature 0, else nucleus sampling with no hidden top-k.

        The model's own ``generation_config`` may say ``do_sample=True, temperature=0.8``; every knob is set here
        explicitly so a request means the same thing on every backend.
        """
        kwargs: dict[str, Any] = {
            "max_new_tokens": params.max_tokens,
            "pad_token_id": self.tokenizer.pad_token_id,
            "eos_token_id": self.tokenizer.eos_token_id,
        }
        if params.temperature > 0:
            kwargs.update(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        return kwargs

    def _generate_batch(self, prompts: Sequence[str], params: SamplingParams) -> list[Completion]:
        import torch  # as in __init__ (imported once, then a lookup)

        from nexa_dagster.core.llm.shared_prefill import generate_sharing_prompts  # imports torch: as above

        model = self._model()
        kwargs = self._generation_kwargs(params)
        eos = self.tokenizer.eos_token_id
        with self._lock, self._threads(), torch.no_grad(), torch.random.fork_rng(devices=[]):
            # fork_rng: a request's seed makes its sampling reproducible without resetting the caller's RNG
            t0 = time.perf_counter()
            enc = self.tokenizer(
                list(prompts), return_tensors="pt", padding=True, add_special_tokens=False
            ).to(self.device)
            if params.seed is not None:
                torch.manual_seed(params.seed)
            generated = generate_sharing_prompts(model, enc["input_ids"], enc["attention_mask"], **kwargs)
            latency = time.perf_counter() - t0  # every request in the batch waited for the whole batch
        new = generated[:, enc["input_ids"].shape[1] :]
        completions = []
        for row, prompt_mask in zip(new, enc["attention_mask"], strict=True):
            ids = row.tolist()
            finish = "length"
            if eos in ids:
                # generate() pads finished rows after their eos; everything before the first eos was generated
                ids = ids[: ids.index(eos) + 1]
                finish = "stop"
            completions.append(
                Completion(
                    text=self.tokenizer.decode(ids, skip_special_tokens=True).strip(),
                    model=self.model_id,
                    prompt_tokens=int(prompt_mask.sum()),
                    completion_tokens=len(ids),  # eos counted, as servers do
                    latency_s=latency,
                    finish_reason=finish,
                )
            )
        return completions

    # -- scoring ----------------------------------------------------------------------------------------------
    def choice_logprobs(self, messages: Sequence[ChatMessage], choices: Sequence[str]) -> dict[str, float]:
        """Log-probability of each choice as the start of the assistant's answer (exact, multi-token safe).

        Each choice is tokenized on its own and appended to the rendered prompt; its log-probability is the sum of
        the log-probabilities of its tokens, each conditioned on the prompt and the choice's earlier tokens. All
        choices go through the model in one right-padded forward pass (right padding cannot affect earlier
        positions under a causal mask); choices of one token each need only the prompt, once.
        """
        import torch  # as in __init__ (imported once, then a lookup)

        if not choices:
            raise ValueError("choice_logprobs needs at least one choice")
        model = self._model()
        with self._lock:
            prompt_ids = self._encode(self._render(messages))
            choice_ids = [self._encode(c) for c in choices]
        empty = [c for c, ids in zip(choices, choice_ids, strict=True) if not ids]
        if empty:
            raise ValueError(f"choices {empty!r} encode to no tokens")
        if all(len(ids) == 1 for ids in choice_ids):
            return self._next_token_logprobs(prompt_ids, dict(zip(choices, choice_ids, strict=True)))
        rows = [prompt_ids + ids for ids in choice_ids]
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=self.device)
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=self.device)
        with self._lock, self._threads(), torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
            logp = torch.log_softmax(logits.float(), dim=-1)
        start = len(prompt_ids)
        out: dict[str, float] = {}
        for k, (choice, row) in enumerate(zip(choices, rows, strict=True)):
            # the token at position p is predicted by the logits at position p - 1
            out[choice] = float(sum(logp[k, p - 1, row[p]] for p in range(start, len(row))))
        return out

    def _next_token_logprobs(self, prompt_ids: list[int], choices: dict[str, list[int]]) -> dict[str, float]:
        """Choices of one token each (a judge's scores "1".."5"): their log-probabilities are all read at the
        prompt's last position, so the prompt goes through the model once, not once per choice."""
        import torch  # as in __init__ (imported once, then a lookup)

        ids = torch.tensor([prompt_ids], device=self.device)
        with self._lock, self._threads(), torch.no_grad():
            logits = self._model()(input_ids=ids, logits_to_keep=1).logits
            logp = torch.log_softmax(logits[0, -1].float(), dim=-1)
        return {choice: float(logp[token[0]]) for choice, token in choices.items()}

    def close(self) -> None:
        """Drop the model so its memory can be freed; later calls raise ``LLMError``."""
        with self._lock:
            self.model = None
