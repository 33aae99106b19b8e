"""Stream tool calls out of JSON text as it is generated: the name once, then argument deltas.

Tool calls arrive as JSON, one object per call, ``{"name": ..., "arguments": {...}}`` (Hermes'
``<tool_call>`` body; ``"parameters"`` is accepted too), or an array of such objects (the
output of ``tool_choice: "required"``). OpenAI and vLLM stream a call as a first delta with
its id and name, then the raw text of its arguments in pieces; `ToolCallStream` produces
exactly that from text deltas, character by character, without waiting for the JSON to close.

Arguments written before the name are held back until the name is known. Arguments written
as a JSON string (``"arguments": "{\\"a\\": 1}"``) are sent decoded, once the string closes.
"""

from __future__ import annotations

import dataclasses
import json

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclasses.dataclass
class CallDelta:
    """New information on call ``index``: its ``name`` the first time it is known, and
    ``arguments`` text appended since the last delta."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclasses.dataclass
class Call:
    """One call being streamed: its ``name`` once known, argument text not sent yet, and
    whether its text is ``complete``; ``start``: where its text starts in the scanned text."""

    name: str | None = None
    name_sent: bool = False
    pending: list[str] = dataclasses.field(default_factory=list)
    has_args: bool = False  # an "arguments"/"parameters" key was written
    complete: bool = False
    start: int = 0


def drain(calls: list[Call], first_index: int = 0) -> list[CallDelta]:
    """The deltas of ``calls`` not sent yet, merged per call; a call is sent once named and
    numbered ``first_index`` + its place among the named calls."""
    out: list[CallDelta] = []
    for i, call in enumerate(c for c in calls if c.name is not None):
        delta = CallDelta(first_index + i)
        if not call.name_sent:
            call.name_sent, delta.name = True, call.name
        if call.pending:
            delta.arguments, call.pending = "".join(call.pending), []
        if delta.name is not None or delta.arguments:
            out.append(delta)
    return out


class ToolCallStream:
    """Feed the text of one JSON call object (``array=False``) or an array of them; text
    after the object (array) closes is not consumed (`scan` says how much was)."""

    def __init__(self, *, array: bool) -> None:
        self.base = 2 if array else 1  # depth inside a call object
        self.depth = 0
        self.in_str = False
        self.esc = False
        self.expect = "key"  # at base depth: key, colon, value, comma
        self.key: str | None = None
        self.buf: list[str] = []  # key or name characters (raw JSON string content)
        self.reading: str | None = None  # "key" / "name" / "args-string" while in such a string
        self.capturing = False  # inside the arguments value (object, array or scalar)
        self.calls: list[Call] = []
        self.pos = 0  # characters consumed
        self.closed = False  # the top-level object (array) closed

    def feed(self, text: str) -> list[CallDelta]:
        """The deltas this text adds, merged per call."""
        self.scan(text)
        return drain(self.calls)

    def scan(self, text: str) -> int:
        """Consume ``text`` up to where the top-level value closes; the count consumed."""
        for n, ch in enumerate(text):
            if self.closed:
                return n
            self._char(ch)
            self.pos += 1
        return len(text)

    # ---- the scanner ---------------------------------------------------------------------------

    def _char(self, ch: str) -> None:
        if self.in_str:
            self._string_char(ch)
            return
        if self.capturing:
            if self.depth == self.base and ch in ",}":
                self.capturing = False  # the arguments value ended; ch is structure
            else:
                self._args(ch)
                if ch in "{[":
                    self.depth += 1
                elif ch in "}]":
                    self.depth -= 1
                elif ch == '"':
                    self.in_str, self.reading = True, None
                return
        if ch.isspace():
            return
        at_base = self.depth == self.base
        if ch == '"':
            self.in_str = True
            self.reading = None
            if at_base and self.expect == "key":
                self.reading, self.buf = "key", []
            elif at_base and self.expect == "value" and self.key == "name":
                self.reading, self.buf = "name", []
            elif at_base and self.expect == "value" and self.key in ARGUMENT_KEYS:
                self.reading, self.buf = "args-string", []
            if at_base and self.expect == "value":
                self.expect = "comma"
            return
        if at_base and self.expect == "value" and self.key in ARGUMENT_KEYS:
            self.expect = "comma"
            self.capturing = True
            self._char(ch)
            return
        if ch in "{[":
            self.depth += 1
            if ch == "{" and self.depth == self.base:
                self.calls.append(Call(start=self.pos))
                self.expect = "key"
            elif self.depth == self.base + 1 and at_base and self.expect == "value":
                self.expect = "comma"
        elif ch in "}]":
            self.depth -= 1
            if at_base and ch == "}" and self.calls:
                self.calls[-1].complete = True
            self.closed = self.depth == 0
        elif at_base and ch == ":" and self.expect == "colon":
            self.expect = "value"
        elif at_base and ch == ",":
            self.expect = "key"
        elif at_base and self.expect == "value":
            self.expect = "comma"  # a scalar value of another key

    def _string_char(self, ch: str) -> None:
        if self.capturing:
            self._args(ch)
        if self.esc:
            self.esc = False
            self.buf.append(ch)
            return
        if ch == "\\":
            self.esc = True
            self.buf.append(ch)
            return
        if ch != '"':
            if self.reading is not None:
                self.buf.append(ch)
            return
        self.in_str = False
        if self.reading is None:
            return
        value = _decode("".join(self.buf))
        if self.reading == "key":
            self.key, self.expect = value, "colon"
            if value in ARGUMENT_KEYS and self.calls:
                self.calls[-1].has_args = True
        elif self.reading == "name" and self.calls:
            self.calls[-1].name = value
        elif self.reading == "args-string" and self.calls:
            self.calls[-1].pending.append(value)
        self.reading = None

    def _args(self, ch: str) -> None:
        if self.calls:
            self.calls[-1].pending.append(ch)


def _decode(raw: str) -> str:
    try:
        return json.loads(f'"{raw}"')
    except ValueError:
        return raw
