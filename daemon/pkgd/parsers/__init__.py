"""Registry of tool-call and reasoning parsers, by name.

The config validator only needs the names, so this module maps each name to the dotted path
of its class and imports nothing heavy; `load_parser` imports a parser when an API server
starts. Register a parser by adding it here (vLLM's ``ToolParserManager`` /
``ReasoningParserManager`` play the same role).

A tool parser class is built per streamed choice as ``cls(tools=...)`` (the request's tools
as dicts) and answers ``feed(delta) -> (content, [CallDelta])``, ``flush() -> (content, [CallDelta])`` and
``cls.extract(text, tools) -> (content, calls)``; ``skip_special_tokens = False`` on the class
makes the chat route keep special tokens in the text. Every parser but ``hermes`` is a
`pkgd.parsers.streaming.MarkedToolParser`.
"""

from __future__ import annotations

import importlib
from typing import Literal

ParserKind = Literal["tool", "reasoning"]

TOOL_PARSERS: dict[str, str] = {
    "deepseek_v3": "pkgd.parsers.deepseek_v3:DeepSeekV3ToolParser",
    "hermes": "pkgd.parsers.hermes:HermesToolParser",
    "llama3_json": "pkgd.parsers.llama3_json:Llama3JsonToolParser",
    "mistral": "pkgd.parsers.mistral:MistralToolParser",
    "pythonic": "pkgd.parsers.pythonic:PythonicToolParser",
    "qwen3_coder": "pkgd.parsers.qwen3_coder:Qwen3CoderToolParser",
}

REASONING_PARSERS: dict[str, str] = {
    "deepseek_r1": "pkgd.parsers.reasoning:ThinkTagReasoningParser",
    "qwen3": "pkgd.parsers.reasoning:ThinkTagReasoningParser",
}


def registered_names(kind: ParserKind) -> list[str]:
    """Names accepted by ``frontend.tool_call_parser`` (``kind="tool"``) or
    ``frontend.reasoning_parser`` (``kind="reasoning"``)."""
    return sorted(TOOL_PARSERS if kind == "tool" else REASONING_PARSERS)


def load_parser(kind: ParserKind, name: str) -> type:
    """Import and return the parser class registered as ``name``.

    Raises:
        KeyError: ``name`` is not registered (the message lists the registered names).
    """
    table = TOOL_PARSERS if kind == "tool" else REASONING_PARSERS
    if name not in table:
        raise KeyError(f"{kind} parser {name!r} is not registered; registered: {', '.join(sorted(table))}")
    module, _, attr = table[name].partition(":")
    return getattr(importlib.import_module(module), attr)
