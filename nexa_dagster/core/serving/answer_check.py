"""Is a model's answer text? A smoke test that accepts any bytes passes a model that emits U+FFFD soup.

A byte-level tokenizer can emit tokens that are lone bytes of a multi-byte UTF-8 character; decoded on their own
they become U+FFFD (the replacement character). A model that has learnt nothing emits many of them; a sound model
emits text. The bar: a non-empty answer, mostly letters/digits/punctuation/spaces, at most ``max_garbage_share`` of
its characters replacement or control characters, and at least one letter.
"""

from __future__ import annotations

import unicodedata

REPLACEMENT = "\ufffd"
MAX_GARBAGE_SHARE = 0.2


def text_problem(answer: str, max_garbage_share: float = MAX_GARBAGE_SHARE) -> str | None:
    """``None`` when ``answer`` reads as text, else why not (one line, quoting the start of the answer)."""
    stripped = answer.strip()
    if not stripped:
        return "the answer is empty"
    garbage = sum(
        1
        for ch in stripped
        if ch == REPLACEMENT or (unicodedata.category(ch) in ("Cc", "Cs", "Co", "Cn") and ch not in "\n\t\r")
    )
    share = garbage / len(stripped)
    if share > max_garbage_share:
        return (
            f"the answer does not decode to text: {garbage} of its {len(stripped)} characters are U+FFFD or "
            f"control characters (more than {max_garbage_share:.0%}): {stripped[:60]!r}"
        )
    if not any(ch.isalpha() for ch in stripped):
        return f"the answer has no letter: {stripped[:60]!r}"
    return None
