"""Reasoning parser for models that think inside ``<think>`` … ``</think>`` (DeepSeek-R1,
Qwen3): the thinking goes to ``reasoning_content``, the rest to ``content``.

Registered as ``deepseek_r1`` and ``qwen3`` in `pkgd.parsers` (vLLM's names). Text with
no tags is all content; an unclosed ``<think>`` (the answer was cut by ``max_tokens``) is
reasoning.
"""

from __future__ import annotations

from typing import Any

from pkgd.parsers.tags import TagSplitter, split_all

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ThinkTagReasoningParser:
    def __init__(self, tokenizer: Any = None) -> None:
        self._stream = TagSplitter(THINK_OPEN, THINK_CLOSE)

    @staticmethod
    def extract(text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole completion; None where empty."""
        content, segments, unclosed = split_all(text, THINK_OPEN, THINK_CLOSE)
        reasoning = "".join(segments) + (unclosed or "")
        if reasoning:
            content = content.lstrip("\n")
        return (reasoning or None), (content or None)

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning delta, content delta) for one streamed text delta."""
        outside, inside, _closed = self._stream.feed(delta)
        return inside, outside

    def flush(self) -> tuple[str, str]:
        """(reasoning, content) held back at the end."""
        outside, inside, _unclosed = self._stream.flush()
        return inside, outside
