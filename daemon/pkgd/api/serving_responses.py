"""``POST /v1/responses`` and ``GET /v1/responses/{id}``: OpenAI's Responses API as a
translation layer over the chat endpoint.

A request becomes a `ChatCompletionRequest` (`pkgd.api.protocol_responses`), which the chat
endpoint serves exactly as if a client had sent it (chat template, tool-call and reasoning
parsers, limits, errors); its answer, a chat completion or a chat chunk stream, is translated
into a response object or the Responses events (`pkgd.api.responses_events`). The chat
endpoint's OpenAI-shaped output is the only interface, so the two endpoints cannot drift.

``store`` defaults to false (as vLLM serves it). With ``frontend.responses_store_size > 0``
a response stored with ``store: true`` can be continued with ``previous_response_id`` and
read back with ``GET /v1/responses/{id}`` on the same API server (`pkgd.api.responses_store`);
otherwise ``store: true`` is answered with ``store: false`` and ``previous_response_id`` is a
400.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any, cast

import pydantic
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from pkgd import log
from pkgd.api import serving
from pkgd.api.errors import APIError
from pkgd.api.preprocess import check_limits, parse_body
from pkgd.api.protocol import ChatCompletionRequest
from pkgd.api.protocol_responses import ResponsesRequest, input_messages
from pkgd.api.responses_events import EventTranslator, ResponseBuilder, new_id, output_of_message
from pkgd.api.serving_chat import create_chat_completion, render_in_worker

if TYPE_CHECKING:
    from pkgd.api.state import ServerState

logger = log.get_logger(__name__)

# Chat request fields as the Responses request names them, for error messages (longest first:
# a json_schema's fields sit directly in text.format).
_FIELD_NAMES = {
    "response_format.json_schema": "text.format",
    "response_format": "text.format",
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
}


async def create_response(request: Request, state: ServerState) -> Any:
    """Answer one Responses request. Parsing, the translation to chat (and the chat endpoint's
    own template, tokenization and constraint check) and the translation of a whole answer
    run on the `Preprocessor`, never on the event loop."""
    state.check_ready()
    raw = await request.body()
    parsed = await state.preprocess.parse_large(raw, ResponsesRequest, state.config.frontend.limits)
    body, conversation, chat_body, builder = await state.preprocess.run(_prepare, state, raw, parsed)
    try:
        # a large body's chat prompt is templated and tokenized in the worker process too
        rendered = (
            await state.preprocess.run_isolated(render_in_worker, chat_body, serving.max_model_len(state))
            if parsed is not None
            else None
        )
        # Refusals (400s) come out of this call; a stream starts generating only when iterated.
        answer = await create_chat_completion(request, state, parsed=chat_body, rendered=rendered)
    except APIError as exc:
        raise _renamed(exc) from None
    if body.stream:
        events = _stream(answer, state, builder, conversation if body.store else None)
        return StreamingResponse(events, media_type="text/event-stream", headers=serving.SSE_HEADERS)
    if answer.status_code != 200:  # the client went away (499)
        return answer
    response = await state.preprocess.run(_finish, state, builder, bytes(answer.body))
    if body.store:
        state.responses.put(response, conversation + _assistant_messages(response["output"]))
    return JSONResponse(response)


def _prepare(
    state: ServerState, raw: bytes, parsed: ResponsesRequest | None = None
) -> tuple[ResponsesRequest, list[dict[str, Any]], ChatCompletionRequest, ResponseBuilder]:
    """Parse a Responses request (unless ``parsed``) and translate it to the chat request it
    is (on the `Preprocessor`); the conversation with its history is held to
    ``frontend.limits`` too."""
    limits = state.config.frontend.limits
    body = parsed if parsed is not None else parse_body(raw, ResponsesRequest, limits)
    model = state.resolve_model(body.model)
    serving.require_runner(state, "generate", "Responses API")
    conversation = _history(body, state) + _new_input(body)
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    try:
        check_limits({"messages": messages}, limits)
    except APIError as exc:
        raise _renamed(exc) from None
    chat_body = _chat_request(body, model, messages)
    builder = ResponseBuilder(new_id("resp"), model, _echo(body, stored=body.store and state.responses.enabled))
    return body, conversation, chat_body, builder


def _finish(state: ServerState, builder: ResponseBuilder, chat_json: bytes) -> dict[str, Any]:
    """The response object of a whole chat completion (on the `Preprocessor`)."""
    chat = json.loads(chat_json)
    choice = chat["choices"][0]
    builder.output = output_of_message(choice["message"])
    builder.finish(
        choice.get("finish_reason"),
        chat.get("usage"),
        _reasoning_tokens(state, choice["message"].get("reasoning_content")),
    )
    return builder.to_dict()


async def retrieve_response(response_id: str, state: ServerState) -> Any:
    stored = state.responses.get(response_id)
    if stored is None:
        raise APIError(404, f"no stored response with id {response_id!r} on this API server", param="response_id")
    return JSONResponse(stored.response)


def _history(body: ResponsesRequest, state: ServerState) -> list[dict[str, Any]]:
    rid = body.previous_response_id
    if rid is None:
        return []
    if not state.responses.enabled:
        raise APIError(
            400,
            "previous_response_id needs stored responses, which are off "
            "(frontend.responses_store_size: 0); send the whole conversation as input",
            param="previous_response_id",
        )
    stored = state.responses.get(rid)
    if stored is None:
        raise APIError(
            400,
            f"previous response {rid!r} is not stored on this API server "
            "(never stored, evicted, or stored by another API server)",
            param="previous_response_id",
        )
    return list(stored.conversation)


def _new_input(body: ResponsesRequest) -> list[dict[str, Any]]:
    try:
        return input_messages(body.input)
    except ValueError as exc:
        raise APIError(400, str(exc), param="input") from None


def _chat_request(body: ResponsesRequest, model: str, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion this response is; a field the chat endpoint refuses is a 400 under
    its Responses name (e.g. ``text.format`` while structured outputs are unavailable)."""
    try:
        fields: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "max_completion_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "stream": body.stream,
            "tools": body.chat_tools(),
            "parallel_tool_calls": body.parallel_tool_calls,
            "user": body.user,
        }
        if body.stream:
            fields["stream_options"] = {"include_usage": True}
        if body.tools and "tool_choice" in body.model_fields_set:
            fields["tool_choice"] = body.chat_tool_choice()
        fmt = body.chat_response_format()
        if fmt is not None:
            fields["response_format"] = fmt
        return ChatCompletionRequest.model_validate(fields)
    except ValueError as exc:  # pydantic.ValidationError is one
        raise _as_api_error(exc) from None


def _as_api_error(exc: ValueError) -> APIError:
    if not isinstance(exc, pydantic.ValidationError):
        return APIError(400, str(exc))
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ())]
    field = _FIELD_NAMES.get(loc[0], loc[0]) if loc else None
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    for chat_name, name in _FIELD_NAMES.items():
        if chat_name in msg:
            msg, field = msg.replace(chat_name, name), field or name
    return APIError(400, msg if not loc else f"{field}: {msg}", param=field)


def _renamed(exc: APIError) -> APIError:
    """A chat refusal under the Responses request's field names."""
    message, param = exc.message, exc.param
    for chat_name, name in _FIELD_NAMES.items():
        message = message.replace(chat_name, name)
        param = param.replace(chat_name, name) if param else param
    return APIError(exc.status, message, param=param, code=exc.code)


def _echo(body: ResponsesRequest, *, stored: bool) -> dict[str, Any]:
    """The request fields a response object repeats."""
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature if body.temperature is not None else 1.0,
        "top_p": body.top_p if body.top_p is not None else 1.0,
        "tools": [{"strict": None, "description": None, "parameters": None, **t} for t in body.tools or []],
        "tool_choice": body.tool_choice,
        "parallel_tool_calls": body.parallel_tool_calls,
        "text": {"format": body.text_format()},
        "truncation": body.truncation,
        "metadata": body.metadata or {},
        "previous_response_id": body.previous_response_id,
        "store": stored,
        "background": False,
        "user": body.user,
    }


def _reasoning_tokens(state: ServerState, text: str | None) -> int:
    tok = state.llm.tokenizer
    return len(tok.encode(text, add_special_tokens=False)) if text and tok is not None else 0


def _assistant_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the chat messages that continue its conversation."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [
        {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
        for i in output
        if i["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]


async def _stream(
    answer: StreamingResponse, state: ServerState, builder: ResponseBuilder, conversation: list[dict[str, Any]] | None
) -> AsyncIterator[str]:
    """The Responses events of a streamed chat completion, as SSE (``event:`` and ``data:``)."""
    translator = EventTranslator(builder, lambda text: _reasoning_tokens(state, text))
    for event in translator.start():
        yield _sse(event)
    # the chat completion's own SSE generator (starlette types it as any async iterable)
    body = cast("AsyncGenerator[str | bytes, None]", answer.body_iterator)
    try:
        async with contextlib.aclosing(body) as chunks:  # closing it aborts the engine request
            async for frame in chunks:
                data = (frame if isinstance(frame, str) else frame.decode()).strip().removeprefix("data: ")
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:  # the engine failed mid-stream (pkgd.api.errors.sse_error)
                    status = 400 if chunk["error"].get("type") == "invalid_request_error" else 500
                    for event in translator.fail(status, chunk["error"]["message"]):
                        yield _sse(event)
                    return
                for event in translator.chunk(chunk):
                    yield _sse(event)
        events = list(translator.end())
    except Exception as exc:  # a bug translating: the stream still ends with its reason
        logger.exception("stream_failed")
        for event in translator.fail(500, f"internal error: {type(exc).__name__}: {exc}"):
            yield _sse(event)
        return
    for event in events:
        yield _sse(event)
    if conversation is not None and state.responses.enabled:
        response = builder.to_dict()
        state.responses.put(response, conversation + _assistant_messages(response["output"]))


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
