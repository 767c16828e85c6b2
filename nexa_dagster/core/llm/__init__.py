"""One way to reach a model: the OpenAI-compatible chat/completions interface, whatever serves it."""

from nexa_dagster.core.llm.base import ChatMessage, Completion, LLMClient, LLMError

__all__ = ["ChatMessage", "Completion", "LLMClient", "LLMError"]
