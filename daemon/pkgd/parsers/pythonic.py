"""Pythonic tool calls (``pythonic``; Llama 3.2/4 and many fine-tunes): the model writes a
Python list of calls with keyword arguments, ``[get_weather(city="Paris"), get_time()]``,
Llama 4 between ``<|python_start|>`` and ``<|python_end|>``.

A ``[`` starts a list only when a name and ``(`` follow and the call's first argument is a
keyword (or it has none): ``[1]``, ``[link](url)`` or ``[print("x")]`` stay content. Argument
values are Python literals (strings, numbers, ``True``/``False``/``None``, lists, dicts),
sent as JSON; a value that is not a literal is sent as its source text. Arguments stream one
at a time: ``{"city": `` when the keyword is written, the value when it ends, ``}`` at ``)``.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from pkgd.parsers.json_calls import Call
from pkgd.parsers.streaming import CallRegion, MarkedToolParser, skip_space, starts

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
CLOSERS = {"(": ")", "[": "]", "{": "}"}


def _ident_char(ch: str) -> bool:
    return ch.isalnum() or ch in "_."


class _ListRegion(CallRegion):
    def __init__(self, marker: str, tools: list[dict[str, Any]]) -> None:
        super().__init__(marker, tools)
        self.state = "open" if marker == PYTHON_START else "name"
        self.word = ""  # the name or keyword being read
        self.name, self.start = "", 0  # the call being read: its name, where its text starts
        self.call: Call | None = None  # the call whose arguments are being read
        self.value: list[str] = []
        self.nest: list[str] = []  # brackets open in the value
        self.quote = ""  # the open string's quote
        self.esc = False

    def scan(self, text: str, final: bool) -> int:
        i = 0
        while i < len(text) and not (self.ended or self.rejected):
            if self.state == "end":  # after the list: Llama 4's <|python_end|>
                j = i + skip_space(text[i:])
                verdict = starts(text[j:], PYTHON_END) if j < len(text) else None
                if verdict is None and not final:
                    return i
                self.ended = True
                return j + len(PYTHON_END) if verdict else i
            if self.state == "value":
                i += self._value(text[i:])
                continue
            getattr(self, f"_{self.state}")(text[i], self.pos + i)
            if self.ended and self.state != "end":
                return i  # the character that ended a malformed list is content
            i += 1
        return i

    def _refuse(self) -> None:
        """Malformed: not a call list (nothing sent yet), or the list ends here."""
        if self.committed:
            self.ended = True
        else:
            self.rejected = True

    def _open(self, ch: str, at: int) -> None:
        if ch == "[":
            self.state = "name"
        elif not ch.isspace():
            self._refuse()

    def _name(self, ch: str, at: int) -> None:
        if _ident_char(ch) and (self.word or not ch.isdigit()):
            if not self.word:
                self.start = at
            self.word += ch
        elif ch == "(" and self.word:
            self.name, self.word, self.state = self.word, "", "key"
        elif not (ch.isspace() and not self.word):
            self._refuse()

    def _key(self, ch: str, at: int) -> None:
        if _ident_char(ch):
            self.word += ch
        elif ch == "=" and self.word:
            first = self.call is None
            if self.call is None:
                self.call = Call(name=self.name, has_args=True, start=self.start)
                self.calls.append(self.call)
            self.call.pending.append(("{" if first else ", ") + json.dumps(self.word) + ": ")
            self.word, self.state = "", "value"
        elif ch == ")" and not self.word and self.call is None:
            self.calls.append(Call(name=self.name, has_args=True, pending=["{}"], complete=True, start=self.start))
            self.state = "next"
        elif not (ch.isspace() and not self.word):
            self._refuse()

    def _next(self, ch: str, at: int) -> None:
        if ch == ",":
            self.state = "name"
        elif ch == "]":
            self.state = "end"
            self.ended = self.marker != PYTHON_START
        elif not ch.isspace():
            self._refuse()

    def _value(self, text: str) -> int:
        """Read a keyword's value up to the ``,`` or ``)`` that ends it; send it then."""
        for n, ch in enumerate(text):
            if self.quote:
                self.esc, closes = (False, False) if self.esc else (ch == "\\", ch == self.quote)
                self.quote = "" if closes else self.quote
            elif ch in "\"'":
                self.quote = ch
            elif ch in CLOSERS:
                self.nest.append(CLOSERS[ch])
            elif self.nest and ch == self.nest[-1]:
                self.nest.pop()
            elif not self.nest and ch in ",)":
                self._send_value(closes_call=ch == ")")
                return n + 1
            self.value.append(ch)
        return len(text)

    def _send_value(self, *, closes_call: bool) -> None:
        call, source = self.call, "".join(self.value).strip()
        self.value = []
        try:
            value = ast.literal_eval(source)
            arg = json.dumps(value, ensure_ascii=False)
        except (ValueError, SyntaxError, TypeError, RecursionError):
            arg = json.dumps(source, ensure_ascii=False)
        call.pending.append(arg)  # type: ignore[union-attr]
        if closes_call:
            call.pending.append("}")  # type: ignore[union-attr]
            call.complete = True  # type: ignore[union-attr]
            self.call, self.state = None, "next"
        else:
            self.state = "key"


class PythonicToolParser(MarkedToolParser):
    markers = (PYTHON_START, "[")

    def new_region(self, marker: str) -> CallRegion:
        return _ListRegion(marker, self.tools)
