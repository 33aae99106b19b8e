"""What the completion and chat routes share: OpenAI fields → `SamplingParams`, running a
generation until the HTTP client disconnects, SSE framing, usage.

A client that disconnects ends its generation: streaming responses are cancelled by the ASGI
server, and non-streaming ones race the generation against the ``http.disconnect`` message
(`run_until_disconnected`); either way `AsyncLLM.generate` aborts the engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import structlog
from starlette.requests import Request

from pkgd import log
from pkgd.api import request_fields
from pkgd.api.errors import APIError, from_engine_error, from_value_error, sse_error
from pkgd.api.protocol import CompletionTokensDetails, SamplingFields, UsageInfo
from pkgd.api.structured import Constraint, request_constraint
from pkgd.ipc.client import EngineRequestError, EngineUnavailableError
from pkgd.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from pkgd.api.state import ServerState
    from pkgd.frontend.input_processor import InputProcessor, ProcessedRequest
    from pkgd.outputs import RequestOutput

T = TypeVar("T")
logger = log.get_logger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = "data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


def request_id(prefix: str, request: Request, body_request_id: str | None = None) -> str:
    """The request's id: ``prefix-<request_id>`` when the body names one (vLLM's field: the
    response's ``id`` and the engine's, so a second request with an id still in flight is a
    400), else ``prefix-<X-Request-Id>-<8 hex>`` when the client sent that header (made
    unique), else ``prefix-<32 hex>``.

    Binds it to this request's log lines (each ASGI request runs in its own task, so the
    binding ends with the request) and to the response's ``X-Request-Id`` header, which
    echoes the client's header when it sent one (`pkgd.api.app`)."""
    given = request.headers.get("x-request-id")
    suffix = uuid.uuid4().hex
    if body_request_id is not None:
        rid = f"{prefix}-{body_request_id}"
    else:
        rid = f"{prefix}-{given}-{suffix[:8]}" if given else f"{prefix}-{suffix}"
    structlog.contextvars.bind_contextvars(request_id=rid)
    request.scope.setdefault("state", {})["request_id"] = rid
    return rid


def check_request_id_free(state: ServerState, rid: str) -> None:
    """Raise `APIError` 400 naming ``request_id`` when a request with id ``rid`` is in flight."""
    if state.llm.has_request(rid):
        raise APIError(400, f"request_id: {rid!r} is already in use by a request in flight", param="request_id")


_IGNORED_LOGGED: set[str] = set()


def log_ignored_fields(body: SamplingFields) -> None:
    """Log, once per API-server process and field, each OpenAI field the request set that
    does not change the output (`pkgd.api.request_fields` lists them with the reason)."""
    given = {
        "store": body.store,
        "metadata": body.metadata,
        "service_tier": body.service_tier,
        "modalities": body.modalities,
        "user": body.user,
    }
    for name, value in given.items():
        if value is not None and name not in _IGNORED_LOGGED:
            _IGNORED_LOGGED.add(name)
            logger.info("request_field_ignored", field=name, reason=request_fields.ignored_reason(name))


def sampling_params(
    body: SamplingFields,
    state: ServerState,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    stream: bool,
    logprobs_field: str = "logprobs",
) -> SamplingParams:
    """The request's `SamplingParams`, unset fields from ``model.generation``, then
    ``model.generation_config``'s file, then vLLM's defaults.
    ``logprobs_field`` names the request field ``logprobs`` came from (chat:
    ``top_logprobs``). Raises `APIError` 400 for values outside the config's limits (the
    counts of ``frontend.limits`` are checked first, on the decoded body: `parse_body`)."""
    gen = state.config.model.generation
    file = state.llm.generation_defaults  # model.generation_config's, below model.generation
    max_logprobs = state.config.frontend.limits.max_logprobs
    if body.user is not None:  # OpenAI's end-user id: on this request's log lines
        structlog.contextvars.bind_contextvars(user=body.user)
    log_ignored_fields(body)
    for name, value in ((logprobs_field, logprobs), ("prompt_logprobs", body.prompt_logprobs)):
        if value is not None and value > max_logprobs:
            raise APIError(
                400,
                f"{name}: {value}, more than frontend.limits.max_logprobs allows ({max_logprobs})",
                param=name,
                code="max_logprobs",
            )
    bias = None
    if body.logit_bias:
        try:
            bias = {int(k): float(v) for k, v in body.logit_bias.items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids", param="logit_bias") from None
    params = SamplingParams(
        n=body.n,
        temperature=_first(body.temperature, gen.temperature, file.get("temperature"), 1.0),
        top_p=_first(body.top_p, gen.top_p, file.get("top_p"), 1.0),
        top_k=_first(body.top_k, gen.top_k, file.get("top_k"), 0),
        min_p=body.min_p,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=_first(body.repetition_penalty, gen.repetition_penalty, file.get("repetition_penalty"), 1.0),
        seed=body.seed,
        stop=body.stop_list(),
        stop_token_ids=list(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        max_tokens=_first(max_tokens, gen.max_tokens, file.get("max_tokens"), None),
        min_tokens=body.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=body.prompt_logprobs,
        logit_bias=bias,
        allowed_token_ids=list(body.allowed_token_ids) if body.allowed_token_ids is not None else None,
        bad_words=list(body.bad_words or ()),
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
    )
    try:
        params.verify(max_logprobs=max_logprobs)
    except ValueError as exc:
        raise from_value_error(exc) from None
    return params


def require_runner(state: ServerState, runner: str, api: str) -> None:
    """Raise a 400 (as vLLM) when the served model's runner is not ``runner``
    (``generate`` or ``pooling``); ``api`` names the endpoint family in the message."""
    hs = state.llm.handshake
    actual = hs.runner if hs is not None else state.config.model.runner_type
    if actual == runner:
        return
    how = (
        "as a pooling model (model.runner: pooling): it computes embeddings or classifier scores and does not generate"
        if actual == "pooling"
        else "for generation (model.runner: generate); an embedding model or a sequence classifier needs "
        "model.runner: pooling (--runner pooling)"
    )
    raise APIError(400, f"this model does not support the {api}: it is served {how}")


def with_constraint(
    state: ServerState, body: SamplingFields, params: SamplingParams
) -> tuple[SamplingParams, Constraint | None]:
    """``params`` with the request's structured-output constraint (`pkgd.api.structured`),
    checked by ``state.constraints`` in the calling thread: call it on the `Preprocessor`,
    never on the event loop (a schema's check is CPU work). Raises `APIError` 400 naming the
    field and the reason for a bad, unenforceable or unsatisfiable constraint."""
    try:
        constraint = request_constraint(body)
        if constraint is None:
            return params, None
        state.constraints.check_blocking(
            constraint.params, constraint.field, max_bytes=state.config.frontend.limits.max_constraint_bytes
        )
    except ValueError as exc:
        message = str(exc)
        raise APIError(400, message, param=message.split(":", 1)[0].split(" ", 1)[0]) from None
    return msgspec.structs.replace(params, structured_outputs=constraint.params), constraint


def continuous_usage(body: SamplingFields) -> bool:
    """vLLM's ``stream_options.continuous_usage_stats``: the usage so far on every chunk
    (vLLM also needs ``include_usage``; pkgd does what is asked either way)."""
    opts = body.stream_options
    return opts is not None and opts.continuous_usage_stats


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def max_model_len(state: ServerState) -> int | None:
    """The served ``max_model_len`` (None before an engine core is ready)."""
    ip = state.llm.input_processor
    return ip.max_model_len if ip is not None else None


def process(state: ServerState, build: Callable[[InputProcessor], T], *, model: str | None = None) -> T:
    """Call the `InputProcessor` (``build(input_processor)``); its `ValueError` is a 400.
    ``model``: the resolved model name; when it names a LoRA adapter, the engine requests
    carry it (`ServerState.lora_request`)."""
    ip = state.llm.input_processor
    assert ip is not None  # callers check_ready() first, and a ready engine has one
    try:
        processed = build(ip)
    except ValueError as exc:
        raise from_value_error(exc) from None
    lora = state.lora_request(model)
    if lora is not None:
        reqs = processed.engine_requests  # type: ignore[attr-defined]  # a ProcessedRequest
        processed.engine_requests = [msgspec.structs.replace(r, lora_request=lora) for r in reqs]  # type: ignore[attr-defined]
    return processed


async def final_output(state: ServerState, processed: ProcessedRequest) -> RequestOutput:
    """Run a ``FINAL_ONLY`` request to its one output (errors become `APIError`s)."""
    timeout = state.config.frontend.request_timeout
    try:
        async for out in state.llm.generate(processed, timeout=timeout):
            if out.finished:
                return out
    except (EngineRequestError, EngineUnavailableError) as exc:
        raise from_engine_error(exc) from None
    except TimeoutError:
        raise APIError(
            503, f"the request ran longer than frontend.request_timeout ({timeout} s) and was aborted"
        ) from None
    except ValueError as exc:  # the id is in use (a client's request_id sent twice at once)
        raise APIError(400, str(exc), param="request_id") from None
    raise APIError(500, "the engine ended the request without a final output")


async def run_until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first, which cancels it.

    Raises:
        ClientDisconnected: the client went away (``work`` was cancelled).
    """
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    raise ClientDisconnected


async def merge_streams(streams: list[AsyncGenerator[T, None]]) -> AsyncGenerator[tuple[int, T], None]:
    """Items of several async iterators as they come, tagged with the iterator's index.
    One iterator is passed straight through; closing the merge closes them all."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
    end = object()

    async def pump(i: int, it: AsyncGenerator[T, None]) -> None:
        try:
            async with contextlib.aclosing(it):  # a cancelled pump closes its stream at once
                async for item in it:
                    await queue.put((i, item, None))
            await queue.put((i, end, None))
        except Exception as exc:
            await queue.put((i, end, exc))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is end:
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def sse_events(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """``data:`` events from already-serialized JSON chunks and the closing ``data: [DONE]``.

    Whatever ends the chunks early (the engine failing, a timeout, a bug) ends the stream
    with one OpenAI-shaped error event and then ``[DONE]``, so a client never sees a stream
    cut without a reason. Only cancellation (the client went away) propagates.
    """
    try:
        async for chunk in chunks:
            yield f"data: {chunk}\n\n"
    except APIError as exc:
        yield sse_error(exc.status, exc.message)
    except (EngineRequestError, EngineUnavailableError) as exc:
        err = from_engine_error(exc)
        yield sse_error(err.status, err.message)
    except TimeoutError:
        yield sse_error(503, "the request ran longer than frontend.request_timeout and was aborted")
    except Exception as exc:
        logger.exception("stream_failed")
        yield sse_error(500, f"internal error: {type(exc).__name__}: {exc}")
    yield DONE


def usage(prompt_tokens: int, completion_tokens: int, prediction: CompletionTokensDetails | None = None) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        completion_tokens_details=prediction,
    )


def prediction_counts(body: SamplingFields, outputs: Iterable[Any]) -> CompletionTokensDetails | None:
    """``usage.completion_tokens_details`` of a request with a ``prediction`` (None without):
    the accepted / rejected prediction tokens summed over its completions' newest outputs
    (`pkgd.outputs.CompletionOutput`, counts cumulative per completion)."""
    if body.prediction is None:
        return None
    outs = list(outputs)
    return CompletionTokensDetails(
        accepted_prediction_tokens=sum(c.accepted_prediction_tokens for c in outs),
        rejected_prediction_tokens=sum(c.rejected_prediction_tokens for c in outs),
    )
