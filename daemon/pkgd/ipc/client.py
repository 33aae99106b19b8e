"""`EngineClient`: an API server's asyncio connection to every engine core.

One DEALER socket per core address (`pkgd.ipc.transport`). Per core the client:
- sends `Hello` whenever a connection comes up (the first one, and again after the
  supervisor restarted the core at the same address) and marks the core available when the
  `Handshake` answers, with the protocol version checked;
- watches the connection through a socket monitor: when it drops, the core is unavailable
  and every request in flight on it fails with `EngineRequestError` at once (never a hang);
- reads `EngineOutputs` / `EngineError` frames and hands them to the `OutputSink`
  (``AsyncLLM``), which turns engine outputs into ``RequestOutput``s. A large step's outputs
  are handed over in chunks of ``OUTPUT_CHUNK`` with the event loop yielded between them
  (vLLM's ``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE``), so detokenizing hundreds of sequences never
  stalls the other work of the loop for a whole step.

New requests go to the least loaded available core (data-parallel balancing): its load is
this client's own in-flight count there plus the requests of *other* clients, taken from the
core's last `SchedulerStats` (running + waiting minus what this client had in flight then).
Ties rotate. With no core available `add_requests` raises `EngineUnavailableError` (the API
answers 503).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import uuid
from collections.abc import Sequence
from typing import Any, Protocol, cast

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pkgd import log
from pkgd.ipc import transport
from pkgd.ipc.messages import (
    PROTOCOL_VERSION,
    AbortRequests,
    AddRequest,
    EngineCoreOutput,
    EngineCoreRequest,
    EngineError,
    EngineOutputs,
    Handshake,
    Hello,
    Message,
    SchedulerStats,
    UtilityMethod,
    UtilityRequest,
    UtilityResult,
    decode_engine,
    encode,
)

logger = log.get_logger(__name__)

OUTPUT_CHUNK = 32  # engine outputs processed per turn of the event loop
_UP = getattr(zmq, "EVENT_HANDSHAKE_SUCCEEDED", zmq.EVENT_CONNECTED)
_DOWN = zmq.EVENT_DISCONNECTED


class EngineUnavailableError(RuntimeError):
    """No engine core is connected and handshaken (starting, restarting or gone)."""


class EngineRequestError(RuntimeError):
    """A request failed in or on the way to an engine core.

    ``rejected`` is True when the core refused it as invalid (HTTP 400), False when the core
    failed, shut down or disappeared (HTTP 5xx). ``cut_reason`` names why a request that was
    running was ended from outside (``engine_lost``, ``drain_timeout``,
    ``reload_drain_timeout``), for the ``pkgd:requests_cut`` counter.
    """

    def __init__(self, message: str, *, rejected: bool = False, cut_reason: str | None = None) -> None:
        super().__init__(message)
        self.rejected = rejected
        self.cut_reason = cut_reason


class OutputSink(Protocol):
    """Where the client delivers what the cores send (implemented by ``AsyncLLM``)."""

    def on_outputs(self, msg: EngineOutputs) -> None:
        """One step's outputs of this client's requests on ``msg.engine_index``."""

    def on_request_error(self, request_ids: list[str], error: EngineRequestError) -> None:
        """These requests failed; nothing more will arrive for them."""


class _Core:
    """Client-side state of one engine core."""

    def __init__(self, position: int, address: str, sock: zmq.asyncio.Socket) -> None:
        self.position = position  # index in the address list
        self.address = address
        self.sock = sock
        self.handshake: Handshake | None = None
        self.engine_index: int | None = None  # from the last handshake, kept while down
        self.connected = False
        self.inflight: set[str] = set()
        self.stats = SchedulerStats()
        self.inflight_at_stats = 0
        self.reading = asyncio.Lock()  # held while one frame's outputs are being delivered

    @property
    def available(self) -> bool:
        return self.connected and self.handshake is not None

    def load(self) -> int:
        others = self.stats.num_running_reqs + self.stats.num_waiting_reqs - self.inflight_at_stats
        return len(self.inflight) + max(0, others)


class EngineClient:
    """Connects to the engine cores at ``addresses`` and multiplexes requests over them."""

    def __init__(self, addresses: Sequence[str], sink: OutputSink, *, client_id: str | None = None) -> None:
        if not addresses:
            raise ValueError("EngineClient needs at least one engine address")
        for address in addresses:
            transport.check_address(address)
        self.client_id = client_id or f"api-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._sink = sink
        self._ctx = zmq.asyncio.Context()
        self._cores = [
            # an asyncio context makes asyncio sockets
            _Core(i, address, cast(zmq.asyncio.Socket, transport.dealer(self._ctx, self.client_id.encode())))
            for i, address in enumerate(addresses)
        ]
        self._owner: dict[str, _Core] = {}  # request id -> core running it
        self._rotation = itertools.count()
        self._calls = itertools.count(1)
        self._pending: dict[int, tuple[_Core, asyncio.Future[UtilityResult]]] = {}  # call id -> (core, answer)
        self._tasks: list[asyncio.Task] = []
        self._changed = asyncio.Event()

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self, timeout: float = 30.0) -> bool:
        """Start the reader and monitor tasks; wait up to ``timeout`` s for every core's
        handshake. Returns True when all answered, False when some are still loading (not
        an error: the client keeps trying, `unavailable` says which)."""
        for core in self._cores:
            monitor = core.sock.get_monitor_socket(_UP | _DOWN)  # before connect: miss no event
            core.sock.connect(core.address)
            self._tasks.append(
                asyncio.create_task(self._monitor(core, monitor), name=f"engine-monitor-{core.position}")
            )
            self._tasks.append(asyncio.create_task(self._reader(core), name=f"engine-reader-{core.position}"))
        try:
            await asyncio.wait_for(self._wait_all(), timeout)
        except TimeoutError:
            # Not a fault by itself: engine cores loading a model answer later, and the
            # caller decides how long that may take (supervisor.engine_ready_timeout).
            logger.debug("engine_handshake_pending", missing=self.unavailable())
            return False
        return True

    async def _wait_all(self) -> None:
        while not all(c.available for c in self._cores):
            self._changed.clear()
            await self._changed.wait()

    async def close(self) -> None:
        """Fail what is in flight, stop the tasks and close the sockets."""
        for core in self._cores:
            self._fail_core(core, "the API server is shutting down")
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for core in self._cores:
            core.sock.disable_monitor()
        self._ctx.destroy(linger=0)

    # ---- queries -------------------------------------------------------------------------

    def unavailable(self) -> list[str]:
        """Addresses of the cores that cannot take requests now (loading, or down)."""
        return [c.address for c in self._cores if not c.available]

    def is_available(self) -> bool:
        """True when at least one core can take requests."""
        return any(c.available for c in self._cores)

    @property
    def handshake(self) -> Handshake | None:
        """The handshake of the first available core (what the frontend needs to know)."""
        return next((c.handshake for c in self._cores if c.available), None)

    def engine_stats(self) -> dict[int, SchedulerStats]:
        """Last `SchedulerStats` per engine index (all zero for a core that is down: its
        requests failed), of the cores that ever handshook."""
        return {c.engine_index: c.stats for c in self._cores if c.engine_index is not None}

    def engine_info(self) -> dict[int, tuple[Handshake | None, SchedulerStats]]:
        """`engine_stats` with each core's handshake (None while it is down)."""
        return {c.engine_index: (c.handshake, c.stats) for c in self._cores if c.engine_index is not None}

    def num_inflight(self) -> int:
        return len(self._owner)

    # ---- requests ------------------------------------------------------------------------

    def add_requests(self, requests: Sequence[EngineCoreRequest]) -> int:
        """Send ``requests`` (one prompt's requests, e.g. its ``n`` samples) to the least
        loaded available core; returns that core's engine index.

        Raises:
            EngineUnavailableError: no core is available, or sending to the chosen core
                failed (its requests in flight then fail too).
        """
        candidates = [c for c in self._cores if c.available]
        if not candidates:
            raise EngineUnavailableError("no engine core is available (starting or restarting); retry shortly")
        try:
            frames = [encode(AddRequest(request=req)) for req in requests]
        except (msgspec.EncodeError, OverflowError, TypeError) as exc:  # nothing sent
            raise EngineRequestError(f"the request cannot be sent to the engine: {exc}", rejected=True) from None
        turn = next(self._rotation)
        n = len(self._cores)
        core = min(candidates, key=lambda c: (c.load(), (c.position - turn) % n))
        for req, frame in zip(requests, frames, strict=True):
            if not self._send_frame(core, frame):
                self._fail_core(core, f"engine core at {core.address} is not reachable")
                raise EngineUnavailableError(f"engine core at {core.address} is not reachable; retry shortly")
            core.inflight.add(req.request_id)
            self._owner[req.request_id] = core
        return core.handshake.engine_index  # type: ignore[union-attr]

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        """Abort requests in their cores; ids not in flight are ignored. Nothing more is
        delivered for them."""
        by_core: dict[int, list[str]] = {}
        for rid in request_ids:
            core = self._owner.pop(rid, None)
            if core is not None:
                core.inflight.discard(rid)
                by_core.setdefault(core.position, []).append(rid)
        for position, ids in by_core.items():
            self._send(self._cores[position], AbortRequests(request_ids=ids))

    async def call_utility(
        self, method: UtilityMethod, args: dict | None = None, *, timeout: float = 600.0
    ) -> list[UtilityResult]:
        """Call ``method`` on every available engine core at once; their answers in core order.

        Raises:
            EngineUnavailableError: no core is available, a core went away before answering,
                or ``timeout`` seconds passed (a sleep or wake-up reloading weights is slow).
        """
        cores = [c for c in self._cores if c.available]
        if not cores:
            raise EngineUnavailableError("no engine core is available (starting or restarting); retry shortly")
        loop = asyncio.get_running_loop()
        ids: list[int] = []
        for core in cores:
            call_id = next(self._calls)
            fut: asyncio.Future[UtilityResult] = loop.create_future()
            self._pending[call_id] = (core, fut)
            ids.append(call_id)
            if not self._send(core, UtilityRequest(call_id=call_id, method=method, args=args or {})):
                fut.set_exception(EngineUnavailableError(f"engine core at {core.address} is not reachable"))
        waits = [self._pending[i][1] for i in ids]
        try:
            return list(await asyncio.wait_for(asyncio.gather(*waits), timeout))
        except TimeoutError:
            raise EngineUnavailableError(f"the engine cores did not answer {method} within {timeout:.0f} s") from None
        finally:
            for call_id in ids:
                self._pending.pop(call_id, None)

    # ---- internals -----------------------------------------------------------------------

    def _send(self, core: _Core, msg: Message) -> bool:
        return self._send_frame(core, encode(msg))

    def _send_frame(self, core: _Core, frame: bytes) -> bool:
        # pyzmq annotates an Awaitable; zmq.asyncio returns an asyncio.Future
        fut = cast("asyncio.Future[Any]", core.sock.send(frame, flags=zmq.DONTWAIT))
        exc = fut.exception()  # DONTWAIT futures are already done
        if exc is not None:
            logger.warning("engine_send_failed", address=core.address, error=str(exc))
            return False
        return True

    async def _monitor(self, core: _Core, monitor: zmq.asyncio.Socket) -> None:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            if event == _UP:
                core.connected = True
                core.handshake = None
                if not self._send(core, Hello(version=PROTOCOL_VERSION, client_id=self.client_id)):
                    core.connected = False
            elif event == _DOWN and core.connected:
                # A dying core's last frames (its errors) may sit in the socket or in the
                # reader's resolved future: let them be dispatched (after the frame being
                # delivered, so outputs stay in order) before failing the rest.
                async with core.reading:
                    self._drain(core)
                await asyncio.sleep(0)
                async with core.reading:
                    self._drain(core)
                core.connected = False
                was = core.handshake
                core.handshake = None
                core.stats, core.inflight_at_stats = SchedulerStats(), 0
                logger.warning(
                    "engine_disconnected", address=core.address, engine_index=was.engine_index if was else None
                )
                self._fail_core(core, f"engine core at {core.address} disconnected (crashed or restarting)")
            self._changed.set()

    async def _reader(self, core: _Core) -> None:
        while True:
            frame = await core.sock.recv()
            async with core.reading:
                msg = self._decode(core, frame)
                try:
                    if isinstance(msg, EngineOutputs) and len(msg.outputs) > OUTPUT_CHUNK:
                        await self._deliver_in_chunks(core, msg)
                    elif msg is not None:
                        self._handle(core, msg)
                except Exception:  # the sink's bug: keep reading, or every stream here hangs
                    logger.exception("engine_frame_failed", address=core.address)

    async def _deliver_in_chunks(self, core: _Core, msg: EngineOutputs) -> None:
        outputs = msg.outputs
        for start in range(0, len(outputs), OUTPUT_CHUNK):
            stats = msg.scheduler_stats if start == 0 else None
            self._on_outputs(
                core, msgspec.structs.replace(msg, outputs=outputs[start : start + OUTPUT_CHUNK], scheduler_stats=stats)
            )
            await asyncio.sleep(0)

    def _drain(self, core: _Core) -> None:
        """Dispatch the frames already received (a dying core's last errors come first)."""
        while True:
            fut = cast("asyncio.Future[bytes]", core.sock.recv(flags=zmq.DONTWAIT))  # as in _send
            if fut.exception() is not None:
                return
            self._dispatch(core, fut.result())

    def _dispatch(self, core: _Core, frame: bytes) -> None:
        msg = self._decode(core, frame)
        if msg is not None:
            self._handle(core, msg)

    def _decode(self, core: _Core, frame: bytes) -> Message | None:
        try:
            return decode_engine(frame)
        except msgspec.DecodeError as exc:
            logger.warning("bad_engine_frame", address=core.address, error=str(exc))
            return None

    def _handle(self, core: _Core, msg: Message) -> None:
        if isinstance(msg, EngineOutputs):
            self._on_outputs(core, msg)
        elif isinstance(msg, EngineError):
            self._on_error(core, msg)
        elif isinstance(msg, Handshake):
            self._on_handshake(core, msg)
        elif isinstance(msg, UtilityResult):
            _, fut = self._pending.pop(msg.call_id, (None, None))
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def _on_handshake(self, core: _Core, msg: Handshake) -> None:
        if msg.version != PROTOCOL_VERSION:
            logger.error("engine_version_mismatch", address=core.address, engine=msg.version, client=PROTOCOL_VERSION)
            return
        core.handshake = msg
        core.engine_index = msg.engine_index
        logger.info("engine_connected", address=core.address, engine_index=msg.engine_index, pid=msg.pid)
        self._changed.set()

    def _on_outputs(self, core: _Core, msg: EngineOutputs) -> None:
        if msg.scheduler_stats is not None:
            core.stats = msg.scheduler_stats
            core.inflight_at_stats = len(core.inflight)
        if not msg.outputs:
            return
        live: list[EngineCoreOutput] = []
        for out in msg.outputs:
            if out.request_id not in core.inflight:
                continue  # aborted here while the core was stepping
            live.append(out)
            if out.finish_reason is not None:
                core.inflight.discard(out.request_id)
                self._owner.pop(out.request_id, None)
        if live:
            msg.outputs = live
            self._sink.on_outputs(msg)

    def _on_error(self, core: _Core, msg: EngineError) -> None:
        if not msg.request_ids:
            logger.error("engine_error", address=core.address, message=msg.message)
            return
        ids = [rid for rid in msg.request_ids if rid in core.inflight]
        for rid in ids:
            core.inflight.discard(rid)
            self._owner.pop(rid, None)
        if ids:
            self._sink.on_request_error(ids, EngineRequestError(msg.message, rejected=msg.rejected))

    def _fail_core(self, core: _Core, message: str) -> None:
        for call_id, (target, fut) in list(self._pending.items()):
            if target is core and not fut.done():
                fut.set_exception(EngineUnavailableError(message))
        ids = list(core.inflight)
        core.inflight.clear()
        for rid in ids:
            self._owner.pop(rid, None)
        if ids:
            self._sink.on_request_error(ids, EngineRequestError(message, cut_reason="engine_lost"))
