"""Request work that costs CPU, done off the event loop, within ``frontend.limits``.

One API server's event loop carries every stream it serves, so any step that takes long on it
stalls them all (and ``/health``). The steps whose cost grows with what a client sends —
decoding the JSON body, validating it, the chat template, tokenization, building a large
response — therefore run on `Preprocessor`'s small thread pool (``frontend.preprocess_threads``),
and `parse_body` checks ``frontend.limits`` on the decoded JSON before the costlier
validation, so a request beyond a limit is refused (400 for a count, 413 for a size, naming the
limit) having cost one decode.

A worker thread still shares the GIL with the loop: Python code (the Jinja template, pydantic's
callbacks, our checks) yields it every switch interval, and the tokenizer's Rust code releases
it (`InputProcessor.tokenize` uses the batch encoder, which does), but one C call that holds
it (decoding a body, validating a long list) stalls the loop for its duration. So does a full
collection of Python's cyclic GC, which is why the API server freezes its start-up heap. That is
why the body is decoded with msgspec (the fastest of the JSON decoders at hand, and strict:
a lone UTF-16 surrogate is malformed JSON, a 400) and why ``frontend.max_request_body_bytes``
bounds that step, while the limits bound every step after it.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeGuard, TypeVar

import msgspec
import structlog
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from pkgd.api.errors import APIError

if TYPE_CHECKING:
    from pkgd.config.sections import FrontendLimits

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

_LOGPROB_FIELDS = ("logprobs", "top_logprobs", "prompt_logprobs")
# The text that is templated and tokenized: chat and completions, embeddings, Responses.
_TEXT_FIELDS = ("messages", "prompt", "input", "instructions", "tools")


class Preprocessor:
    """A bounded thread pool for per-request CPU work; `run` awaits one call on it.

    Work waits in the pool's queue when every thread is busy (the number of open connections,
    ``frontend.max_connections``, bounds how much can wait). The caller's context variables
    (the request id bound to log lines) travel with the call, and the log fields it binds come
    back.
    """

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pkgd-preprocess")

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        ctx = contextvars.copy_context()
        call = functools.partial(ctx.run, fn, *args, **kwargs)
        result = await asyncio.get_running_loop().run_in_executor(self._pool, call)
        # Log fields the call bound (the request's user) stay on the request's later lines.
        structlog.contextvars.bind_contextvars(**ctx.run(structlog.contextvars.get_contextvars))
        return result

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def parse_body(raw: bytes, model: type[M], limits: FrontendLimits) -> M:
    """Decode and validate a JSON request body (call it on the `Preprocessor`).

    Raises:
        APIError: 400 for malformed JSON or a count over a limit, 413 for text over
            ``frontend.limits.max_input_chars``.
        RequestValidationError: the body does not fit ``model`` (the app answers 400 naming
            the field, as for any validation error).
    """
    data = decode_body(raw, limits)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None


def decode_body(raw: bytes, limits: FrontendLimits) -> Any:
    """The decoded JSON of a request body, its counts and sizes within ``limits`` (call it on
    the `Preprocessor`). Raises `APIError` 400 (missing or malformed, a count over a limit)
    or 413 (text over ``frontend.limits.max_input_chars``)."""
    if not raw:
        raise APIError(400, "the request body is missing")
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise APIError(400, f"malformed JSON body: {exc}") from None
    except RecursionError:  # msgspec recurses per nesting level: '{"a":' * 100000 ran out of stack
        raise APIError(400, "malformed JSON body: nested too deeply") from None
    if isinstance(data, dict):
        check_limits(data, limits)
    return data


def check_limits(data: dict[str, Any], limits: FrontendLimits) -> None:
    """Check ``frontend.limits`` on a decoded request body (fields of the wrong type are left
    to validation). Raises `APIError` 400 (a count) or 413 (text size) naming the limit."""
    messages = data.get("messages")
    if isinstance(messages, list):
        _at_most(len(messages), limits.max_messages, "messages", "messages", "max_messages")
    for name in ("prompt", "input"):  # completions' prompts; embeddings' inputs or Responses' items
        prompt = data.get(name)
        if not isinstance(prompt, list) or not prompt or _only(prompt, _INT_TYPES):
            continue
        if isinstance(prompt[0], dict):  # Responses input items: messages of a conversation
            _at_most(len(prompt), limits.max_messages, "input items", name, "max_messages")
        else:
            _at_most(len(prompt), limits.max_prompts, "prompts" if name == "prompt" else "inputs", name, "max_prompts")
    n = data.get("n")
    if _is_int(n):
        _at_most(n, limits.max_n, "", "n", "max_n")
    for name in _LOGPROB_FIELDS:
        value = data.get(name)
        if _is_int(value):
            _at_most(value, limits.max_logprobs, "", name, "max_logprobs")
    stop = data.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    _at_most(len(stops), limits.max_stop_strings, "stop strings", "stop", "max_stop_strings")
    longest = max((len(s) for s in stops if isinstance(s, str)), default=0)
    _at_most(longest, limits.max_stop_string_chars, "characters in a stop string", "stop", "max_stop_string_chars")
    for name, limit_name in (("stop_token_ids", "max_stop_token_ids"), ("logit_bias", "max_logit_bias")):
        value = data.get(name)
        if isinstance(value, list | dict):
            _at_most(len(value), getattr(limits, limit_name), f"{name} entries", name, limit_name)
    fields = [data.get(name) for name in _TEXT_FIELDS]
    chars = text_chars(fields, limits.max_input_chars)
    if chars > limits.max_input_chars:
        raise APIError(
            413,
            f"the request's text (prompts, messages, inputs, instructions, tools) exceeds "
            f"frontend.limits.max_input_chars ({limits.max_input_chars} characters)",
            code="max_input_chars",
        )


_INT_TYPES = frozenset({int, bool})  # isinstance(x, int) holds for both
_CONTAINER_TYPES = frozenset({str, list, dict})  # what may hold text


def _only(items: list[Any], types: frozenset[type]) -> bool:
    """Whether every item of ``items`` has one of ``types`` (exactly), by a pass in C: a
    Python-level loop over a 4 MiB token-id list runs long enough to starve the event loop of
    the GIL (it is released only every switch interval), stalling every other stream."""
    return set(map(type, items)) <= types


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _at_most(value: int, limit: int, what: str, param: str, limit_name: str) -> None:
    if value > limit:
        shown = f"{value} {what}" if what else str(value)
        raise APIError(
            400,
            f"{param}: {shown}, more than frontend.limits.{limit_name} allows ({limit})",
            param=param,
            code=limit_name,
        )


def text_chars(value: Any, stop_after: int) -> int:
    """Characters of every string (keys included) in decoded JSON ``value``, counted until
    they pass ``stop_after``. Iterative, so deep nesting costs no recursion."""
    total = 0
    stack = [value]
    while stack and total <= stop_after:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, list):
            if not set(map(type, item)).isdisjoint(_CONTAINER_TYPES):  # a pass in C (see `_only`)
                stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
    return total
