"""Split generated text at an open/close tag pair, whole or as a stream of deltas.

Used by the tool-call parser (``<tool_call>`` … ``</tool_call>``) and the reasoning parser
(``<think>`` … ``</think>``). The streaming splitter holds back a tail that could be the start
of a tag, so a tag split across two deltas never leaks out as text.
"""

from __future__ import annotations


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class TagSplitter:
    """Streaming splitter: `feed` text deltas, then `flush` once at the end."""

    def __init__(self, open_tag: str, close_tag: str) -> None:
        self.open_tag, self.close_tag = open_tag, close_tag
        self.inside = False
        self._buf = ""
        self._segment: list[str] = []  # text of the open segment so far

    def feed(self, delta: str) -> tuple[str, str, list[str]]:
        """Returns (text outside tags, text inside tags, segments this delta closed)."""
        self._buf += delta
        outside: list[str] = []
        inside: list[str] = []
        closed: list[str] = []
        while True:
            tag = self.close_tag if self.inside else self.open_tag
            idx = self._buf.find(tag)
            if idx == -1:
                cut = len(self._buf) - partial_suffix(self._buf, tag)
                self._emit(self._buf[:cut], outside, inside)
                self._buf = self._buf[cut:]
                return "".join(outside), "".join(inside), closed
            self._emit(self._buf[:idx], outside, inside)
            if self.inside:
                closed.append("".join(self._segment))
                self._segment = []
            self._buf = self._buf[idx + len(tag) :]
            self.inside = not self.inside

    def _emit(self, text: str, outside: list[str], inside: list[str]) -> None:
        if self.inside:
            inside.append(text)
            self._segment.append(text)
        else:
            outside.append(text)

    def flush(self) -> tuple[str, str, str | None]:
        """End of text: (held-back outside tail, held-back inside tail, the whole unclosed
        segment or None when every tag was closed)."""
        tail, self._buf = self._buf, ""
        if not self.inside:
            return tail, "", None
        self._segment.append(tail)
        return "", tail, "".join(self._segment)


def split_all(text: str, open_tag: str, close_tag: str) -> tuple[str, list[str], str | None]:
    """Whole-text split: (text outside the tags, closed segments, unclosed last segment or
    None)."""
    s = TagSplitter(open_tag, close_tag)
    outside, _inside, closed = s.feed(text)
    tail, _in_tail, unclosed = s.flush()
    return outside + tail, closed, unclosed
