"""The API server's gRPC layer (``frontend.grpc``): ``grpc.aio`` serving `VllmEngineServicer`
on the listening socket the supervisor owns.

gRPC's server binds its own sockets and cannot take an inherited listening one, so it listens
on a private abstract Unix socket and this module accepts on the supervisor's socket and
relays each connection's bytes to it. The supervisor's socket thereby keeps every property
the HTTP servers rely on: restarts and reloads never close the port, several API servers
share it, systemd socket activation and ``frontend.uds`` work, and at most
``frontend.max_connections`` connections are taken (gRPC multiplexes its calls on few
connections; a connection over the cap waits in the backlog or goes to another API server).

* **Auth**: with ``frontend.api_keys``, every method but ``HealthCheck`` (as ``/health``)
  needs the metadata ``authorization: Bearer <key>``; else UNAUTHENTICATED.
* **Limits**: a request message over ``frontend.max_request_body_bytes`` is
  RESOURCE_EXHAUSTED (gRPC's receive limit); the per-request limits are the servicer's.
* **Drain** (`GrpcServer.begin_drain`): this process's copy of the socket is closed (on a
  retire the queued connections stay for the next generation, which accepts on the same
  socket), and gRPC's shutdown sends every connection a GOAWAY: calls in progress go on, new
  calls are refused and the client opens a new connection, to the API servers still
  accepting. ``HealthCheck`` answers not healthy (``draining``). The drain ends when the last
  call does or at its deadline (``supervisor.drain_timeout``, or on a retire
  ``supervisor.reload_drain_timeout``, none when null); then ``on_drain_timeout`` fails what
  is left (each Generate ends with UNAVAILABLE) and the connections close.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from pkgd import log
from pkgd.api.app import bearer_authorized
from pkgd.api.grpc_servicer import VllmEngineServicer

if TYPE_CHECKING:
    from pkgd.api.state import ServerState

logger = log.get_logger(__name__)

RELAY_CHUNK = 256 * 1024  # bytes read at once from either side of a relayed connection
ACCEPT_RETRY_S = 0.1  # after EMFILE/ENFILE/ENOBUFS: the process is out of descriptors
CLOSE_GRACE_S = 2.0  # after the drain deadline: time for failed calls to send their status
FOREVER_S = 10 * 365 * 86400.0  # gRPC's shutdown grace when the drain has no deadline
OPEN_METHODS = frozenset({"/vllm.grpc.engine.VllmEngine/HealthCheck"})
UNAUTHENTICATED = "invalid or missing API key (send the metadata 'authorization: Bearer <key>')"


class _Auth(grpc.aio.ServerInterceptor):
    """``frontend.api_keys`` (read at each call, so a live reload applies at once)."""

    def __init__(self, keys: Callable[[], list[Any]]) -> None:
        self.keys = keys

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        keys = self.keys()
        if handler is None or not keys or details.method in OPEN_METHODS:
            return handler
        header = next((str(v) for k, v in details.invocation_metadata or () if k == "authorization"), "")
        if bearer_authorized(header, keys):
            return handler
        return _denied(handler)


def _denied(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.response_streaming:

        async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)
            yield  # pragma: no cover - abort raises

        return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)

    return grpc.unary_unary_rpc_method_handler(deny, **kw)


class GrpcServer:
    """Serves `VllmEngineServicer` over ``state`` on ``sock`` until `serve`'s ``stop`` is set,
    then drains (module docstring). ``on_drain_timeout(reason)`` fails the calls still in
    flight at the drain deadline."""

    def __init__(
        self,
        state: ServerState,
        sock: socket.socket,
        *,
        on_drain_timeout: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.state = state
        self.sock = sock
        sock.setblocking(False)
        self.on_drain_timeout = on_drain_timeout
        # abstract namespace: no file to clean up, gone with the process
        self.address = f"pkgd-grpc-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.server: grpc.aio.Server | None = None
        self.relays: set[asyncio.Task[None]] = set()
        self.draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reading = False
        self._closed = False
        self._deadline: float | None = None
        self._cut_reason = "drain_timeout"
        self._deadline_changed = asyncio.Event()
        self._stopped: asyncio.Future[Any] | None = None

    async def serve(self, stop: asyncio.Event, lifespan: Any, drain_timeout: Callable[[], float]) -> None:
        """Enter ``lifespan`` (the engine client's start-up and shutdown), serve until ``stop``
        is set, drain. Raises what the start-up raised."""
        self._loop = asyncio.get_running_loop()
        f = self.state.config.frontend
        self.server = grpc.aio.server(
            interceptors=[_Auth(lambda: self.state.config.frontend.api_keys)],
            options=[
                ("grpc.max_receive_message_length", f.max_request_body_bytes),
                ("grpc.so_reuseport", 0),
            ],
        )
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(self.state), self.server)
        self.server.add_insecure_port(f"unix-abstract:{self.address}")
        async with lifespan:
            await self.server.start()
            self._resume()
            await stop.wait()
            if not self.draining:
                self.begin_drain(drain_timeout())
            await self._drain()

    def begin_drain(self, within: float | None, *, cut_reason: str = "drain_timeout", retire: bool = False) -> None:
        """Start the drain (module docstring); called again it only moves the deadline closer.
        ``retire`` leaves the socket's queue to the next generation (always so here: gRPC
        clients reconnect on their own, so a queued connection is better served there)."""
        assert self._loop is not None
        deadline = None if within is None else self._loop.time() + within
        if self.draining:
            if deadline is not None and (self._deadline is None or deadline < self._deadline):
                self._deadline, self._cut_reason = deadline, cut_reason
                self._deadline_changed.set()
            return
        self.draining = True
        self._deadline, self._cut_reason = deadline, cut_reason
        self._close_listener()
        if self.server is not None:  # GOAWAY now: new calls go to a new connection
            grace = FOREVER_S if within is None else within + CLOSE_GRACE_S
            self._stopped = asyncio.ensure_future(self.server.stop(grace))

    async def _drain(self) -> None:
        assert self._loop is not None and self._stopped is not None
        logger.info("grpc_draining", connections=len(self.relays), inflight=self.state.llm.num_inflight())
        while not self._stopped.done():
            left = None if self._deadline is None else self._deadline - self._loop.time()
            if left is not None and left <= 0:
                break
            self._deadline_changed.clear()
            changed: asyncio.Future[Any] = asyncio.ensure_future(self._deadline_changed.wait())
            await asyncio.wait({self._stopped, changed}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            changed.cancel()
        if not self._stopped.done():
            logger.warning(self._cut_reason, inflight=self.state.llm.num_inflight())
            self.on_drain_timeout(self._cut_reason)
            await asyncio.wait({self._stopped}, timeout=CLOSE_GRACE_S)
        if self.relays:
            # gRPC closes its side of each connection once it is done with it; until then the
            # relay carries its last frames (the final GOAWAY naming the calls it took, so a
            # client retries one it sent meanwhile elsewhere): cut, the client could not tell
            await asyncio.wait(set(self.relays), timeout=CLOSE_GRACE_S)
        for task in list(self.relays):
            task.cancel()
        await asyncio.gather(*self.relays, return_exceptions=True)
        if not self._stopped.done():
            self._stopped.cancel()

    # ---- accepting and relaying --------------------------------------------------------------

    def _resume(self) -> None:
        if self._closed or self._reading or len(self.relays) >= self.state.config.frontend.max_connections:
            return
        assert self._loop is not None
        self._loop.add_reader(self.sock.fileno(), self._accept)
        self._reading = True

    def _pause(self) -> None:
        if self._reading and self._loop is not None:
            self._loop.remove_reader(self.sock.fileno())
        self._reading = False

    def _close_listener(self) -> None:
        if not self._closed:
            self._closed = True
            self._pause()
            self.sock.close()

    def _accept(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            logger.warning("accept_failed", error=exc.strerror, retry_s=ACCEPT_RETRY_S)
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM) and self._loop is not None:
                self._pause()  # out of descriptors: the socket stays readable, so look again later
                self._loop.call_later(ACCEPT_RETRY_S, self._resume)
            return
        assert self._loop is not None
        task = self._loop.create_task(self._relay(conn))
        self.relays.add(task)
        task.add_done_callback(self._relay_done)
        if len(self.relays) >= self.state.config.frontend.max_connections:
            self._pause()

    def _relay_done(self, task: asyncio.Task[None]) -> None:
        self.relays.discard(task)
        self._resume()

    async def _relay(self, conn: socket.socket) -> None:
        """Copy bytes both ways between a client connection and gRPC's socket."""
        loop = asyncio.get_running_loop()
        conn.setblocking(False)
        if conn.family in (socket.AF_INET, socket.AF_INET6):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # token-sized frames
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        upstream.setblocking(False)
        copies: list[asyncio.Task[None]] = []
        try:
            await loop.sock_connect(upstream, "\0" + self.address)
            copies = [loop.create_task(_copy(loop, conn, upstream)), loop.create_task(_copy(loop, upstream, conn))]
            pending = set(copies)
            while pending:  # one side's EOF half-closes the other; an error ends both
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                if any(not t.cancelled() and t.exception() is not None for t in done):
                    break
        except OSError:
            pass  # gRPC's socket is gone (shut down): the client reconnects elsewhere
        finally:
            for t in copies:
                t.cancel()
            await asyncio.gather(*copies, return_exceptions=True)
            upstream.close()
            conn.close()


async def _copy(loop: asyncio.AbstractEventLoop, src: socket.socket, dst: socket.socket) -> None:
    while True:
        data = await loop.sock_recv(src, RELAY_CHUNK)
        if not data:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
            return
        await loop.sock_sendall(dst, data)
