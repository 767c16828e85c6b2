"""Build the project's own tiny models: no model can be downloaded here, so we make one.

``build_tokenizer`` trains a byte-level BPE tokenizer on a text corpus and wraps it as a Hugging Face
``PreTrainedTokenizerFast`` with the project's chat template; ``build_tiny_causal_lm`` creates a randomly
initialised Mixture-of-Experts causal LM from a model preset and saves both with the ordinary
``save_pretrained`` so that every consumer (``from_pretrained``, ``transformers serve``, the DeepSpeed trainer)
loads it the same way a real model is loaded. A real model is a configuration change: point the path elsewhere.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, MixtralForCausalLM, PreTrainedTokenizerFast

from nexa_dagster.core.common.artifacts import COMPLETION_MARKER
from nexa_dagster.core.common.config import read_text
from nexa_dagster.core.common.storage import directory_lock, publish_directory
from nexa_dagster.core.training.hf_checkpoint import write_portable_configs
from nexa_dagster.core.training.model.config import build_model_config

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|unk|>"]


def default_corpus() -> list[str]:
    """The CPython documentation topics (``pydoc_data.topics``): ~465K characters that ship with Python."""
    return [topics[k] for k in sorted(topics)]


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 2048) -> Any:
    """Train a byte-level BPE tokenizer and return it as a ``PreTrainedTokenizerFast`` with a chat template."""
    tok = Tokenizer(models.BPE(unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token="<|unk|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>", "<|eos|>"],
    )
    fast.chat_template = read_text("chat_template.jinja")
    return fast


def undecodable_tokens(tokenizer: Any) -> list[int]:
    """Token ids that are lone bytes of a multi-byte UTF-8 character (they decode to U+FFFD on their own).

    The tiny tokenizer's corpus is ASCII, so nothing it learnt needs them; an untrained (or barely trained) model
    emits them as often as any other token and its answers become U+FFFD soup that no smoke test should accept.
    The tiny models' generation config suppresses them (inputs still encode any text: they stay in the vocab).
    """
    return [i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i])]


def build_tiny_causal_lm(
    out_dir: str | os.PathLike[str],
    preset: str = "tiny",
    corpus: Iterable[str] | None = None,
    vocab_size: int = 2048,
    seed: int = 0,
) -> Path:
    """Create tokenizer + randomly initialised MoE model and save them to ``out_dir`` atomically.

    The directory is written under a temporary name and renamed into place, with a completion marker last, so a
    crash never leaves a half-written model that a later run would try to load. Builders of the same directory
    (the first runs of a multi-run backfill on a fresh data root start together) take turns under a file lock:
    the first builds, the others find it complete, and a finished model is never removed from under a reader.
    """
    out = Path(out_dir)
    if (out / COMPLETION_MARKER).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with directory_lock(out):
        if (out / COMPLETION_MARKER).exists():  # built by whoever held the lock before us
            return out
        tokenizer = build_tokenizer(corpus if corpus is not None else default_corpus(), vocab_size=vocab_size)
        torch.manual_seed(seed)
        config = build_model_config(preset, vocab_size=len(tokenizer), tokenizer=tokenizer)
        model = MixtralForCausalLM(config)
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            do_sample=True,
            temperature=0.8,
            top_p=0.95,
            suppress_tokens=undecodable_tokens(tokenizer),
        )

        def fill(tmp: Path) -> None:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            write_portable_configs(tmp)
            (tmp / COMPLETION_MARKER).write_text("ok\n")

        publish_directory(out, fill)
    return out
