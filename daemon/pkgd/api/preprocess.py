"""Request work that costs CPU, done off the event loop, within ``frontend.limits``.

One API server's event loop carries every stream it serves, so any step that takes long on it
stalls them all (and ``/health``). The steps whose cost grows with what a client sends —
decoding the JSON body, validating it, the chat template, tokenization, building a large
response — therefore run on `Preprocessor`'s small thread pool (``frontend.preprocess_threads``),
and `parse_body` checks ``frontend.limits`` on the decoded JSON before the costlier
validation, so a request beyond a limit is refused (400 for a count, 413 for a size, naming the
limit) having cost one decode.

A worker thread still shares the GIL with the loop. The tokenizer's Rust code releases it
(`InputProcessor.tokenize` uses the batch encoder, which does), but one C call that holds it
(decoding a body, validating a long list) stalls the loop for its duration, and Python code
(the Jinja template and the walk transformers makes over everything a template sees, pydantic's
callbacks, our checks) makes the loop wait up to a switch interval (5 ms) for the GIL after
each of its system calls, each socket write of each stream: the convoy effect. A 4 MiB body so
stalled every other stream by 200-300 ms. So a body of ``frontend.preprocess_process_min_bytes``
or more is decoded, checked and validated, a chat request's template applied and the prompts of
chat and completion requests tokenized, in a worker process instead (`Preprocessor.run_isolated`,
below the API server in the CPU scheduler's share); the loop then only receives the body and
writes it to a pipe, and a thread unpickles the result (a prompt's ids are left out of it when
they cannot fit ``max_model_len``: that prompt is refused, and 300 K ids cost more to send than
to count). A full collection of Python's cyclic GC also stalls the loop, which is why the API
server freezes its start-up heap. The body is decoded with msgspec (the fastest of the JSON
decoders at hand, and strict: a lone UTF-16 surrogate is malformed JSON, a 400);
``frontend.max_request_body_bytes`` bounds that step, and the limits bound every step after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import json
import multiprocessing
import os
import pickle
import signal
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TYPE_CHECKING, Any, TypeGuard, TypeVar

import msgspec
import structlog
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from pkgd import log
from pkgd.api.errors import APIError
from pkgd.frontend.input_processor import InputProcessor, prompt_too_long
from pkgd.ipc import child

if TYPE_CHECKING:
    from pkgd.config.sections import FrontendLimits

logger = log.get_logger("pkgd.api.preprocess")

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

_LOGPROB_FIELDS = ("logprobs", "top_logprobs", "prompt_logprobs")
# The text that is templated and tokenized: chat and completions, embeddings, Responses.
_TEXT_FIELDS = (
    "messages",
    "prompt",
    "input",
    "instructions",
    "tools",
    # score and rerank texts
    "query",
    "queries",
    "documents",
    "items",
    "data_1",
    "data_2",
    "text_1",
    "text_2",
)


class Preprocessor:
    """Per-request CPU work off the event loop: `run` awaits one call on a bounded thread pool;
    `run_isolated` one call in a worker process, for the bodies `isolates` says are large.

    Work waits in the pool's queue when every thread is busy (the number of open connections,
    ``frontend.max_connections``, bounds how much can wait). The caller's context variables
    (the request id bound to log lines) travel with a thread call, and the log fields it binds
    come back.

    The worker process (one, ``spawn``-started by `start` when the API server starts, or by
    the first large body after it died) holds a copy of the served tokenizer, ``tokenizer()``
    as it was when the process started, for the chat template and tokenization
    (`worker_input_processor`). It runs below the API server in the CPU scheduler's share, dies with
    the API server (SIGKILL on the parent's exit) and ignores the terminal's Ctrl-C (the API
    server drains first).
    """

    def __init__(self, threads: int, *, process_min_bytes: int = 0, tokenizer: Callable[[], Any] | None = None) -> None:
        self.threads = threads
        self.process_min_bytes = process_min_bytes
        self._tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pkgd-preprocess")
        self._procs: ProcessPoolExecutor | None = None
        self._installed: asyncio.Future[None] | None = None  # the tokenizer is in the process
        self._starting: asyncio.Lock | None = None
        self._restarts: set[asyncio.Task[None]] = set()
        self._closed = False

    def isolates(self, raw: bytes) -> bool:
        """Whether a body this large is parsed by `run_isolated` (``process_min_bytes`` > 0)."""
        return 0 < self.process_min_bytes <= len(raw)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        ctx = contextvars.copy_context()
        call = functools.partial(ctx.run, fn, *args, **kwargs)
        result = await asyncio.get_running_loop().run_in_executor(self._pool, call)
        # Log fields the call bound (the request's user) stay on the request's later lines.
        structlog.contextvars.bind_contextvars(**ctx.run(structlog.contextvars.get_contextvars))
        return result

    async def start(self) -> None:
        """Start the worker process (when ``process_min_bytes`` > 0) and return while it
        imports its modules. The API server calls this before it says it is ready: started on
        the first large body instead, the process made that request wait its start-up (seconds
        on a busy host) and pickling the tokenizer then held the GIL against the loop."""
        if self.process_min_bytes > 0 and not self._closed:
            await self._worker()

    async def run_isolated(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the worker process: ``fn`` a module-level function, the arguments
        and the result picklable; what it raises is raised here (`APIError` and
        `RequestValidationError` pickle).

        Raises:
            APIError: 503 when the worker process died during the call or while it started
                (the next call starts a new one).
        """
        procs, installed = await self._worker()
        try:
            await asyncio.shield(installed)  # one caller leaving does not cancel it for all
            return await asyncio.get_running_loop().run_in_executor(procs, fn, *args)
        except BrokenProcessPool:  # during the call, or while the process started
            if self._procs is procs:
                self._procs = None
                procs.shutdown(wait=False, cancel_futures=True)
            raise APIError(503, "the request's preprocessing process died; retry") from None

    async def parse_large(
        self, raw: bytes, model: type[M], limits: FrontendLimits, max_model_len: int | None = None
    ) -> M | None:
        """`parse_body` in the worker process for a body `isolates` says is large; None for
        another (the caller parses it on a thread). Raises what `parse_body` raises."""
        if not self.isolates(raw):
            return None
        return await self.run_isolated(parse_body, raw, model, limits, max_model_len)

    async def _worker(self) -> tuple[ProcessPoolExecutor, asyncio.Future[None]]:
        """The worker process's pool, started if there is none, and the future of its
        tokenizer's installation (which may still be running)."""
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._procs is None or self._installed is None:
                # Started from the loop's thread: the process's parent-death signal follows the
                # API server's main thread. Only small start arguments: the start writes them to
                # a pipe the new process reads once it has imported its modules, so a large one
                # would block the loop until then.
                procs = ProcessPoolExecutor(
                    max_workers=1,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_init_worker,
                    initargs=(os.getpid(),),
                )
                tok = self._tokenizer() if self._tokenizer is not None else None
                # Pickled on a thread (tens of ms for a real tokenizer); the pool's own threads
                # write the bytes, so the loop waits for neither.
                blob = await self.run(pickle.dumps, tok) if tok is not None else None
                installed = asyncio.get_running_loop().run_in_executor(procs, _install_tokenizer, blob)
                installed.add_done_callback(_log_start_failure)
                _lower_priority(procs)  # the first call started the process: it is importing now
                self._watch(procs)
                self._procs, self._installed = procs, installed
            return self._procs, self._installed

    def _watch(self, procs: ProcessPoolExecutor) -> None:
        """Replace the worker process as soon as it dies (its sentinel becomes readable),
        so a death while idle costs no request a 503: only the call it was running fails."""
        loop = asyncio.get_running_loop()
        for proc in _processes(procs):

            def died(proc: Any = proc) -> None:
                loop.remove_reader(proc.sentinel)
                if self._closed or self._procs is not procs:
                    return
                logger.warning("preprocess_process_died", pid=proc.pid, exitcode=proc.exitcode, restarting=True)
                self._procs = None
                procs.shutdown(wait=False, cancel_futures=True)
                restart = asyncio.ensure_future(self.start())
                self._restarts.add(restart)
                restart.add_done_callback(self._restarts.discard)

            loop.add_reader(proc.sentinel, died)

    def shutdown(self) -> None:
        """Stop the threads taking work and end the worker process (SIGTERM: a call it is
        running is not waited for, and Python's exit would otherwise wait for it)."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        procs, self._procs = self._procs, None
        if procs is not None:
            for proc in _processes(procs):
                with contextlib.suppress(OSError):
                    proc.terminate()
            procs.shutdown(wait=False, cancel_futures=True)


# ---- the worker process ------------------------------------------------------------------------

_worker_tok: Any = None
_WORKER_NICE = 10  # CFS weight 110 against the default's 1024 (Linux sched_prio_to_weight)


def _init_worker(parent_pid: int) -> None:
    child.die_with_parent(parent_pid)
    child.set_process_name("pkgd-preproc")
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _lower_priority(procs: ProcessPoolExecutor) -> None:
    """Put the pool's processes ``_WORKER_NICE`` below the API server in the CPU scheduler's
    share, from the parent so that it holds from their first instruction (their imports take
    seconds of CPU): on a host with few cores, a large request's parsing would otherwise take
    CPU time from the engine and the event loops, stalling every stream."""
    nice = min(19, os.getpriority(os.PRIO_PROCESS, 0) + _WORKER_NICE)
    for proc in _processes(procs):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, proc.pid, nice)


def _processes(procs: ProcessPoolExecutor) -> list[Any]:
    """The pool's worker processes (`multiprocessing.Process`), from CPython's pid -> Process map."""
    return list((getattr(procs, "_processes", None) or {}).values())


def _log_start_failure(installed: asyncio.Future[None]) -> None:
    if not installed.cancelled() and installed.exception() is not None:  # retrieved: no asyncio warning
        logger.warning("preprocess_process_died", during="start", error=repr(installed.exception()))


def _install_tokenizer(blob: bytes | None) -> None:
    global _worker_tok
    _worker_tok = pickle.loads(blob) if blob is not None else None


def worker_input_processor(max_model_len: int | None) -> InputProcessor | None:
    """In the worker process: an `InputProcessor` on the API server's tokenizer, for the chat
    template and tokenization (None without a tokenizer or a known ``max_model_len``: the
    caller leaves that work to the thread)."""
    if _worker_tok is None or max_model_len is None:
        return None
    return InputProcessor(_worker_tok, max_model_len=max_model_len)


def parse_body(raw: bytes, model: type[M], limits: FrontendLimits, max_model_len: int | None = None) -> M:
    """Decode and validate a JSON request body (call it on the `Preprocessor`). With
    ``max_model_len``, a completion's token-id ``prompt`` must be shorter (`check_limits`).

    Raises:
        APIError: 400 for malformed JSON or a count over a limit, 413 for text over
            ``frontend.limits.max_input_chars``.
        RequestValidationError: the body does not fit ``model`` (the app answers 400 naming
            the field, as for any validation error).
    """
    data = decode_body(raw, limits, max_model_len)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None


def decode_body(raw: bytes, limits: FrontendLimits, max_model_len: int | None = None) -> Any:
    """The decoded JSON of a request body, its counts and sizes within ``limits`` (call it on
    the `Preprocessor`). Raises `APIError` 400 (missing or malformed, a count over a limit)
    or 413 (text over ``frontend.limits.max_input_chars``)."""
    if not raw:
        raise APIError(400, "the request body is missing")
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise APIError(400, f"malformed JSON body: {_decode_problem(raw, exc)}") from None
    except RecursionError:  # msgspec recurses per nesting level: '{"a":' * 100000 ran out of stack
        raise APIError(400, "malformed JSON body: nested too deeply") from None
    if isinstance(data, dict):
        check_limits(data, limits, max_model_len)
    return data


def _decode_problem(raw: bytes, exc: msgspec.DecodeError) -> str:
    """msgspec's reason, except for a lone high surrogate escape (``"\\ud800"``), which
    msgspec reports as truncated input: the stdlib parser, which accepts lone surrogates,
    tells that case apart (only on this error path; the body is already size-limited)."""
    if str(exc) == "Input data was truncated":
        try:
            json.loads(raw)
        except (ValueError, RecursionError):
            pass
        else:
            return "invalid utf-16 surrogate pair (a \\uD800-\\uDBFF escape without its low half)"
    return str(exc).removeprefix("JSON is malformed: ")  # the caller's words already say so


def check_limits(data: dict[str, Any], limits: FrontendLimits, max_model_len: int | None = None) -> None:
    """Check ``frontend.limits`` on a decoded request body (fields of the wrong type are left
    to validation), and with ``max_model_len`` that each token-id ``prompt`` leaves room to
    generate (it is refused later anyway: refused here, validating a long list costs nothing).
    Raises `APIError` 400 (a count, a prompt too long) or 413 (text size) naming the limit."""
    messages = data.get("messages")
    if isinstance(messages, list):
        _at_most(len(messages), limits.max_messages, "messages", "messages", "max_messages")
    for name in ("prompt", "input"):  # completions' prompts; embeddings' inputs or Responses' items
        prompt = data.get(name)
        if not isinstance(prompt, list) or not prompt:
            continue
        if _only(prompt, _INT_TYPES):
            if name == "prompt" and max_model_len is not None:
                _prompt_fits(len(prompt), max_model_len)
            continue
        if name == "prompt" and max_model_len is not None and _only(prompt, _LIST_TYPE):
            _prompt_fits(max(map(len, prompt)), max_model_len)
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
_LIST_TYPE = frozenset({list})
_CONTAINER_TYPES = frozenset({str, list, dict})  # what may hold text


def _only(items: list[Any], types: frozenset[type]) -> bool:
    """Whether every item of ``items`` has one of ``types`` (exactly), by a pass in C: a
    Python-level loop over a 4 MiB token-id list runs long enough to starve the event loop of
    the GIL (it is released only every switch interval), stalling every other stream."""
    return set(map(type, items)) <= types


def _prompt_fits(tokens: int, max_model_len: int) -> None:
    if tokens >= max_model_len:  # InputProcessor's check, made before validation
        raise APIError(400, str(prompt_too_long(tokens, max_model_len)), param="prompt")


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
