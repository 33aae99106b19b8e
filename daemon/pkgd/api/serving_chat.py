"""``POST /v1/chat/completions``: the chat template, ``n``, ``logprobs``/``top_logprobs``,
``stop``, ``seed``, ``max_tokens``/``max_completion_tokens``, streaming with
``stream_options.include_usage``, tool calls (``frontend.tool_call_parser``) and reasoning
content (``frontend.reasoning_parser``).

Tools: with a parser configured and ``tool_choice`` "auto" (needs
``frontend.enable_auto_tool_choice``, as in vLLM) or unset, calls the model writes become
``message.tool_calls`` and ``finish_reason`` "tool_calls". "required" and named choices
constrain the output to a valid call (`pkgd.api.structured`): "required" finishes with
"tool_calls", a named function with "stop" (as OpenAI does). With ``parallel_tool_calls``
false at most one call is returned. Streamed calls arrive as OpenAI streams them: a first
delta with the call's id and name, then its arguments in pieces.

Structured outputs (``response_format``, ``structured_outputs``, ``guided_*``) are checked
before anything reaches the engine: a bad constraint is a 400 naming the field.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pkgd.api import serving
from pkgd.api.errors import APIError, from_value_error
from pkgd.api.preprocess import parse_body, worker_input_processor
from pkgd.api.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprob,
    ChatLogprobsContent,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    DeltaToolCall,
    ToolCall,
)
from pkgd.api.serving_completion import prompt_logprobs_json
from pkgd.api.structured import Constraint, new_call_id, tool_calls_of
from pkgd.frontend.input_processor import TokenizedPrompt
from pkgd.parsers.json_calls import CallDelta, ToolCallStream

if TYPE_CHECKING:
    from pkgd.api.state import ServerState
    from pkgd.config.sections import FrontendLimits
    from pkgd.frontend.input_processor import ProcessedRequest
    from pkgd.outputs import CompletionOutput, Logprob, RequestOutput


async def create_chat_completion(
    request: Request,
    state: ServerState,
    parsed: ChatCompletionRequest | None = None,
    rendered: TokenizedPrompt | Exception | None = None,
) -> Any:
    """Answer one chat request; the body is parsed, its constraint checked, templated and
    tokenized on the `Preprocessor`, never on the event loop (a large body parsed, templated
    and tokenized in its worker process). ``parsed``: the body, already parsed there
    (``/invocations``, ``/v1/responses``); ``rendered``: what `render_in_worker` made of it."""
    state.check_ready()
    raw = await request.body() if parsed is None else b""
    if parsed is None and state.preprocess.isolates(raw):
        parsed, rendered = await state.preprocess.run_isolated(
            _parse_and_render, raw, state.config.frontend.limits, serving.max_model_len(state)
        )
    chat = await state.preprocess.run(_prepare, state, raw, request, parsed, rendered)
    if chat.body.stream:
        return StreamingResponse(
            serving.sse_events(chat.stream()), media_type="text/event-stream", headers=serving.SSE_HEADERS
        )
    try:
        out = await serving.run_until_disconnected(request, serving.final_output(state, chat.processed))
    except serving.ClientDisconnected:
        return Response(status_code=499)
    return await state.preprocess.run(lambda: JSONResponse(chat.response(out).model_dump()))


def _prepare(
    state: ServerState,
    raw: bytes,
    request: Request,
    parsed: ChatCompletionRequest | None,
    rendered: TokenizedPrompt | Exception | None = None,
) -> _Chat:
    """Parse, check, template and tokenize a chat request (on the `Preprocessor`).
    ``rendered``: the prompt `_parse_and_render` made of ``parsed``, or the error it met
    (raised here, in the order the checks run), or None to template here."""
    body = parsed if parsed is not None else parse_body(raw, ChatCompletionRequest, state.config.frontend.limits)
    rid = serving.request_id("chatcmpl", request, body.request_id)
    model = state.resolve_model(body.model)
    serving.require_runner(state, "generate", "Chat Completions API")
    use_tools = _use_tool_parser(body, state)
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = serving.sampling_params(
        body,
        state,
        max_tokens=body.effective_max_tokens(),
        logprobs=top,
        stream=body.stream,
        logprobs_field="top_logprobs",
    )
    params, constraint = serving.with_constraint(state, body, params)
    if use_tools and not getattr(state.tool_parser, "skip_special_tokens", True):
        # The format's markers are special tokens (Mistral's [TOOL_CALLS]): keep them in the text.
        params = msgspec.structs.replace(params, skip_special_tokens=False)
    template = template_args(body)
    pred = body.prediction.text() if body.prediction is not None else None
    tokens = {
        "add_special_tokens": body.add_special_tokens,
        "truncate_prompt_tokens": body.truncate_prompt_tokens,
        "prediction": pred,
    }
    if rendered is None:
        build = lambda ip: ip.process_chat(rid, params=params, priority=body.priority, **tokens, **template)  # noqa: E731
    elif isinstance(rendered, Exception):
        raise rendered
    else:
        prompt = rendered
        build = lambda ip: ip.process(rid, prompt, params, priority=body.priority, **tokens)  # noqa: E731
    serving.check_request_id_free(state, rid)
    return _Chat(state, body, rid, model, serving.process(state, build, model=model), use_tools, constraint)


def template_args(body: ChatCompletionRequest) -> dict[str, Any]:
    """What `InputProcessor.render_chat` takes from a chat body. Raises `APIError` 400 for a
    message the template cannot take."""
    try:
        messages = [m.template_dict() for m in body.messages]
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from None
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:  # as vLLM passes it; the request's own kwargs win
        kwargs = {"reasoning_effort": body.reasoning_effort, **kwargs}
    return {
        "messages": messages,
        "tools": [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
        "add_generation_prompt": body.add_generation_prompt,
        "continue_final_message": body.continue_final_message,
        "chat_template_kwargs": kwargs or None,
        "documents": body.documents,
    }


def _parse_and_render(
    raw: bytes, limits: FrontendLimits, max_model_len: int | None
) -> tuple[ChatCompletionRequest, TokenizedPrompt | Exception | None]:
    """In the `Preprocessor`'s worker process: the parsed body and `render_in_worker`'s
    prompt of it. Raises what `parse_body` raises."""
    body = parse_body(raw, ChatCompletionRequest, limits)
    return body, render_in_worker(body, max_model_len)


def render_in_worker(body: ChatCompletionRequest, max_model_len: int | None) -> TokenizedPrompt | Exception | None:
    """In the `Preprocessor`'s worker process: ``body``'s prompt, templated and tokenized
    (without its ids when it cannot fit ``max_model_len``: it is refused, and sending ~300 K
    ids back would cost the API server more than tokenizing them), or the error templating met
    (`_prepare` raises it after the checks that come first), or None without a tokenizer (the
    thread templates)."""
    ip = worker_input_processor(max_model_len)
    if ip is None:
        return None
    try:
        text = ip.render_chat(**template_args(body))
        return ip.tokenize_prompt(
            text, add_special_tokens=body.add_special_tokens, truncate_prompt_tokens=body.truncate_prompt_tokens
        )
    except APIError as exc:
        return exc
    except ValueError as exc:  # the template's: a 400 naming the field its message starts with
        return from_value_error(exc)


def _use_tool_parser(body: ChatCompletionRequest, state: ServerState) -> bool:
    choice = body.tool_choice
    if not body.tools or choice == "none":
        return False
    if choice == "required" or not isinstance(choice, str | None):
        return False  # a constrained call, parsed by pkgd.api.structured
    f = state.config.frontend
    if state.tool_parser is None or not f.enable_auto_tool_choice:
        if choice == "auto":
            raise APIError(
                400,
                '"auto" tool choice requires frontend.enable_auto_tool_choice and frontend.tool_call_parser to be set',
                param="tool_choice",
            )
        return False
    return True


class _Chat:
    """Builds the OpenAI objects for one chat request."""

    def __init__(
        self,
        state: ServerState,
        body: ChatCompletionRequest,
        rid: str,
        model: str,
        processed: ProcessedRequest,
        use_tools: bool,
        constraint: Constraint | None = None,
    ) -> None:
        self.state, self.body, self.rid, self.model, self.processed = state, body, rid, model, processed
        self.use_tools = use_tools
        self.tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
        self.forced_tool = constraint if constraint is not None and constraint.tool_mode else None
        self.max_calls = None if body.parallel_tool_calls else 1
        self.created = int(time.time())
        last = body.messages[-1]
        self.echo = last.template_dict()["content"] if body.echo and last.role == "assistant" else ""

    # ---- non-streaming -------------------------------------------------------------------------

    def response(self, out: RequestOutput) -> ChatCompletionResponse:
        choices = []
        outputs = out.outputs
        for c in sorted(outputs, key=lambda c: c.index):
            text = self.echo + c.text
            reasoning = None
            if self.state.reasoning_parser is not None:
                reasoning, text = self.state.reasoning_parser.extract(text)
                text = text or ""
            tool_calls: list[dict[str, Any]] = []
            content: str | None = text
            if self.forced_tool is not None:
                tool_calls = tool_calls_of(self.forced_tool, text)
                content = None if tool_calls else text
            elif self.use_tools:
                content, tool_calls = self.state.tool_parser.extract(text, self.tools)  # type: ignore[union-attr]
            tool_calls = tool_calls[: self.max_calls]
            finish = (
                "tool_calls" if tool_calls and c.finish_reason == "stop" and self._named() is None else c.finish_reason
            )
            choices.append(
                ChatCompletionChoice(
                    index=c.index,
                    message=ChatResponseMessage(
                        content=content,
                        reasoning_content=reasoning,
                        tool_calls=[ToolCall.model_validate(tc) for tc in tool_calls],
                    ),
                    logprobs=self._logprobs(c.logprobs) if self.body.logprobs else None,
                    finish_reason=finish,
                    stop_reason=c.stop_reason,
                )
            )
        completion_tokens = sum(len(c.token_ids) for c in outputs)
        return ChatCompletionResponse(
            id=self.rid,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=serving.usage(
                len(self.processed.prompt_token_ids), completion_tokens, serving.prediction_counts(self.body, outputs)
            ),
            prompt_logprobs=prompt_logprobs_json(out) if self.body.prompt_logprobs is not None else None,
        )

    def _named(self) -> str | None:
        """The function a named tool choice forces, else None."""
        f = self.forced_tool
        return f.tool_names[0] if f is not None and f.tool_mode == "named" else None

    def _logprobs(self, sample: list[dict[int, Logprob]] | None) -> ChatChoiceLogprobs:
        k = self.body.top_logprobs or 0
        content = []
        for d in sample or []:
            token_id, lp = next(iter(d.items()))
            top = sorted(d.items(), key=lambda kv: -kv[1].logprob)[:k]
            content.append(
                ChatLogprobsContent(
                    **_logprob(self._token(token_id, lp), lp.logprob),
                    top_logprobs=[ChatLogprob(**_logprob(self._token(t, v), v.logprob)) for t, v in top],
                )
            )
        return ChatChoiceLogprobs(content=content)

    def _token(self, token_id: int, lp: Logprob) -> str:
        if lp.decoded_token is not None:
            return lp.decoded_token
        tok = self.state.llm.tokenizer
        return tok.decode([token_id]) if tok is not None else str(token_id)

    # ---- streaming ----------------------------------------------------------------------------

    async def stream(self) -> AsyncIterator[str]:
        n = self.body.n
        per_choice = [_ChoiceStream(self) for _ in range(n)]
        for i in range(n):
            yield self._chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=self.echo))])
        completion_tokens = 0
        timeout = self.state.config.frontend.request_timeout
        continuous = serving.continuous_usage(self.body)
        prompt_tokens = len(self.processed.prompt_token_ids)
        latest: dict[int, Any] = {}  # choice index -> its newest output (prediction counts)
        # Closed on any exit (a bug below, the client leaving): that aborts the engine request.
        async with contextlib.aclosing(self.state.llm.generate(self.processed, timeout=timeout)) as outs:
            async for ro in outs:
                choices = []
                for c in ro.outputs:
                    completion_tokens += len(c.token_ids)
                    latest[c.index] = c
                    choice = per_choice[c.index].update(c)
                    if choice is not None:
                        choices.append(choice)
                if choices:
                    yield self._chunk(choices, serving.usage(prompt_tokens, completion_tokens) if continuous else None)
        opts = self.body.stream_options
        if opts is not None and opts.include_usage:
            yield ChatCompletionChunk(
                id=self.rid,
                created=self.created,
                model=self.model,
                choices=[],
                usage=serving.usage(
                    prompt_tokens, completion_tokens, serving.prediction_counts(self.body, latest.values())
                ),
            ).model_dump_json()

    def _chunk(self, choices: list[ChatStreamChoice], usage: Any = None) -> str:
        return ChatCompletionChunk(
            id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage
        ).model_dump_json()


class _ChoiceStream:
    """Per-choice streaming state: reasoning and tool-call parsers over the text deltas."""

    def __init__(self, chat: _Chat) -> None:
        self.chat = chat
        state = chat.state
        self.reasoning = state.reasoning_parser() if state.reasoning_parser is not None else None
        self.tools = state.tool_parser(tools=chat.tools) if chat.use_tools and state.tool_parser is not None else None
        self.new_call_id = getattr(self.tools, "new_call_id", new_call_id)  # Mistral's ids are 9 characters
        forced = chat.forced_tool
        self.calls_json = ToolCallStream(array=True) if forced is not None and forced.tool_mode == "required" else None
        self.named = chat._named()
        self.ids: dict[int, str] = {}  # call index -> id, given with the call's first delta

    @property
    def num_calls(self) -> int:
        return len(self.ids)

    def update(self, c: CompletionOutput) -> ChatStreamChoice | None:
        reasoning, content = "", c.text
        finished = c.finish_reason is not None
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(content)
            if finished:
                r_tail, c_tail = self.reasoning.flush()
                reasoning, content = reasoning + r_tail, content + c_tail
        calls: list[CallDelta] = []
        if self.named is not None:
            calls = [CallDelta(0, None if self.ids else self.named, content)] if content or not self.ids else []
            content = ""
        elif self.calls_json is not None:
            calls, content = self.calls_json.feed(content), ""
        elif self.tools is not None:
            content, calls = self.tools.feed(content)
            if finished:
                tail, more = self.tools.flush()
                content, calls = content + tail, calls + more
        deltas = [self._delta_call(d) for d in calls if self.chat.max_calls is None or d.index < self.chat.max_calls]
        delta = DeltaMessage(content=content or None, reasoning_content=reasoning or None, tool_calls=deltas or None)
        logprobs = self.chat._logprobs(c.logprobs) if self.chat.body.logprobs and c.logprobs else None
        if not (delta.content or delta.reasoning_content or delta.tool_calls or finished or logprobs):
            return None
        forced_stop = self.named is None and self.num_calls and c.finish_reason == "stop"
        finish = "tool_calls" if forced_stop else c.finish_reason
        return ChatStreamChoice(
            index=c.index, delta=delta, logprobs=logprobs, finish_reason=finish, stop_reason=c.stop_reason
        )

    def _delta_call(self, d: CallDelta) -> DeltaToolCall:
        if d.index not in self.ids:  # the call's first delta: its id, type and name
            self.ids[d.index] = self.new_call_id()
            return DeltaToolCall(
                index=d.index,
                id=self.ids[d.index],
                type="function",
                function={"name": d.name or "", "arguments": d.arguments},
            )
        return DeltaToolCall(index=d.index, function={"arguments": d.arguments})


def _logprob(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": max(logprob, -9999.0), "bytes": list(token.encode("utf-8"))}
