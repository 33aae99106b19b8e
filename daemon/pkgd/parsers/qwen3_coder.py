"""Qwen3-Coder tool calls (``qwen3_coder``): XML-style blocks,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

one block per call. A value's first and last newline are layout, not value. Values are text;
each is converted by the type the request's tool schema gives its parameter (``integer``,
``number``, ``boolean``, ``null``, ``object``/``array`` as JSON or a Python literal), and kept
as a string when the schema says ``string``, names no type, or the text does not convert.
String values stream as they are written (a file's content arrives in pieces); others are
sent when their ``</parameter>`` is written. A ``<tool_call>`` not followed by
``<function=`` is content (Hermes-style JSON in the same tags is left to ``hermes``).
"""

from __future__ import annotations

import ast
import json
from typing import Any

from pkgd.parsers.json_calls import Call
from pkgd.parsers.streaming import CallRegion, MarkedToolParser, json_string_body, skip_space, starts, until

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"


def param_types(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """Parameter name -> JSON-schema type of function ``name`` in the request's tools."""
    for tool in tools:
        fn = tool.get("function") or {}
        if fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties") or {}
            return {k: (v or {}).get("type") for k, v in props.items() if isinstance(v, dict)}
    return {}


def convert(text: str, kind: Any) -> Any:
    """A parameter's text as the value its schema type asks for; the text when it does not
    convert (never an error: the model's text is kept)."""
    kinds = kind if isinstance(kind, list) else [kind]
    if "null" in kinds and text.strip() == "null":
        return None
    for k in kinds:
        if k in ("integer", "number"):
            try:
                value = json.loads(text)
            except ValueError:
                continue
            if isinstance(value, int | float) and not isinstance(value, bool):
                return value
        elif k == "boolean" and text.strip().lower() in ("true", "false"):
            return text.strip().lower() == "true"
        elif k in ("object", "array"):
            for parse in (json.loads, ast.literal_eval):
                try:
                    value = parse(text)
                except (ValueError, SyntaxError, TypeError, RecursionError):
                    continue
                if isinstance(value, dict if k == "object" else list):
                    return value
    return text


class _BlockRegion(CallRegion):
    """One ``<tool_call>`` block."""

    def __init__(self, marker: str, tools: list[dict[str, Any]]) -> None:
        super().__init__(marker, tools)
        self.state = "function"
        self.types: dict[str, Any] = {}
        self.kind: Any = None  # the open parameter's type
        self.value: list[str] = []  # a non-string value's text
        self.nparams = 0

    def scan(self, text: str, final: bool) -> int:
        i = 0
        while i < len(text) and not (self.ended or self.rejected):
            n = getattr(self, f"_{self.state}")(text[i:], final)
            if n is None:
                return i  # waits for more text
            i += n
        return i

    def _expect(self, text: str, final: bool, tags: tuple[str, ...]) -> tuple[int, str | None] | None:
        """After whitespace: (length up to and with the tag, the tag), (spaces, None) when
        none of ``tags`` follows, None while undecided."""
        i = skip_space(text)
        verdicts = [(starts(text[i:], t), t) for t in tags] if i < len(text) else [(None, t) for t in tags]
        for verdict, tag in verdicts:
            if verdict:
                return i + len(tag), tag
        if any(v is None for v, _ in verdicts) and not final:
            return None
        return i, None

    def _function(self, text: str, final: bool) -> int | None:
        got = self._expect(text, final, (FUNCTION,))
        if got is not None and got[1] is None:
            self.rejected = True
        if got is None or got[1] is None:
            return None if got is None else 0
        self.state = "name"
        return got[0]

    def _name(self, text: str, final: bool) -> int | None:
        name, found = until(text, ">", final)
        if not found:
            return None
        self.calls.append(Call(name=name.strip(), has_args=True))
        self.types = param_types(self.tools, name.strip())
        self.state = "params"
        return len(name) + 1

    def _params(self, text: str, final: bool) -> int | None:
        got = self._expect(text, final, (PARAM, FUNCTION_END, CALL_CLOSE))
        if got is None:
            return None
        n, tag = got
        call = self.calls[-1]
        if tag == PARAM:
            self.state = "param_name"
        elif tag is not None or final:  # the call is over
            call.pending.append("}" if self.nparams else "{}")
            call.complete = True
            self.state = "close" if tag == FUNCTION_END else self.state
            self.ended = tag == CALL_CLOSE or final
        else:  # text between parameters: not part of any value
            return n + max(1, len(until(text[n:], "<", False)[0]))
        return n

    def _param_name(self, text: str, final: bool) -> int | None:
        name, found = until(text, ">", final)
        if not found:
            return None
        n = len(name) + 1
        name = name.strip()
        self.kind = self.types.get(name)
        self.calls[-1].pending.append(("{" if not self.nparams else ", ") + json.dumps(name, ensure_ascii=False) + ": ")
        self.nparams += 1
        if self._is_string():
            self.calls[-1].pending.append('"')
        self.state = "value_start"
        return n

    def _is_string(self) -> bool:
        return self.kind in (None, "string") or isinstance(self.kind, list) and "string" in self.kind

    def _value_start(self, text: str, final: bool) -> int | None:
        self.state = "value"
        return 1 if text.startswith("\n") else 0

    def _value(self, text: str, final: bool) -> int | None:
        part, found = until(text, PARAM_END, final)
        body = part.removesuffix("\n") if found else part
        if not found and part.endswith("\n") and not final:
            body = part = part[:-1]  # a last newline is layout if </parameter> follows
        call = self.calls[-1]
        if self._is_string():
            call.pending.append(json_string_body(body))
            if found:
                call.pending.append('"')
        else:
            self.value.append(body if found else part)
            if found:
                call.pending.append(json.dumps(convert("".join(self.value), self.kind), ensure_ascii=False))
                self.value = []
        if found:
            self.state = "params"
            return len(part) + len(PARAM_END)
        return len(part) or None

    def _close(self, text: str, final: bool) -> int | None:
        got = self._expect(text, final, (CALL_CLOSE,))
        if got is None:
            return None
        self.ended = True
        return got[0] if got[1] else 0


class Qwen3CoderToolParser(MarkedToolParser):
    markers = (CALL_OPEN,)

    def new_region(self, marker: str) -> CallRegion:
        return _BlockRegion(marker, self.tools)
