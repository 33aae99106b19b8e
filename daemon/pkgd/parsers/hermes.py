"""Hermes tool-call parser (NousResearch's Hermes 2 Pro format, also Qwen2.5/Qwen3's): the
model writes each call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Registered as ``hermes`` in `pkgd.parsers`. `extract` returns the content outside the
calls and the calls in OpenAI's shape; a block that is not JSON with a ``name``, or a call
left unclosed, stays in the content as text. Streaming: `feed` returns the content delta and
`CallDelta`s (`pkgd.parsers.json_calls`): a call's name as soon as it is written, then its
arguments piece by piece, as OpenAI streams them. A block that turns out to name no call comes
back as content when it closes.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pkgd.parsers.json_calls import CallDelta, ToolCallStream
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
        "function": {
            "name": obj["name"],
            "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
        },
    }


class HermesToolParser:
    """``tools``: the request's tools; unused, Hermes calls carry their arguments as JSON."""

    def __init__(self, tokenizer: Any = None, *, tools: list[dict[str, Any]] | None = None) -> None:
        self._stream = TagSplitter(CALL_OPEN, CALL_CLOSE)
        self._block: ToolCallStream | None = None  # the open <tool_call> block's scanner
        self._block_text: list[str] = []
        self._num_calls = 0  # calls streamed in earlier blocks

    @staticmethod
    def extract(text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str | None, list[dict[str, Any]]]:
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

    def feed(self, delta: str) -> tuple[str, list[CallDelta]]:
        """(content delta, call deltas; ``index`` counts calls over the whole stream)."""
        outside, inside, closed = self._stream.feed(delta)
        deltas: list[CallDelta] = []
        consumed = 0  # of ``inside``: the text of the blocks closed by this delta
        for segment in closed:
            new = segment[len("".join(self._block_text)) :] if self._block is not None else segment
            consumed += len(new)
            if new:
                deltas += self._feed_block(new)
            outside += self._close_block()
        if inside[consumed:]:
            deltas += self._feed_block(inside[consumed:])
        return outside, deltas

    def _feed_block(self, text: str) -> list[CallDelta]:
        if self._block is None:
            self._block, self._block_text = ToolCallStream(array=False), []
        self._block_text.append(text)
        out = self._block.feed(text)
        for d in out:
            d.index += self._num_calls
        return out

    def _close_block(self) -> str:
        """End the open block; its text when it named no call (it was not a call)."""
        block, text = self._block, "".join(self._block_text)
        self._block, self._block_text = None, []
        if block is None or not block.calls or block.calls[0].name is None:
            return f"{CALL_OPEN}{text}{CALL_CLOSE}"
        self._num_calls += len(block.calls)
        return ""

    def flush(self) -> tuple[str, list[CallDelta]]:
        """(content held back at the end, no call deltas: every delta went out with `feed`).
        An unclosed block that named no call comes back as text."""
        outside, _inside, unclosed = self._stream.flush()
        if unclosed is None:
            return outside, []
        block = self._block
        if block is not None and block.calls and block.calls[0].name is not None:
            return outside, []  # streamed as a call already (cut by max_tokens)
        return outside + f"{CALL_OPEN}{unclosed}", []
