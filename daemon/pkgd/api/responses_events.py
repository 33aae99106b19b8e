"""Chat completion output -> Responses API objects: output items, the response object, and
the streaming events (``openai.types.responses``' shapes).

A chat message becomes up to three kinds of output item, in this order: ``reasoning`` (the
reasoning parser's ``reasoning_content``), ``message`` (its text as one ``output_text``
part), ``function_call`` (one per tool call). `EventTranslator` turns a chat chunk stream into
the documented event sequence::

    response.created, response.in_progress,
    per item: response.output_item.added,
      message:   response.content_part.added, response.output_text.delta*, response.output_text.done,
                 response.content_part.done
      reasoning: response.content_part.added, response.reasoning_text.delta*, response.reasoning_text.done,
                 response.content_part.done
      call:      response.function_call_arguments.delta*, response.function_call_arguments.done
    response.output_item.done; finally response.completed

A text or reasoning item is closed when the next item opens; function calls when the stream
ends. Every event carries a ``sequence_number`` counting from 0. A response cut short by
``max_output_tokens`` completes with ``status: incomplete`` (as vLLM; the SDK's stream
helper expects ``response.completed``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """The response object of one request (``base`` fields echo the request)."""

    def __init__(self, rid: str, model: str, base: dict[str, Any]) -> None:
        self.id = rid
        self.created_at = int(time.time())
        self.model = model
        self.base = base
        self.output: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.incomplete_details: dict[str, Any] | None = None

    def finish(self, finish_reason: str | None, usage: dict[str, Any] | None, reasoning_tokens: int = 0) -> None:
        """Set the final status (``incomplete`` when cut at ``max_output_tokens``) and usage."""
        self.status = "incomplete" if finish_reason == "length" else "completed"
        if self.status == "incomplete":
            self.incomplete_details = {"reason": "max_output_tokens"}
        if usage is not None:
            self.usage = response_usage(usage, reasoning_tokens)

    def to_dict(self, *, with_output: bool = True) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "status": self.status,
            "output": list(self.output) if with_output else [],
            "error": self.error,
            "incomplete_details": self.incomplete_details,
            "usage": self.usage,
            **self.base,
        }


def response_usage(chat_usage: dict[str, Any], reasoning_tokens: int = 0) -> dict[str, Any]:
    """Chat ``usage`` in the Responses API's shape. ``cached_tokens`` is the chat usage's
    ``prompt_tokens_details.cached_tokens`` when it reports one, else 0."""
    details = chat_usage.get("prompt_tokens_details") or {}
    prompt, completion = chat_usage.get("prompt_tokens", 0), chat_usage.get("completion_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": details.get("cached_tokens") or 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt + completion,
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [] if status == "in_progress" else [text_part(text)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_of_message(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The output items of one (non-streamed) chat message."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(message_item(new_id("msg"), message.get("content") or ""))
    for tc in calls:
        fn = tc["function"]
        items.append(call_item(new_id("fc"), tc["id"], fn["name"], fn.get("arguments") or ""))
    return items


class _Open:
    """An output item being streamed."""

    def __init__(self, index: int, kind: str, item_id: str, call_id: str = "", name: str = "") -> None:
        self.index, self.kind, self.id = index, kind, item_id
        self.call_id, self.name = call_id, name
        self.text = ""
        self.closed = False


class EventTranslator:
    """Chat chunks (parsed JSON) -> Responses events (dicts with ``type``), see the module
    docstring. Feed `start`, then `chunk` for each chat chunk, then `end`."""

    def __init__(self, builder: ResponseBuilder, count_tokens: Any = None) -> None:
        self.builder = builder
        self.count_tokens = count_tokens  # text -> tokens, for usage's reasoning_tokens
        self.seq = 0
        self.items: list[_Open] = []
        self.current: _Open | None = None  # the open text or reasoning item
        self.calls: dict[int, _Open] = {}  # chat tool-call index -> its item
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def start(self) -> Iterator[dict[str, Any]]:
        for kind in ("response.created", "response.in_progress"):
            yield self._event(kind, response=self.builder.to_dict())

    def chunk(self, chunk: dict[str, Any]) -> Iterator[dict[str, Any]]:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                yield from self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                yield from self._text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                yield from self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def end(self) -> Iterator[dict[str, Any]]:
        if not self.items:  # an empty answer is still one (empty) message
            yield from self._open_text("message")
        for item in self.items:
            yield from self._close(item)
        self.builder.output = [self._final(item) for item in self.items]
        reasoning = "".join(i.text for i in self.items if i.kind == "reasoning")
        self.builder.finish(
            self.finish_reason, self.usage, self.count_tokens(reasoning) if reasoning and self.count_tokens else 0
        )
        yield self._event("response.completed", response=self.builder.to_dict())

    def fail(self, status: int, message: str) -> Iterator[dict[str, Any]]:
        """An engine failure mid-stream: an ``error`` event, then ``response.failed``."""
        code = "server_error" if status >= 500 else "invalid_request_error"
        yield self._event("error", code=code, message=message, param=None)
        self.builder.status, self.builder.error = "failed", {"code": code, "message": message}
        self.builder.output = [self._final(item) for item in self.items]
        yield self._event("response.failed", response=self.builder.to_dict())

    # ---- items -------------------------------------------------------------------------

    def _text(self, kind: str, delta: str) -> Iterator[dict[str, Any]]:
        if self.current is None or self.current.kind != kind:
            yield from self._open_text(kind)
        item = self.current
        assert item is not None  # _open_text sets it
        item.text += delta
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        yield self._event(name, item_id=item.id, output_index=item.index, content_index=0, delta=delta, **extra)

    def _open_text(self, kind: str) -> Iterator[dict[str, Any]]:
        if self.current is not None:
            yield from self._close(self.current)
        item = _Open(len(self.items), kind, new_id("msg" if kind == "message" else "rs"))
        self.items.append(item)
        self.current = item
        blank = (
            message_item(item.id, "", "in_progress")
            if kind == "message"
            else reasoning_item(item.id, "", "in_progress")
        )
        yield self._event("response.output_item.added", output_index=item.index, item=blank)
        yield self._event(
            "response.content_part.added",
            item_id=item.id,
            output_index=item.index,
            content_index=0,
            part=self._part(item, ""),
        )

    def _call(self, call: dict[str, Any]) -> Iterator[dict[str, Any]]:
        fn = call.get("function") or {}
        index = call.get("index", len(self.calls))
        item = self.calls.get(index)
        if item is None:
            if self.current is not None:
                yield from self._close(self.current)
                self.current = None
            item = _Open(len(self.items), "call", new_id("fc"), call.get("id") or new_id("call"), fn.get("name") or "")
            self.items.append(item)
            self.calls[index] = item
            yield self._event(
                "response.output_item.added",
                output_index=item.index,
                item=call_item(item.id, item.call_id, item.name, "", "in_progress"),
            )
        if fn.get("arguments"):
            item.text += fn["arguments"]
            yield self._event(
                "response.function_call_arguments.delta",
                item_id=item.id,
                output_index=item.index,
                delta=fn["arguments"],
            )

    def _close(self, item: _Open) -> Iterator[dict[str, Any]]:
        if item.closed:
            return
        item.closed = True
        if item.kind == "call":
            yield self._event(
                "response.function_call_arguments.done",
                item_id=item.id,
                output_index=item.index,
                arguments=item.text,
                name=item.name,
            )
        else:
            done = "response.output_text.done" if item.kind == "message" else "response.reasoning_text.done"
            extra: dict[str, Any] = {"logprobs": []} if item.kind == "message" else {}
            yield self._event(done, item_id=item.id, output_index=item.index, content_index=0, text=item.text, **extra)
            yield self._event(
                "response.content_part.done",
                item_id=item.id,
                output_index=item.index,
                content_index=0,
                part=self._part(item, item.text),
            )
        yield self._event("response.output_item.done", output_index=item.index, item=self._final(item))

    @staticmethod
    def _part(item: _Open, text: str) -> dict[str, Any]:
        return text_part(text) if item.kind == "message" else {"type": "reasoning_text", "text": text}

    @staticmethod
    def _final(item: _Open) -> dict[str, Any]:
        status = "completed" if item.closed else "incomplete"
        if item.kind == "message":
            return message_item(item.id, item.text, status)
        if item.kind == "reasoning":
            return reasoning_item(item.id, item.text, status)
        return call_item(item.id, item.call_id, item.name, item.text, status)
