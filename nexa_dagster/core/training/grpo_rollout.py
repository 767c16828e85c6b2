"""GRPO's inputs and its rollouts: the prompts file, the order prompts are drawn in, and the batched sampler.

* ``load_prompts``: a JSONL file whose rows carry a ``prompt`` (a chat messages list, or a string: the user turn,
  with the row's ``system_prompt`` as the system turn when it has one, which is what ``rl_prompts`` writes) and any
  other columns, which reach the reward functions by name. Rendered with the checkpoint's chat template and
  tokenized once, before a model is built; a bad row fails with its file and line.
* ``prompt_batches``: the loop's micro-batches for GRPO are prompt *indices*, one prompt (one group of K
  completions) per micro-batch: a pure function of the seed and the position, as every objective's batches are, so
  a resumed run draws the prompts an uninterrupted one would have. The loop's prefetching thread only ever prepares
  these indices; completions are sampled in the training thread at the start of each step (``GRPOLoss.rollout``).
* ``BatchedSampler``: Hugging Face ``generate`` on a ``transformers`` Mixtral whose parameters *are* the training
  model's tensors (aliased, not copied: no second copy of the weights, and every rollout sees the weights of the
  last update). The K x B completions of a step are one left-padded ``generate`` call. The same code runs on a GPU.
  ``rollout_engine: vllm`` samples on a vLLM engine instead (``vllm_sampler.VLLMSampler``), the same interface.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nexa_dagster.core.llm.shared_prefill import generate_sharing_prompts
from nexa_dagster.core.training.data import Batch, index_stream

PROMPT_INDEX = "prompt_index"  # host key: which prompt of the file a micro-batch rolls out


@dataclass
class PromptSet:
    """The rows of a prompts file: each prompt's chat messages and token ids, the other columns by name."""

    path: str
    messages: list[list[dict[str, str]]]
    token_ids: list[list[int]]
    columns: dict[str, list[Any]]  # every column but prompt, plus "prompts" (each row's prompt as written)
    digest: str  # sha256 of the file's bytes: a resume on another file is refused
    lines: list[int] = field(default_factory=list)  # each row's line in the file

    def __len__(self) -> int:
        return len(self.messages)

    def rows(self, indices: Sequence[int], repeat: int = 1) -> dict[str, list[Any]]:
        """The columns of ``indices``, each row repeated ``repeat`` times (one entry per completion)."""
        return {
            name: [values[i] for i in indices for _ in range(repeat)] for name, values in self.columns.items()
        }


def chat_messages(row: dict[str, Any], where: str) -> list[dict[str, str]]:
    """A row's ``prompt`` as chat messages (a string: the user turn after the row's ``system_prompt``, if any)."""
    prompt = row.get("prompt")
    if isinstance(prompt, str) and prompt.strip():
        system = row.get("system_prompt")
        head = [{"role": "system", "content": system}] if isinstance(system, str) and system.strip() else []
        return [*head, {"role": "user", "content": prompt}]
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
    ):
        if prompt[-1]["role"] == "assistant":
            raise ValueError(
                f"{where}: field 'prompt' ends with an assistant turn; the completion is sampled"
            )
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    raise ValueError(
        f"{where}: field 'prompt' must be a non-empty string or a list of chat messages, got {prompt!r:.80}"
    )


def read_rows(path: str) -> tuple[list[dict[str, Any]], list[int], str]:
    """The JSON objects of a JSONL file with their line numbers, and the file's sha256."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"prompts file not found: {path}")
    data = file.read_bytes()
    rows, lines = [], []
    for number, line in enumerate(data.decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: a row must be a JSON object, got {type(row).__name__}")
        rows.append(row)
        lines.append(number)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows, lines, hashlib.sha256(data).hexdigest()


def load_prompts(path: str, tokenizer: Any, max_prompt_tokens: int) -> PromptSet:
    """Read, check, render and tokenize a prompts file (see the module docstring)."""
    rows, lines, digest = read_rows(path)
    messages = [chat_messages(row, f"{path}:{line}") for row, line in zip(rows, lines, strict=True)]
    token_ids = []
    for m, line in zip(messages, lines, strict=True):
        text = tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)  # the template writes every special token
        if len(ids) > max_prompt_tokens:
            raise ValueError(
                f"{path}:{line}: the prompt is {len(ids)} tokens; with the completion it must fit the model's "
                f"{max_prompt_tokens} prompt tokens"
            )
        token_ids.append(ids)
    names = sorted({k for row in rows for k in row} - {"prompt"})
    columns = {name: [row.get(name) for row in rows] for name in names}
    columns["prompts"] = [row["prompt"] for row in rows]
    return PromptSet(path, messages, token_ids, columns, digest, lines)


def prompt_batches(num_prompts: int, seed: int, rank: int, world_size: int, start: int) -> Iterator[Batch]:
    """This rank's micro-batches from global micro-batch ``start`` on: one prompt index each, every rank a
    different prompt of the same seeded epoch permutation (``data.index_stream``, SFT's order)."""
    stream = index_stream(num_prompts, seed)
    if start:
        next(itertools.islice(stream, start * world_size - 1, None))  # skip without building lists
    while True:
        group = list(itertools.islice(stream, world_size))
        yield {PROMPT_INDEX: torch.tensor([group[rank]])}


def sampling_seed(seed: int, step: int, rank: int) -> int:
    """The sampling seed of one rank's rollout at one step: a pure function of the run's seed and the position."""
    digest = hashlib.sha256(f"grpo-rollout:{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class AliasedMixtral:
    """transformers' Mixtral whose parameters *are* the training model's tensors (storage shared, no copy): what
    ``BatchedSampler`` generates with and what ``VLLMSampler`` writes to the engine (``save_pretrained``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        # transformers' Mixtral code (seconds), only for RL rollouts
        from transformers import MixtralForCausalLM

        config = copy.deepcopy(model.config)
        config.output_router_logits = False  # a training-time setting; breaks padded generation
        config.use_cache = True
        self.model = model
        self.hf = MixtralForCausalLM(config).to(next(model.parameters()).device).eval()
        self._alias()

    def _alias(self) -> None:
        """Make the generator's parameters the training model's tensors (storage shared, no copy)."""
        state = {k.replace("_orig_mod.", ""): v.detach() for k, v in self.model.state_dict().items()}
        missing, unexpected = self.hf.load_state_dict(state, strict=False, assign=True)
        missing = [k for k in missing if not (k == "lm_head.weight" and self.hf.config.tie_word_embeddings)]
        if missing or unexpected:
            raise RuntimeError(
                f"weights do not map onto transformers' Mixtral: missing {missing}, unexpected {unexpected}"
            )
        if self.hf.config.tie_word_embeddings:
            self.hf.tie_weights()
        self.hf.requires_grad_(False)
        self._pointers = self._training_pointers()

    def _training_pointers(self) -> list[int]:
        return [p.data_ptr() for p in self.model.state_dict().values()]

    def sync(self) -> None:
        """Re-alias when the engine moved a tensor (a checkpoint load that replaced one): a pointer check per rollout."""
        if self._training_pointers() != self._pointers:
            self._alias()

    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device


class BatchedSampler:
    """Batched ``generate`` with the training model's current weights (see the module docstring)."""

    engine = "transformers"
    last_logprobs: list[list[float]] | None = (
        None  # the sampling log-probabilities: the trainer's own, not kept
    )
    sync_s = None  # nothing to sync: the generator is the training tensors
    share_prefill = (
        True  # a group's prompt prefilled once (core/llm/shared_prefill); False: bench/rl.py's before
    )

    def __init__(self, model: torch.nn.Module, pad_id: int, eos_id: int | list[int]) -> None:
        self.view = AliasedMixtral(model)
        self.hf, self.pad_id, self.eos_id = self.view.hf, pad_id, eos_id
        self.eos_ids = set(eos_id) if isinstance(eos_id, list) else {eos_id}
        self.hf.generation_config.pad_token_id = pad_id

    @property
    def device(self) -> torch.device:
        return self.view.device

    def describe(self) -> str:
        return f"batched HF generate on {self.device.type}"

    def close(self) -> None:
        """Nothing to stop: the generator is the training model's tensors."""

    @torch.no_grad()
    def generate(
        self, prompts: Sequence[list[int]], max_new_tokens: int, temperature: float, top_p: float, seed: int
    ) -> list[list[int]]:
        """Each prompt's completion token ids (up to and with the first end of turn), one ``generate`` call;
        ``temperature`` 0: greedy. Sampling draws from a generator seeded with ``seed``, the caller's RNG kept."""
        self.view.sync()
        device = next(self.hf.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):  # left padding: generation continues at every row's right edge
            ids[row, width - len(p) :], mask[row, width - len(p) :] = torch.tensor(p), 1
        sampling = (
            {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
            if temperature > 0
            else {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        )
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
            torch.manual_seed(seed)
            out = generate_sharing_prompts(
                self.hf,
                ids.to(device),
                mask.to(device),
                share=self.share_prefill,
                max_new_tokens=max_new_tokens,
                pad_token_id=self.pad_id,
                eos_token_id=self.eos_id,
                **sampling,
            )
        return [self._trim(row) for row in out[:, width:].tolist()]

    def _trim(self, row: list[int]) -> list[int]:
        """A generated row up to and with its first end-of-turn token (``generate`` pads finished rows after it)."""
        for i, token in enumerate(row):
            if token in self.eos_ids:
                return row[: i + 1]
        return row
