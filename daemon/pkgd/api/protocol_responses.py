"""``/v1/responses`` request body (OpenAI's Responses API as vLLM serves it) and its
translation to a chat completion: items in, chat messages out.

Input items become chat-template messages: a string is one user message; ``message`` items
(``input_text`` / ``output_text`` parts) keep their role; ``function_call`` items become an
assistant message's ``tool_calls``; ``function_call_output`` items become ``tool`` messages;
``reasoning`` items (earlier outputs passed back) are dropped, as the chat template has no
place for them. ``instructions`` is a system message in front. Function tools, ``tool_choice``
and ``text.format`` map to the chat request's ``tools``, ``tool_choice`` and
``response_format``, so every rule of the chat endpoint applies unchanged.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, model_validator

from pkgd.api.protocol import INT64_MAX, KnownFieldsModel


class ResponsesRequest(KnownFieldsModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool = False
    truncation: Literal["disabled", "auto"] = "disabled"

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        if self.background:
            raise ValueError("background: true is not supported (responses run while the request is open)")
        if self.truncation != "disabled":
            raise ValueError("truncation: 'auto' is not supported; an input over max_model_len is a 400")
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise ValueError("input must not be empty")
        for tool in self.tools or []:
            if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
                raise ValueError(f"tools: only function tools with a name are supported, got {json.dumps(tool)[:80]}")
        return self

    def text_format(self) -> dict[str, Any]:
        return dict((self.text or {}).get("format") or {"type": "text"})

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The function tools in the chat endpoint's shape."""
        if not self.tools:
            return None
        return [
            {
                "type": "function",
                "function": {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t},
            }
            for t in self.tools
        ]

    def chat_tool_choice(self) -> Any:
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise ValueError(
                    "tool_choice: expected 'none', 'auto', 'required' or {'type': 'function', 'name': ...}"
                )
            return {"type": "function", "function": {"name": choice["name"]}}
        return choice

    def chat_response_format(self) -> dict[str, Any] | None:
        """``text.format`` as the chat endpoint's ``response_format`` (None for plain text)."""
        fmt = self.text_format()
        kind = fmt.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_schema":
            schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
            return {"type": "json_schema", "json_schema": schema}
        return {"type": kind}


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages (OpenAI chat shape) of a Responses ``input`` (module docstring).

    Raises:
        ValueError: an item of an unsupported type or shape, naming its index.
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ValueError(f"input[{i}]: role {role!r} is not one of user, system, developer, assistant")
            messages.append({"role": role, "content": _text_of(item.get("content"), i)})
        elif kind == "function_call":
            call = {
                "id": _field(item, "call_id", i),
                "type": "function",
                "function": {"name": _field(item, "name", i), "arguments": _field(item, "arguments", i)},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, i)
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", i), "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise ValueError(
                f"input[{i}]: items of type {kind!r} are not supported (message, function_call, function_call_output)"
            )
    return messages


def _field(item: dict[str, Any], name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ValueError(f"input[{i}].{name}: expected a string")
    return value


def _text_of(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"input[{i}].content: expected a string or a list of text parts")
    parts = []
    for part in content:
        if (
            not isinstance(part, dict)
            or part.get("type") not in ("input_text", "output_text", "text")
            or not isinstance(part.get("text"), str)
        ):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"input[{i}].content: parts of type {kind!r} are not supported (text only)")
        parts.append(part["text"])
    return "".join(parts)
