"""`AsyncLLM`: the frontend half of the engine, inside each API-server process (torch-free).

vLLM v1's ``AsyncLLM`` over this project's pieces: the engine's `InputProcessor` tokenizes
and applies the chat template (routes call it, so bad input is a 400 before anything is
sent), `EngineClient` carries `EngineCoreRequest`s to the least loaded engine core, and as
each step's `EngineCoreOutput`s arrive the engine's `OutputProcessor` detokenizes them
incrementally, applies stop strings and aggregates ``n > 1``; the resulting `RequestOutput`s
go to one `RequestStream` per client request. Requests that hit a stop string are aborted in
the engine, and so is a request whose consumer stops iterating (the HTTP client went away).

`Metrics` (``/metrics``) follows each request from the moment it is handed to `generate`:
the engine core it went to, every step's outputs, and its end.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from pkgd import log
from pkgd.frontend.pooling import pooling_request_output
from pkgd.ipc.client import EngineClient, EngineRequestError, EngineUnavailableError
from pkgd.ipc.messages import EngineCoreOutput, EngineOutputs, Handshake
from pkgd.outputs import PoolingRequestOutput

if TYPE_CHECKING:
    from pkgd.config.vllm_config import VllmConfig
    from pkgd.frontend.input_processor import InputProcessor, ProcessedRequest
    from pkgd.frontend.metrics import Metrics
    from pkgd.outputs import RequestOutput

logger = log.get_logger(__name__)

WAIT_NOTICE_S = 1.0  # an engine core not answering by then is loading: log waiting_for_engine
ALL_CORES_WAIT_S = 10.0  # how long start() waits for every core before it goes on with the first


class RequestAborted(Exception):
    """Raised by a request's stream after `AsyncLLM.abort` ended it (vLLM's ``abort`` from
    another task: the gRPC ``Abort`` RPC); the engine stopped it."""


class RequestIdInUse(ValueError):
    """A request id already in flight was given again (a client-supplied id)."""


class RequestStream:
    """Outputs of one client request, in order; an error ends it. ``processed`` is kept for a
    pooling request, whose one output bypasses the `OutputProcessor`."""

    __slots__ = (
        "_items",
        "_event",
        "request_id",
        "engine_ids",
        "prompt_len",
        "t_arrival",
        "t_last",
        "num_tokens",
        "finished",
        "pooling",
    )

    def __init__(
        self, request_id: str, engine_ids: list[str], prompt_len: int, pooling: ProcessedRequest | None = None
    ) -> None:
        self._items: collections.deque[Any] = collections.deque()
        self._event = asyncio.Event()
        self.request_id = request_id
        self.engine_ids = engine_ids
        self.prompt_len = prompt_len
        self.t_arrival = time.monotonic()
        self.t_last: float | None = None
        self.num_tokens = 0
        self.finished = False
        self.pooling = pooling

    def put(self, item: RequestOutput | PoolingRequestOutput | BaseException) -> None:
        self._items.append(item)
        self._event.set()

    def fail_now(self, error: BaseException) -> None:
        """End the stream with ``error`` next, dropping the outputs not yet taken: a stream cut
        at a drain deadline must reach its client within the close grace, and a client that
        reads slower than the engine generates has a backlog here it would never get through."""
        self._items.clear()
        self.put(error)

    async def get(self) -> Any:
        while not self._items:
            self._event.clear()
            await self._event.wait()
        item = self._items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item


class AsyncLLM:
    """Generates for API routes through the engine cores at ``engine_addresses``.

    Construct, then ``await start()`` (connects, handshakes, loads the tokenizer). The
    `InputProcessor` is ``input_processor``; ``tokenizer`` may be given to skip loading;
    ``client_factory(self)`` replaces the `EngineClient` (tests).
    """

    def __init__(
        self,
        config: VllmConfig,
        engine_addresses: Sequence[str],
        *,
        metrics: Metrics | None = None,
        tokenizer: Any = None,
        client_id: str | None = None,
        client_factory: Callable[[AsyncLLM], Any] | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.tokenizer = tokenizer
        if client_factory is None:
            self.client: Any = EngineClient(engine_addresses, self, client_id=client_id)
        else:  # a test double with EngineClient's interface
            self.client = client_factory(self)
        self.input_processor: InputProcessor | None = None
        self.output_processor: Any = None
        self.handshake: Handshake | None = None
        # sampling defaults of model.generation_config (pkgd.model_files.generation)
        self.generation_defaults: dict[str, Any] = {}
        self._streams: dict[str, RequestStream] = {}  # client request id -> stream
        self._client_of: dict[str, str] = {}  # engine request id -> client request id
        self._refusing: str | None = None  # set by abort_all: why no request may start

    async def start(self, handshake_timeout: float) -> None:
        """Connect to the cores and wait for a first handshake, then build the processors.

        Raises:
            TimeoutError: no engine core answered within ``handshake_timeout`` seconds.
            pkgd.frontend.tokenizer.TokenizerError: the tokenizer cannot be loaded.
        """
        # The heavy imports, and the tokenizer where the model's files are there already (an
        # HF directory, a GGUF converted by an earlier start), run while the engine cores load;
        # a GGUF's first conversion is the engine's, so this process never converts nor
        # imports torch, and reads that tokenizer after the handshake.
        preload = asyncio.ensure_future(asyncio.to_thread(_prepare_frontend, self.config, self.tokenizer is None))
        # Loading takes seconds to minutes on a cold cache: say so once, as information
        # (nothing is wrong until engine_ready_timeout passes), and wait.
        all_cores = asyncio.ensure_future(self.client.start(timeout=min(handshake_timeout, ALL_CORES_WAIT_S)))
        if not (await asyncio.wait({all_cores}, timeout=WAIT_NOTICE_S))[0]:
            logger.info(
                "waiting_for_engine",
                loading=self.client.unavailable(),
                timeout_s=handshake_timeout,
                timeout_key="supervisor.engine_ready_timeout",
            )
        await all_cores
        deadline = time.monotonic() + handshake_timeout
        while self.client.handshake is None:
            if time.monotonic() > deadline:
                preload.cancel()
                raise TimeoutError(f"no engine core answered within {handshake_timeout:.0f} s")
            await asyncio.sleep(0.05)
        (InputProcessor, OutputProcessor), early = await preload  # noqa: N806 - classes
        self.handshake = hs = self.client.handshake
        if self.tokenizer is None:
            if early is None:
                early = await asyncio.to_thread(load_frontend_model, self.config)
            self.tokenizer, self.generation_defaults = early
        self.input_processor = InputProcessor(
            self.tokenizer,
            max_model_len=hs.max_model_len,
            vocab_size=hs.vocab_size,
            eos_token_id=hs.eos_token_id,
            max_logprobs=self.config.frontend.limits.max_logprobs,
            hidden_size=hs.hidden_size or None,
            matryoshka=hs.matryoshka,
            matryoshka_dimensions=hs.matryoshka_dimensions,
        )
        self.output_processor = OutputProcessor(self.tokenizer)

    async def close(self) -> None:
        await self.client.close()

    def is_ready(self) -> bool:
        return self.input_processor is not None and self.client.is_available() and self._refusing is None

    def num_inflight(self) -> int:
        return len(self._streams)

    def has_request(self, request_id: str) -> bool:
        """True while a request with client id ``request_id`` is in flight."""
        return request_id in self._streams

    # ---- generation ------------------------------------------------------------------------

    async def generate(
        self, processed: ProcessedRequest, *, timeout: float | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """Send ``processed`` to an engine core and yield its `RequestOutput`s until the last.

        Raises:
            pkgd.ipc.client.EngineUnavailableError: no engine core is available (nothing sent).
            pkgd.ipc.client.EngineRequestError: the core refused or failed the request.
            TimeoutError: ``timeout`` seconds passed (the request is aborted).
        """
        # Closing this generator closes ``_run`` at once (its ``finally`` aborts the request),
        # not whenever the garbage collector finalizes it.
        async with contextlib.aclosing(self._run(processed, timeout)) as outs:
            async for out in outs:
                yield out

    async def encode(self, processed: ProcessedRequest, *, timeout: float | None = None) -> PoolingRequestOutput:
        """Run pooling request ``processed`` (`InputProcessor.process_pooling`) to its
        `PoolingRequestOutput`. Raises as `generate` does."""
        async with contextlib.aclosing(self._run(processed, timeout)) as outs:
            async for out in outs:
                return out
        raise EngineRequestError("the engine ended a pooling request without its vector")

    async def _run(self, processed: ProcessedRequest, timeout: float | None) -> AsyncGenerator[Any, None]:
        rid = processed.request_id
        if self._refusing is not None:
            raise EngineUnavailableError(self._refusing)
        if rid in self._streams:
            raise RequestIdInUse(f"request id {rid!r} is already in use")
        engine_ids = [r.request_id for r in processed.engine_requests]
        pooling = processed if processed.pooling_params is not None else None
        stream = RequestStream(rid, engine_ids, len(processed.prompt_token_ids), pooling)
        if pooling is None:
            self.output_processor.add_request(processed)
        self._streams[rid] = stream
        for eid in engine_ids:
            self._client_of[eid] = rid
        try:
            engine_index = self.client.add_requests(processed.engine_requests)
        except BaseException:
            self._forget(rid, abort=False)
            raise
        if self.metrics is not None:
            params = processed.sampling_params  # None for a pooling request
            self.metrics.track(
                rid,
                engine_ids,
                engine_index,
                prompt_len=stream.prompt_len,
                max_tokens=None if params is None else params.max_tokens,
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                if deadline is None:
                    out = await stream.get()
                else:
                    out = await asyncio.wait_for(stream.get(), max(0.0, deadline - time.monotonic()))
                yield out
                if out.finished:
                    return
        finally:
            if not stream.finished:  # consumer left, timed out, or the engine failed it
                self._finished(stream, "abort")
            self._forget(rid, abort=not stream.finished)

    def abort(self, request_ids: Sequence[str]) -> int:
        """End the client requests ``request_ids`` in flight: the engine aborts them and each
        one's `generate` raises `RequestAborted`. Ids not in flight (finished, never seen) are
        skipped; returns how many were aborted."""
        count = 0
        for rid in request_ids:
            stream = self._streams.get(rid)
            if stream is None:
                continue
            stream.put(RequestAborted(f"request {rid!r} was aborted"))
            self._forget(rid, abort=True)
            count += 1
        return count

    def abort_all(self, message: str, *, reason: str = "drain_timeout") -> None:
        """Fail every request in flight with ``message`` (a drain deadline passed: ``reason``
        names it for ``pkgd:requests_cut``), and every request that comes after: this server is
        about to exit, so none may start a stream it would cut."""
        self._refusing = message
        error = EngineRequestError(message, cut_reason=reason)
        if self.metrics is not None and self._streams:
            self.metrics.count_cut(reason, len(self._streams))
        for rid, stream in list(self._streams.items()):
            stream.fail_now(error)
            self._forget(rid, abort=True)

    def _forget(self, rid: str, *, abort: bool) -> None:
        stream = self._streams.pop(rid, None)
        if self.metrics is not None:
            self.metrics.end(rid)
        if stream is None:
            return
        for eid in stream.engine_ids:
            self._client_of.pop(eid, None)
        engine_ids = self.output_processor.abort_requests([rid]) if stream.pooling is None else stream.engine_ids
        if abort and engine_ids:
            self.client.abort_requests(engine_ids)

    # ---- OutputSink (called by the EngineClient) ---------------------------------------------

    def on_outputs(self, msg: EngineOutputs) -> None:
        """Turn one step's outputs into `RequestOutput`s. Each output is processed on its own,
        so a failure (a bug in detokenizing or a parser) ends that request with the error,
        never the others nor the reader delivering them."""
        now = time.monotonic()
        if self.metrics is not None:  # before any failure below ends a request's tracking
            self.metrics.on_outputs(msg.outputs, msg.timestamp)
        stopped: list[str] = []  # ended here by a stop string: finished for the metrics too
        for out in msg.outputs:
            if out.pooling_output is not None:
                self._pooled(out)
                continue
            self._count_tokens(out.request_id, len(out.new_token_ids), now)
            try:
                result = self.output_processor.process_outputs([out])
            except Exception as exc:
                logger.exception("output_processing_failed", engine_request_id=out.request_id)
                self._fail(out.request_id, exc)
                continue
            stopped.extend(result.reqs_to_abort)
            self._deliver(result)
        if self.metrics is not None and stopped:
            self.metrics.on_outputs((), msg.timestamp, stopped)

    def _deliver(self, result: Any) -> None:
        if result.reqs_to_abort:
            self.client.abort_requests(result.reqs_to_abort)
        for ro in result.request_outputs:
            stream = self._streams.get(ro.request_id)
            if stream is None:
                continue
            if ro.finished:
                stream.finished = True
                self._finished(stream, _finish_reason(ro))
            stream.put(ro)

    def _fail(self, engine_request_id: str, error: BaseException) -> None:
        rid = self._client_of.get(engine_request_id)
        stream = self._streams.get(rid) if rid is not None else None
        if stream is not None:
            stream.put(error)
            self._forget(stream.request_id, abort=True)

    def _pooled(self, out: EngineCoreOutput) -> None:
        stream = self._streams.get(self._client_of.get(out.request_id, ""))
        if stream is None or stream.pooling is None:
            return
        try:
            item: Any = pooling_request_output(stream.pooling, out)
        except ValueError as exc:
            item = EngineRequestError(str(exc))
        stream.finished = True
        self._finished(stream, "stop")
        stream.put(item)

    def on_request_error(self, request_ids: list[str], error: EngineRequestError) -> None:
        failed = {self._client_of[eid] for eid in request_ids if eid in self._client_of}
        if self.metrics is not None and error.cut_reason is not None and failed:
            self.metrics.count_cut(error.cut_reason, len(failed))
        for rid in failed:
            stream = self._streams.get(rid)
            if stream is not None:
                stream.put(error)
            self._forget(rid, abort=True)  # siblings of an n > 1 request too

    def _count_tokens(self, engine_id: str, num: int, now: float) -> None:
        stream = self._streams.get(self._client_of.get(engine_id, ""))
        if stream is None or not num:
            return
        stream.t_last = now
        stream.num_tokens += num

    def _finished(self, stream: RequestStream, reason: str) -> None:
        """With ``logging.log_requests``, log one line for a finished request."""
        latency = time.monotonic() - stream.t_arrival
        if self.config.logging.log_requests:
            logger.info(
                "request_finished",
                request_id=stream.request_id,
                finish_reason=reason,
                prompt_tokens=stream.prompt_len,
                completion_tokens=stream.num_tokens,
                latency_s=round(latency, 4),
            )


def _finish_reason(ro: RequestOutput) -> str:
    reasons = [c.finish_reason for c in ro.outputs if c.finish_reason]
    return reasons[-1] if reasons else "stop"


def _import_frontend() -> tuple[type, type]:
    """Import the engine's frontend side and the tokenizer stack (about a second)."""
    import transformers  # noqa: F401 - the tokenizer backend, imported once here

    from pkgd.frontend.input_processor import InputProcessor
    from pkgd.frontend.output_processor import OutputProcessor
    from pkgd.frontend.structured_outputs import load_xgrammar
    from pkgd.frontend.tokenizer import load_tokenizer  # noqa: F401
    from pkgd.model_files.resolve import resolve_model  # noqa: F401

    load_xgrammar()  # the constraint checker's grammar builder (torch-free)

    return InputProcessor, OutputProcessor


def _prepare_frontend(config: VllmConfig, load: bool) -> tuple[tuple[type, type], tuple[Any, dict[str, Any]] | None]:
    """`_import_frontend`, then `load_frontend_model` when ``load`` and the model resolves
    without a conversion (else None: `NotConverted`). Raises what `load_frontend_model` raises."""
    from pkgd.model_files.resolve import NotConverted

    classes = _import_frontend()
    if not load:
        return classes, None
    try:
        return classes, load_frontend_model(config, convert=False)
    except NotConverted:
        return classes, None


def load_frontend_tokenizer(config: VllmConfig) -> Any:
    """The served model's tokenizer, from the directory ``model.source`` resolves to.

    The engine core resolved (and, for a GGUF, converted) the model before any API server
    started, so this only reads the cached files.
    """
    return load_frontend_model(config)[0]


def load_frontend_model(config: VllmConfig, *, convert: bool = True) -> tuple[Any, dict[str, Any]]:
    """The served model's tokenizer and the sampling defaults of ``model.generation_config``
    (`pkgd.model_files.generation`), from the resolved model directory (``convert``: as in
    `pkgd.model_files.resolve.resolve_model`, whose errors it raises, with the tokenizer's)."""
    from pkgd.frontend.tokenizer import load_tokenizer
    from pkgd.model_files.generation import generation_defaults
    from pkgd.model_files.resolve import resolve_model

    files = resolve_model(config.model, convert=convert)
    tokenizer = load_tokenizer(files.tokenizer_dir, chat_template=config.model.chat_template)
    return tokenizer, generation_defaults(config.model.generation_config, files.model_dir)
