"""Hermes tool-call parser (NousResearch's Hermes 2 Pro format, also Qwen2.5/Qwen3's): the
model writes each call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Registered as ``hermes`` in `pkgd.parsers`. `extract` returns the content outside the
calls and the calls in OpenAI's shape; a block that is not JSON with a ``name``, or a call
left unclosed, stays in the content as text. Streaming: `feed` returns the content delta and
the calls completed by this delta (each call is sent whole once its closing tag arrives).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pkgd.parsers.tags import TagSplitter, split_all

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


def parse_call(block: str) -> dict[str, Any] | None:
    """One ``<tool_call>`` body as an OpenAI tool call, or None when it is not a call."""
    try:
        obj = json.loads(block.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)},
    }


class HermesToolParser:
    def __init__(self, tokenizer: Any = None) -> None:
        self._stream = TagSplitter(CALL_OPEN, CALL_CLOSE)

    @staticmethod
    def extract(text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls) of a whole completion."""
        content, blocks, unclosed = split_all(text, CALL_OPEN, CALL_CLOSE)
        calls = []
        for block in blocks:
            call = parse_call(block)
            if call is None:
                content += f"{CALL_OPEN}{block}{CALL_CLOSE}"
            else:
                calls.append(call)
        if unclosed is not None:
            content += f"{CALL_OPEN}{unclosed}"
        content = content.strip()
        return (content or None), calls

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, tool calls completed by this delta)."""
        outside, _inside, closed = self._stream.feed(delta)
        calls = []
        for block in closed:
            call = parse_call(block)
            if call is None:
                outside += f"{CALL_OPEN}{block}{CALL_CLOSE}"
            else:
                calls.append(call)
        return outside, calls

    def flush(self) -> str:
        """Content held back at the end (an unclosed call comes back as text)."""
        outside, _inside, unclosed = self._stream.flush()
        return outside + (f"{CALL_OPEN}{unclosed}" if unclosed is not None else "")
