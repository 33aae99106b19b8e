"""The streaming core every marker-started tool-call format shares (all but ``hermes``).

A format's calls sit in *regions* that start at a marker (``[TOOL_CALLS]``,
``<｜tool▁calls▁begin｜>``, ``{``, ``[`` ...). `MarkedToolParser` streams the text outside the
regions as content, holding back a tail that could be the start of a marker, and hands each
region's text to the format's `CallRegion`, which consumes what it can parse and records the
calls in it (`pkgd.parsers.json_calls.Call`). The first delta of a call carries its name, later
ones append argument text; calls are numbered across the whole stream.

A region that turns out not to hold a call (``[citation needed]`` for ``pythonic``, a JSON
object without ``name`` for ``llama3_json``) is *rejected* before any of it was sent: its first
character becomes content and the rest is scanned again, so no text is lost. Once a call's
name was sent the region is committed and is never given back. `extract` runs the same
machine over a whole completion; a call the text ends inside (cut by ``max_tokens``) comes
back there as content, as ``hermes`` does.
"""

from __future__ import annotations

import json
import random
import string
import uuid
from typing import Any, ClassVar

from pkgd.parsers.json_calls import Call, CallDelta, ToolCallStream, drain
from pkgd.parsers.tags import partial_suffix


class CallRegion:
    """One region of a format, fed the text after its marker. Subclasses implement `scan`.

    Attributes:
        calls: the calls seen so far, in order.
        ended: the region is over; text after what `scan` consumed is content again.
        rejected: the region holds no call (only set before any call is named).
    """

    def __init__(self, marker: str, tools: list[dict[str, Any]]) -> None:
        self.marker, self.tools = marker, tools
        self.calls: list[Call] = []
        self.ended = self.rejected = False
        self.pos = 0  # characters of the region consumed before the current `scan`

    @property
    def committed(self) -> bool:
        """A call of this region has been (or may now be) sent."""
        return any(c.name is not None for c in self.calls)

    def scan(self, text: str, final: bool) -> int:
        """Consume a prefix of ``text`` (the region's unconsumed text so far) and return its
        length; what is left is offered again with more text. ``final``: no more text comes."""
        raise NotImplementedError


class MarkedToolParser:
    """Streaming tool-call parser over `CallRegion`s: `feed` deltas, `flush` once at the end.

    Subclasses set ``markers`` and `new_region`; ``skip_special_tokens = False`` when the
    format's markers are special tokens the detokenizer must keep (the chat route then sends
    the request with ``skip_special_tokens: false``, as vLLM's ``adjust_request`` does).
    """

    markers: ClassVar[tuple[str, ...]] = ()
    skip_special_tokens: ClassVar[bool] = True

    def __init__(self, tokenizer: Any = None, *, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []
        self._buf = ""
        self._region: CallRegion | None = None
        self._raw: list[str] = []  # the open region's text so far, marker first
        self._num_calls = 0  # calls named in closed regions
        self.cut: tuple[int, str] | None = None  # after flush: (first call, text) the text ended inside

    def new_region(self, marker: str) -> CallRegion:
        raise NotImplementedError

    @staticmethod
    def new_call_id() -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    # ---- streaming -----------------------------------------------------------------------------

    def feed(self, delta: str) -> tuple[str, list[CallDelta]]:
        """(content delta, call deltas; ``index`` counts calls over the whole stream)."""
        self._buf += delta
        return self._run(final=False)

    def flush(self) -> tuple[str, list[CallDelta]]:
        """End of text: what was held back. A region that named no call comes back as
        content; a call the text ends inside stays streamed as a call (its text is in
        ``self.cut``)."""
        content, deltas = self._run(final=True)
        region, raw = self._region, "".join(self._raw)
        if region is None:
            return content, deltas
        self._region = None
        if not region.committed:
            return content + raw + self._buf, deltas
        named = [c for c in region.calls if c.name is not None]
        open_calls = [i for i, c in enumerate(named) if not c.complete]
        if open_calls:
            i = open_calls[0]
            start = 0 if i == 0 else len(region.marker) + named[i].start
            self.cut = (self._num_calls + i, raw[start:] + self._buf)
        return content, deltas

    def _run(self, final: bool) -> tuple[str, list[CallDelta]]:
        content: list[str] = []
        deltas: list[CallDelta] = []
        while True:
            region = self._region
            if region is None:
                if not self._start_region(content, final):
                    return "".join(content), deltas
                continue
            n = region.scan(self._buf, final)
            region.pos += n
            self._raw.append(self._buf[:n])
            self._buf = self._buf[n:]
            if region.rejected:
                raw = "".join(self._raw)
                content.append(raw[0])
                self._buf, self._raw, self._region = raw[1:] + self._buf, [], None
                continue
            if region.committed:
                deltas += drain(region.calls, self._num_calls)
            if not region.ended:
                return "".join(content), deltas
            self._num_calls += sum(c.name is not None for c in region.calls)
            self._region, self._raw = None, []

    def _start_region(self, content: list[str], final: bool) -> bool:
        """Move the content before the next marker to ``content``; open a region at it."""
        buf = self._buf
        found = [(i, m) for m in self.markers if (i := buf.find(m)) != -1]
        if not found:
            hold = 0 if final else max((partial_suffix(buf, m) for m in self.markers), default=0)
            content.append(buf[: len(buf) - hold])
            self._buf = buf[len(buf) - hold :]
            return False
        idx, marker = min(found, key=lambda f: (f[0], -len(f[1])))
        content.append(buf[:idx])
        self._buf, self._raw = buf[idx + len(marker) :], [marker]
        self._region = self.new_region(marker)
        return True

    # ---- whole text ----------------------------------------------------------------------------

    @classmethod
    def extract(cls, text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls in OpenAI's shape) of a whole completion: what streaming it
        gives, less a call the text ends inside (that call's text is content)."""
        p = cls(tools=tools)
        content, deltas = p.feed(text)
        tail, more = p.flush()
        content, deltas = content + tail, deltas + more
        calls: dict[int, dict[str, Any]] = {}
        for d in deltas:
            if d.index not in calls:
                fn = {"name": d.name or "", "arguments": ""}
                calls[d.index] = {"id": cls.new_call_id(), "type": "function", "function": fn}
            calls[d.index]["function"]["arguments"] += d.arguments
        if p.cut is not None:
            calls = {i: c for i, c in calls.items() if i < p.cut[0]}
            content += p.cut[1]
        content = content.strip()
        return (content or None), [calls[i] for i in sorted(calls)]


class JsonCallsRegion(CallRegion):
    """JSON calls, ``{"name": ..., "arguments"|"parameters": {...}}``: one array of them
    (``array=True``, Mistral before v11) or objects separated by ``;`` (Llama 3). A call is
    committed once its name and its arguments key are written, so an object that is not a call
    (``{"name": "Ada", "age": 36}``) comes back as content. ``lead``: the marker is the
    object's ``{``; its first key must then be ``name`` or ``type``, so other JSON and code
    in the content are given back as soon as that is clear."""

    def __init__(self, marker: str, tools: list[dict[str, Any]], *, array: bool, lead: bool = False) -> None:
        super().__init__(marker, tools)
        self.array, self.lead = array, lead
        self.stream: ToolCallStream | None = None
        self.stream_at = self.adopted = 0
        self.head = marker  # a lead object's text while its first key is not known
        self.checked = not lead
        if lead:
            self._open(0).scan(marker)

    @property
    def committed(self) -> bool:
        return any(c.name is not None and c.has_args for c in self.calls)

    def _open(self, at: int) -> ToolCallStream:
        self.stream, self.stream_at, self.adopted = ToolCallStream(array=self.array), at, 0
        return self.stream

    def scan(self, text: str, final: bool) -> int:
        if not self.checked:
            verdict = _first_key(self.head + text)
            if verdict is False:
                self.rejected = True
                return 0
            self.checked, self.head = verdict is True, self.head + text
        i = 0
        while i < len(text):
            if self.stream is None:  # at the start, or after a ";"
                i += skip_space(text[i:])
                if i == len(text):
                    return i
                if text[i] != ("[" if self.array else "{"):
                    self.rejected, self.ended = not self.committed, True
                    return i
                self._open(self.pos + i)
            i += self.stream.scan(text[i:])  # type: ignore[union-attr]
            self._adopt()
            if not self.stream.closed:  # type: ignore[union-attr]
                return i
            if not self.committed:
                self.rejected = True  # a whole object (array) that names no call
                return i
            if self.array:
                self.ended = True
                return i
            j = i + skip_space(text[i:])
            if j == len(text) and not final:
                return i  # a ";" may follow the whitespace
            if j < len(text) and text[j] == ";":
                self.stream, i = None, j + 1
                continue
            self.ended = True
            return i
        return i

    def _adopt(self) -> None:
        """Take the scanner's new calls, their ``start`` made relative to the region."""
        for call in self.stream.calls[self.adopted :]:  # type: ignore[union-attr]
            call.start += self.stream_at
            self.calls.append(call)
        self.adopted = len(self.stream.calls)  # type: ignore[union-attr]


def _first_key(head: str) -> bool | None:
    """Whether the object ``head`` starts (``{`` first) has ``name`` or ``type`` as its first
    key; None while that is not known yet."""
    rest = head[1:].lstrip()
    if not rest:
        return None
    if rest[0] != '"':
        return False
    verdicts = [starts(rest[1:], word) for word in ('name"', 'type"')]
    return True if True in verdicts else (None if None in verdicts else False)


# ---- helpers the regions share ---------------------------------------------------------------


def until(text: str, delim: str, final: bool) -> tuple[str, bool]:
    """(text before ``delim``, whether ``delim`` was found). Not found: the text less a tail
    that could be the start of ``delim`` (all of it when ``final``)."""
    i = text.find(delim)
    if i != -1:
        return text[:i], True
    hold = 0 if final else partial_suffix(text, delim)
    return text[: len(text) - hold], False


def starts(text: str, word: str) -> bool | None:
    """Whether ``text`` starts with ``word``; None while ``text`` is a proper prefix of it."""
    if text.startswith(word):
        return True
    return None if word.startswith(text) else False


def skip_space(text: str) -> int:
    """Length of ``text``'s leading whitespace."""
    return len(text) - len(text.lstrip())


def json_string_body(text: str) -> str:
    """``text`` as it is written inside a JSON string (escaped, without the quotes)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def mistral_call_id() -> str:
    """Mistral's tool call ids: 9 letters and digits (mistral-common refuses others)."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))
