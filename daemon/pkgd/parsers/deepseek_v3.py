"""DeepSeek-V3 tool calls (``deepseek_v3``; also R1-0528), written with the model's own
tokens::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The arguments stream as written, up to the fence. The V3.1 layout
(``<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>``, no type,
no fence) is read too: what follows ``<｜tool▁sep｜>`` tells them apart.
"""

from __future__ import annotations

from typing import Any

from pkgd.parsers.json_calls import Call
from pkgd.parsers.streaming import CallRegion, MarkedToolParser, skip_space, starts, until

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE_OPEN, FENCE_CLOSE = "```json\n", "\n```"


class _CallsRegion(CallRegion):
    def __init__(self, marker: str, tools: list[dict[str, Any]]) -> None:
        super().__init__(marker, tools)
        self.state = "between"
        self.head = ""  # V3: the call's type; V3.1: its name
        self.args_end = FENCE_CLOSE
        self.call_at = 0

    def scan(self, text: str, final: bool) -> int:
        i = 0
        while i < len(text) and not (self.ended or self.rejected):
            n = getattr(self, f"_{self.state}")(text[i:], i, final)
            if n is None:
                return i
            i += n
        return i

    def _token(self, text: str, tokens: tuple[str, ...], final: bool) -> tuple[int, str | None] | None:
        """After whitespace: (length with the token, token), (0, None) when none follows,
        None while undecided."""
        i = skip_space(text)
        if i == len(text):
            return None if not final else (0, None)
        verdicts = [(starts(text[i:], t), t) for t in tokens]
        for verdict, token in verdicts:
            if verdict:
                return i + len(token), token
        return None if any(v is None for v, _ in verdicts) and not final else (0, None)

    def _between(self, text: str, at: int, final: bool) -> int | None:
        got = self._token(text, (CALL_BEGIN, CALLS_END), final)
        if got is None:
            return None
        n, token = got
        if token == CALL_BEGIN:
            self.state, self.call_at, self.head = "head", self.pos + at + n - len(CALL_BEGIN), ""
        else:  # the calls' end, or text that is not a call
            self.ended = True
            self.rejected = token is None and not self.committed
        return n

    def _head(self, text: str, at: int, final: bool) -> int | None:
        head, found = until(text, SEP, final)
        self.head += head
        if found:
            self.state = "name"
            return len(head) + len(SEP)
        return len(head) or None

    def _name(self, text: str, at: int, final: bool) -> int | None:
        if text.lstrip().startswith("{"):  # V3.1: the head was the name
            self._begin(self.head, CALL_END)
            return 0
        name, found = until(text, "\n", final)
        if not found:
            return None
        self._begin(name, FENCE_CLOSE)
        self.state = "fence"
        return len(name) + 1

    def _begin(self, name: str, args_end: str) -> None:
        self.calls.append(Call(name=name.strip(), has_args=True, start=self.call_at))
        self.args_end, self.state = args_end, "args"

    def _fence(self, text: str, at: int, final: bool) -> int | None:
        verdict = starts(text, FENCE_OPEN)
        if verdict is None and not final:
            return None
        self.state = "args"
        return len(FENCE_OPEN) if verdict else 0

    def _args(self, text: str, at: int, final: bool) -> int | None:
        part, found = until(text, self.args_end, final)
        call = self.calls[-1]
        if part:
            call.pending.append(part)
        if not found:
            return len(part) or None
        if self.args_end == CALL_END:
            call.complete, self.state = True, "between"
        else:
            self.state = "call_end"
        return len(part) + len(self.args_end)

    def _call_end(self, text: str, at: int, final: bool) -> int | None:
        got = self._token(text, (CALL_END,), final)
        if got is None:
            return None
        self.calls[-1].complete, self.state = True, "between"
        return got[0]


class DeepSeekV3ToolParser(MarkedToolParser):
    markers = (CALLS_BEGIN,)

    def new_region(self, marker: str) -> CallRegion:
        return _CallsRegion(marker, self.tools)
