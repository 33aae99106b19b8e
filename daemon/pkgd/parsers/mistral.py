"""Mistral tool calls (``mistral``), both forms the ``[TOOL_CALLS]`` token starts:

- tokenizers before v11 (Mistral 7B v0.3, Mixtral 8x22B, NeMo): one JSON array,
  ``[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]``;
- v11 and later (Mistral Small 3.2, Magistral, Devstral): one token per call,
  ``[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}`` (v11 wrote the arguments right after the
  name, without ``[ARGS]``; a ``[CALL_ID]id`` before ``[ARGS]`` is skipped).

The form is told from the text (a ``[`` after the token is an array), so one parser serves
every Mistral model. ``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens: the chat route keeps
them in the text (``skip_special_tokens: false``, as vLLM). Call ids are 9 letters and digits,
the only ids Mistral's chat templates accept back.
"""

from __future__ import annotations

import re
from typing import Any

from pkgd.parsers.json_calls import Call
from pkgd.parsers.streaming import (
    CallRegion,
    JsonCallsRegion,
    MarkedToolParser,
    mistral_call_id,
    skip_space,
    starts,
)

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
NAME = re.compile(r"[A-Za-z0-9_.\-]*")


class _NamedCallRegion(CallRegion):
    """``name[ARGS]{...}`` after one ``[TOOL_CALLS]``: the arguments' text streams as written,
    up to the ``}`` that closes them."""

    def __init__(self, marker: str, tools: list[dict[str, Any]]) -> None:
        super().__init__(marker, tools)
        self.state = "name"
        self.name = ""
        self.depth, self.in_str, self.esc = 0, False, False

    def scan(self, text: str, final: bool) -> int:
        i = 0
        while i < len(text) and not (self.ended or self.rejected):
            if self.state == "args":
                i += self._args(text[i:])
                continue
            rest = text[i:]
            if self.state == "call_id":  # skip the id up to [ARGS]
                j = rest.find(ARGS)
                if j == -1:
                    return i + max(0, len(rest) - len(ARGS))
                self._begin()
                i += j + len(ARGS)
                continue
            m = NAME.match(rest)
            word = m.group() if m else ""
            self.name += word
            i += len(word)
            rest = rest[len(word) :]
            if not rest:
                return i
            if rest[0] == "{":
                self._begin()
                continue
            verdicts = {word: starts(rest, word) for word in (ARGS, CALL_ID)}
            if None in verdicts.values() and not final:
                return i
            if verdicts[ARGS]:
                self._begin()
                i += len(ARGS)
            elif verdicts[CALL_ID]:
                self.state, i = "call_id", i + len(CALL_ID)
            else:
                self.rejected = True
        return i

    def _begin(self) -> None:
        if not self.name:
            self.rejected = True
            return
        self.calls.append(Call(name=self.name, has_args=True))
        self.state = "args"

    def _args(self, text: str) -> int:
        """Pass the arguments' JSON through, tracking depth; end after its last ``}``."""
        call = self.calls[-1]
        for n, ch in enumerate(text):
            if self.depth == 0 and ch.isspace():
                continue
            if self.depth == 0 and ch != "{":
                self.ended = call.complete = True  # not JSON: the call ends with no arguments
                call.pending.append("{}")
                return n
            call.pending.append(ch)
            if self.in_str:
                self.esc, self.in_str = (False, True) if self.esc else (ch == "\\", ch != '"')
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.ended = call.complete = True
                    return n + 1
        return len(text)


class MistralToolParser(MarkedToolParser):
    markers = (TOOL_CALLS,)
    skip_special_tokens = False

    new_call_id = staticmethod(mistral_call_id)

    def new_region(self, marker: str) -> CallRegion:
        return _FormRegion(marker, self.tools)


class _FormRegion(CallRegion):
    """Tells the two forms apart at the first character after ``[TOOL_CALLS]``, then hands
    the text to that form's region."""

    def __init__(self, marker: str, tools: list[dict[str, Any]]) -> None:
        super().__init__(marker, tools)
        self.inner: CallRegion | None = None

    def scan(self, text: str, final: bool) -> int:
        i = 0
        if self.inner is None:
            i = skip_space(text)
            if i == len(text):
                self.rejected = final
                return 0
            array = text[i] == "["
            self.inner = (
                JsonCallsRegion(self.marker, self.tools, array=True)
                if array
                else _NamedCallRegion(self.marker, self.tools)
            )
        self.inner.pos = self.pos + i
        n = self.inner.scan(text[i:], final)
        self.calls, self.ended, self.rejected = self.inner.calls, self.inner.ended, self.inner.rejected
        return i + n

    @property
    def committed(self) -> bool:
        return self.inner is not None and self.inner.committed
