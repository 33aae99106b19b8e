"""The API server's HTTP layer: hypercorn's HTTP/1.1 protocol on the inherited listening socket,
with what a supervised daemon needs and ``hypercorn.asyncio.serve`` lacks.

hypercorn parses and writes HTTP (its ``TCPServer`` per connection, h11 underneath); this
module owns the listening socket and the connections:

* **Accepting.** One connection per readiness event, and a server that already holds
  connections waits a little (``ACCEPT_DELAY_PER_CONNECTION`` per open connection, at most
  ``ACCEPT_DELAY_MAX``) before it accepts when it shares the socket with other API servers,
  so the least loaded one tends to win each new connection (asyncio's own accept loop takes
  the whole backlog at once, which put 29 of 32 streams on one of two servers).
* **At ``frontend.max_connections``** a new connection is accepted by shedding the one that has
  waited longest (at least ``SHED_AFTER_S``) without a whole request: an idle keep-alive one
  or one with part of a head first (closed with a FIN, never with a request read in part),
  else one whose body is still arriving unanswered (reset). A request received whole, or being
  answered, is never shed (`_Shedder` says why shedding, and not a per-address cap). With
  nothing to shed it stops accepting: new connections wait in the kernel's backlog or go to
  another server on the socket.
* **Slow clients.** ``frontend.header_timeout`` bounds a request's head from its first byte
  (an idle connection is bounded by ``frontend.keep_alive_timeout``, hypercorn's idle timer),
  ``frontend.body_timeout`` its body (`pkgd.api.app.GuardMiddleware`), and
  ``frontend.write_timeout`` a response write to a client that stopped reading; each closes
  the connection, so slow clients cannot pile up connections or buffered output, and at the
  connection cap they are shed before these fire (above).
* **Answers before the body** (a 413 over ``frontend.max_request_body_bytes``, a 401): the rest
  of the body is read and dropped, not given to hypercorn (the finished request's queue would
  fill and hang the connection for good), so a client that reads only once it has sent its
  body still gets the answer; the connection closes when the client is done, at most
  ``LINGER_S`` later.
* **Errors of the protocol itself** (a malformed request line: 400; headers over
  hypercorn's ``h11_max_incomplete_size``: 431) answer an OpenAI-shaped JSON body.
* **Drain** (`HttpServer.begin_drain`, or `HttpServer.serve`'s ``stop``): this process's copy
  of the socket is closed — on a shutdown after accepting every connection already queued (the
  socket itself is closing: a connection made after that is refused, never reset), on a retire
  without (the queue is the next generation's, which accepts on the same socket). A request
  on a connection already open is still served, every response with ``Connection: close`` (set
  by the app while ``state.draining``) and its connection closed after it, so each connection
  takes at most one more request. Idle keep-alive connections are not closed early: a client
  may be sending its next request at that very moment, and a request cut before its answer is
  one the client cannot tell was never taken (with back-to-back keep-alive clients it happened
  to half of them); they close after that request, at ``keep_alive_timeout``, or when the
  client closes them. The drain ends when the last connection does, or at its deadline (none,
  or one that a later `begin_drain` moves closer): ``on_drain_timeout`` then fails what is in
  flight (each stream ends with an error event and ``[DONE]``), and what is still open
  ``CLOSE_GRACE_S`` later is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import json
import select
import socket
from collections.abc import Callable
from ssl import SSLError
from typing import TYPE_CHECKING, Any

import h11
from hypercorn.asyncio.lifespan import Lifespan
from hypercorn.asyncio.tcp_server import MAX_RECV, TCPServer
from hypercorn.asyncio.worker_context import WorkerContext
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, RawData, Updated
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.utils import wrap_app

from pkgd import log
from pkgd.api.errors import error_body

if TYPE_CHECKING:
    from pkgd.config.sections import FrontendConfig

logger = log.get_logger(__name__)

ACCEPT_DELAY_PER_CONNECTION = 0.001  # s of accept delay per open connection (shared socket)
ACCEPT_DELAY_MAX = 0.02  # s
ACCEPT_RETRY_S = 0.1  # after EMFILE/ENFILE/ENOBUFS: the process is out of descriptors
CLOSE_GRACE_S = 2.0  # after the drain deadline: time for failed requests to send their error
# After answering a request whose body was not read (a 413, a 401): how long the rest of the
# body is read and dropped before the connection is closed (nginx's lingering close).
LINGER_S = 5.0
# At frontend.max_connections: how long a connection must have waited without a whole request
# (`_Shedder`) before it may be closed for a new one. A client sends its request within a round
# trip of connecting (or of its previous answer); a burst of such clients over the cap waits in
# the backlog, as before, rather than cutting each other off.
SHED_AFTER_S = 0.5
SHED_RETRY_S = 0.05  # the only candidates have bytes not read yet: look again this much later

_PROTOCOL_ERRORS = {
    400: "malformed HTTP request",
    431: "request headers too large",
}


class HttpServer:
    """Serves ``app`` (ASGI) on ``sock`` until `serve`'s ``stop`` is set, then drains.

    ``frontend`` returns the current ``frontend`` config section (read at each use, so live
    reloads of the limits apply to new connections). ``shared``: other processes accept on
    the same socket. ``on_drain_timeout(reason)`` is called when connections are still open at
    the drain deadline (the caller fails its requests in flight; ``reason`` is the
    ``cut_reason`` of the `begin_drain` that set the deadline).
    """

    def __init__(
        self,
        app: Any,
        config: HypercornConfig,
        sock: socket.socket,
        frontend: Callable[[], FrontendConfig],
        *,
        shared: bool = False,
        on_drain_timeout: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.app = wrap_app(app, config.wsgi_max_body_size, "asgi")
        self.config = config
        self.sock = sock
        sock.setblocking(False)
        self.frontend = frontend
        self.shared = shared
        self.on_drain_timeout = on_drain_timeout
        self.connections: set[asyncio.Task[None]] = set()
        self.accepted = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._context = WorkerContext(None)
        self._state: dict[str, Any] = {}
        self._reading = False
        self._closed = False
        self._pending_accept: asyncio.TimerHandle | None = None
        self._shedder = _Shedder()
        self._shed_timer: asyncio.TimerHandle | None = None
        self.draining = False
        self._deadline: float | None = None  # loop time the drain ends what is left
        self._cut_reason = "drain_timeout"
        self._deadline_changed = asyncio.Event()

    @property
    def shed(self) -> int:
        """Connections closed so far to let a new one in at ``max_connections`` (`_Shedder`)."""
        return self._shedder.count

    # ---- life -----------------------------------------------------------------------------

    async def serve(self, stop: asyncio.Event, drain_timeout: Callable[[], float]) -> None:
        """Run the app's lifespan, accept until ``stop`` is set, drain (a shutdown drain of
        ``drain_timeout()`` s unless `begin_drain` started one), shut the lifespan down.

        Raises whatever the lifespan's start-up raised (the app failed to start). A lifespan
        task that ended after its start-up completed (cancelled, or failed after ``yield``)
        does not make a started server fail: it serves on and says so in the log.
        """
        self._loop = loop = asyncio.get_running_loop()
        lifespan = _Lifespan(self.app, self.config, loop, self._state)
        lifespan_task = loop.create_task(lifespan.handle_lifespan())
        try:
            await lifespan.wait_for_startup()
            _check_started(lifespan, lifespan_task)
            self._resume()
            await stop.wait()
            if not self.draining:
                self.begin_drain(drain_timeout())
            await self._drain()
        finally:
            self.close_listener()
            await lifespan.wait_for_shutdown()
            lifespan_task.cancel()
            await asyncio.gather(lifespan_task, return_exceptions=True)

    def close_listener(self, *, accept_queued: bool = True) -> None:
        """Close this process's copy of the listening socket, first accepting what is queued
        on it unless ``accept_queued`` is false (other processes keep accepting on it)."""
        if self._closed:
            return
        self._closed = True
        self._pause()
        if self._loop is not None and accept_queued:
            while self._accept_one(final=True):
                pass
        self.sock.close()

    def begin_drain(self, within: float | None, *, cut_reason: str = "drain_timeout", retire: bool = False) -> None:
        """Drain (module docstring); what is in flight ``within`` seconds from now (None: no
        limit) is then failed with ``on_drain_timeout(cut_reason)``. Called again while
        draining it only moves the deadline closer. ``retire``: the socket stays open for a
        newer generation, so its queue is left to it."""
        assert self._loop is not None
        deadline = None if within is None else self._loop.time() + within
        if self.draining:
            if deadline is not None and (self._deadline is None or deadline < self._deadline):
                self._deadline, self._cut_reason = deadline, cut_reason
                self._deadline_changed.set()
            return
        self.draining = True
        self._deadline, self._cut_reason = deadline, cut_reason
        self.close_listener(accept_queued=not retire)

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        logger.info("http_draining", connections=len(self.connections), deadline_s=self._time_left())
        while self.connections:
            left = self._time_left()
            if left is not None and left <= 0:
                break
            self._deadline_changed.clear()
            changed = loop.create_task(self._deadline_changed.wait())
            await asyncio.wait({*self.connections, changed}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            changed.cancel()
        if self.connections:
            logger.warning(self._cut_reason, connections=len(self.connections))
            self.on_drain_timeout(self._cut_reason)
            await asyncio.wait(set(self.connections), timeout=CLOSE_GRACE_S)
        await self._context.terminated.set()
        for task in list(self.connections):
            task.cancel()
        await asyncio.gather(*self.connections, return_exceptions=True)

    def _time_left(self) -> float | None:
        if self._deadline is None or self._loop is None:
            return None
        return self._deadline - self._loop.time()

    # ---- accepting -----------------------------------------------------------------------

    def _resume(self) -> None:
        if self._closed or self._reading or self._pending_accept is not None:
            return
        assert self._loop is not None
        if self._shed_timer is not None:
            self._shed_timer.cancel()
            self._shed_timer = None
        if self._at_cap():
            victim, wait = self._shedder.victim(self._loop.time())
            if victim is None:
                # `_connection_done` resumes, and so does a connection that starts waiting for
                # a request or receiving a body (`_Connection.protocol_send`)
                if wait is not None:
                    self._shed_timer = self._loop.call_later(wait, self._resume_when_sheddable)
                return
        self._loop.add_reader(self.sock.fileno(), self._on_readable)
        self._reading = True

    def _resume_when_sheddable(self) -> None:
        self._shed_timer = None
        self._resume()

    def _at_cap(self) -> bool:
        """``max_connections`` are open (those being shed do not count: they are closing)."""
        return len(self.connections) - len(self._shedder.closing) >= self.frontend().max_connections

    def _pause(self) -> None:
        if self._reading and self._loop is not None:
            self._loop.remove_reader(self.sock.fileno())
        self._reading = False
        if self._shed_timer is not None:
            self._shed_timer.cancel()
            self._shed_timer = None
        if self._pending_accept is not None:
            self._pending_accept.cancel()
            self._pending_accept = None

    def _on_readable(self) -> None:
        self._pause()
        assert self._loop is not None
        delay = min(ACCEPT_DELAY_MAX, ACCEPT_DELAY_PER_CONNECTION * len(self.connections)) if self.shared else 0.0
        if delay:
            self._pending_accept = self._loop.call_later(delay, self._accept_then_resume)
        else:
            self._accept_then_resume()

    def _accept_then_resume(self) -> None:
        self._pending_accept = None
        if self._closed:
            return
        victim = None
        assert self._loop is not None
        if self._at_cap():
            victim, _ = self._shedder.victim(self._loop.time())
            if victim is None:  # it began a request since `_resume` looked
                self._resume()
                return
        if self._accept_one() and victim is not None:
            self._shedder.shed(victim, self._loop.time(), len(self.connections))
        self._resume()

    def _accept_one(self, *, final: bool = False) -> bool:
        """Accept one queued connection; False when none is queued (or it failed)."""
        try:
            conn, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM) and not final:
                logger.warning("accept_failed", error=exc.strerror, retry_s=ACCEPT_RETRY_S)
                assert self._loop is not None
                self._pending_accept = self._loop.call_later(ACCEPT_RETRY_S, self._accept_then_resume)
            return False
        self.accepted += 1
        assert self._loop is not None
        task = self._loop.create_task(self._serve_connection(conn))
        self.connections.add(task)
        task.add_done_callback(self._connection_done)
        return True

    def _connection_done(self, task: asyncio.Task[None]) -> None:
        self.connections.discard(task)
        self._resume()

    async def _serve_connection(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        try:
            reader, writer = await asyncio.open_connection(sock=conn)
        except OSError:
            conn.close()
            return
        connection = _Connection(self, reader, writer, conn)
        try:
            await connection
        finally:
            self._shedder.forget(connection)


class _Shedder:
    """Which connection an API server at ``frontend.max_connections`` closes to let a new one in.

    Without it, connections that send half a request head, or a head and then a body a byte at
    a time, fill the cap and every other client waits in the listen backlog until
    ``header_timeout`` or ``body_timeout`` closes some (10-30 s). Other means were weighed:
    a per-address cap does not tell slow clients from a gateway's many connections (all may come
    from one address, and do behind a proxy or on loopback); a shorter ``header_timeout`` near
    the cap still makes the next client wait that long, and cuts slow legitimate clients even
    when nobody is waiting. Shedding frees a slot only when a connection is queued for it, and
    at once: at the cap the server accepts the new connection and closes the one that has waited
    longest without a whole request, so a client that sends its request promptly gets in
    (`benchmarks/slow_clients.py`: 1,100 slow connections, cap 1,024, a normal request 7.9 s
    median before, about 2 ms with this), while slow ones are cut only as new clients need
    their slots.

    Candidates, in this order, oldest first within each:

    * **waiting for a request** (``waiting``): nothing of one read since the connection opened
      or since its last answer (an idle keep-alive connection), or part of its head; dated
      from then. An idle one is closed only with nothing unread (hypercorn's buffer, the
      stream's, the socket's), so no request is cut half-read: the client sees a FIN between
      requests, as at ``keep_alive_timeout``.
    * **receiving a body** (``receiving``): the head read, the body still arriving, nothing
      answered yet; dated from the head. Only when no connection waits for a request; the
      connection is reset and the app hears a disconnect.

    A connection is a candidate only once it has waited ``SHED_AFTER_S``, so a burst of
    prompt clients over the cap queues in the backlog rather than cutting each other off.
    Never shed: a request received whole (being answered, streaming), a response begun, an
    answer before the body (lingering, at most ``LINGER_S``), a connection that is not
    HTTP/1.1.
    """

    def __init__(self) -> None:
        self.waiting: dict[_Connection, None] = {}  # oldest first (insertion order)
        self.receiving: dict[_Connection, None] = {}
        self.closing: set[_Connection] = set()  # shed, not ended yet
        self.count = 0

    def waiting_for_request(self, conn: _Connection, now: float) -> None:
        self.receiving.pop(conn, None)
        self.waiting.pop(conn, None)
        if conn not in self.closing:
            conn.waiting_since = now
            self.waiting[conn] = None

    def head_received(self, conn: _Connection, now: float) -> None:
        self.waiting.pop(conn, None)
        if conn not in self.closing:
            conn.waiting_since = now
            self.receiving[conn] = None

    def forget(self, conn: _Connection) -> None:
        self.waiting.pop(conn, None)
        self.receiving.pop(conn, None)
        self.closing.discard(conn)

    def victim(self, now: float) -> tuple[_Connection | None, float | None]:
        """The connection to shed now, else ``(None, seconds until one may be)`` (``None``
        seconds: there is no candidate; a connection that becomes one says so)."""
        wait: float | None = None
        for queue, check in (
            (self.waiting, _Connection.sheddable_waiting),
            (self.receiving, _Connection.sheddable_receiving),
        ):
            found = None
            stale = []
            for conn in queue:
                left = conn.waiting_since + SHED_AFTER_S - now
                if left > 0:  # and so are all after it
                    wait = left if wait is None else min(wait, left)
                    break
                verdict = check(conn)
                if verdict:
                    found = conn
                    break
                if verdict is None:
                    stale.append(conn)  # not a candidate before its next request
                else:
                    wait = SHED_RETRY_S if wait is None else min(wait, SHED_RETRY_S)
            for conn in stale:
                del queue[conn]
            if found is not None:
                return found, None
        return None, wait

    def shed(self, conn: _Connection, now: float, connections: int) -> None:
        body = conn in self.receiving
        self.forget(conn)
        self.closing.add(conn)
        self.count += 1
        logger.info(
            "connection_shed",
            waiting_for="body" if body else "request",
            waited_s=round(now - conn.waiting_since, 3),
            connections=connections,
        )
        conn.shed(body=body)


class _Connection(TCPServer):
    """hypercorn's connection with pkgd's header and write deadlines and JSON protocol errors."""

    def __init__(
        self,
        server: HttpServer,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        sock: socket.socket | None = None,
    ) -> None:
        assert server._loop is not None
        super().__init__(server.app, server._loop, server.config, server._context, server._state, reader, writer)
        self.server = server
        self.sock = sock  # to look for bytes not read yet (`sheddable_waiting`)
        self.waiting_since = 0.0  # `_Shedder`
        self._idle = True  # between requests (hypercorn's idle timer runs)
        self._head_started = False
        self._aborted = False
        self._lingering = False  # answered before the request body ended: drop the rest
        self._task: asyncio.Task[Any] | None = None

    async def protocol_send(self, event: Any) -> None:
        if isinstance(event, Updated):
            self._idle = event.idle
            if event.idle:
                self._head_started = False
                self.server._shedder.waiting_for_request(self, self.loop.time())
            else:
                self.server._shedder.head_received(self, self.loop.time())
            self.server._resume()  # at the cap: a candidate to shed, now or later
        if isinstance(event, RawData):
            if self._aborted:
                return  # the app may write on until it sees the disconnect
            timeout = self.server.frontend().write_timeout
            try:
                await asyncio.wait_for(super().protocol_send(event), timeout)
            except TimeoutError:
                logger.info("write_timeout", timeout_s=timeout)
                self._aborted = True
                self.writer.transport.abort()
                await self.protocol.handle(Closed())
                return
            self._linger_if_body_unread()
            return
        await super().protocol_send(event)

    def _linger_if_body_unread(self) -> None:
        """When the response just written ended while the client is still sending its request
        body: half-close (the client has the whole answer), drop what it sends from now on
        (`_read_data`), and end the connection ``LINGER_S`` later if it has not ended."""
        conn = getattr(getattr(self.protocol, "protocol", None), "connection", None)
        if self._lingering or not isinstance(conn, h11.Connection):
            return
        if conn.our_state in (h11.DONE, h11.MUST_CLOSE) and conn.their_state is h11.SEND_BODY:
            self._lingering = True
            with contextlib.suppress(OSError, RuntimeError):
                self.writer.write_eof()
            task = self._task
            if task is not None:
                self.loop.call_later(LINGER_S, task.cancel)  # a no-op once the task is done

    async def _read_data(self) -> None:
        inner = getattr(self.protocol, "protocol", None)
        if isinstance(inner, H11Protocol):
            inner._send_error_response = functools.partial(_send_json_error, inner, self.config)  # type: ignore[method-assign]
        self._task = asyncio.current_task()
        self.server._shedder.waiting_for_request(self, self.loop.time())
        self.server._resume()
        while not self.reader.at_eof():
            try:
                data = await asyncio.wait_for(self.reader.read(MAX_RECV), self.config.read_timeout)
            except (ConnectionError, OSError, asyncio.TimeoutError, TimeoutError, SSLError):
                break
            if self._lingering:
                continue  # the rest of a body nobody reads
            if data and self._idle and not self._head_started:
                # A request began: from now on its head has header_timeout to arrive.
                self._head_started = True
                await self.idle_task.restart(self._task_group, self._header_deadline)
            await self.protocol.handle(RawData(data))
        await self.protocol.handle(Closed())
        # The client closed: end the idle timer too, or this connection would count (against
        # max_connections, and for the drain) until keep_alive_timeout (hypercorn's own wait).
        await self.idle_task.stop()

    def _h11(self) -> h11.Connection | None:
        conn = getattr(getattr(getattr(self, "protocol", None), "protocol", None), "connection", None)
        return conn if isinstance(conn, h11.Connection) else None

    def sheddable_waiting(self) -> bool | None:
        """As a connection waiting for a request (`_Shedder`): True: it may be shed now; False:
        not now (bytes it sent are not read yet: they may be a request); None: it is no
        candidate before its next request."""
        conn = self._h11()
        if conn is None or not self._idle or self._lingering or self._aborted:
            return None
        if getattr(self.reader, "_buffer", b"") or (not self._head_started and conn.trailing_data[0]):
            return False
        if self.sock is not None:
            try:
                return not self.sock.recv(1, socket.MSG_PEEK)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                return True  # it is gone anyway
        return True

    def sheddable_receiving(self) -> bool | None:
        """As a connection receiving a body (`_Shedder`): True: it may be shed; None: no more
        (the body arrived, or an answer began)."""
        conn = self._h11()
        if conn is None or self._lingering or self._aborted:
            return None
        return True if conn.their_state is h11.SEND_BODY and conn.our_state is h11.SEND_RESPONSE else None

    def shed(self, *, body: bool) -> None:
        """Close for a new connection (`_Shedder`): with a FIN when nothing of a request is being
        answered, reset when a body is arriving (the app hears a disconnect)."""
        self._aborted = True  # nothing more is written (no 400 for a head cut short)
        if body:
            self.writer.transport.abort()
        else:
            self.writer.close()

    async def _header_deadline(self) -> None:
        # Not cut short by a drain: a request whose head began before it is served.
        timeout = self.server.frontend().header_timeout
        await asyncio.sleep(timeout)
        logger.info("header_timeout", timeout_s=timeout)
        await asyncio.shield(super()._initiate_server_close())

    async def _initiate_server_close(self) -> None:
        """Close an idle connection (keep-alive timeout, drain), unless its next request is
        already here: closing then would drop it unread (a reset, or a request the client
        cannot tell was never taken); it is read and served instead."""
        if not self._idle or self._head_started or self._request_waiting():
            return  # a request is here (the idle timer lost a race with its first bytes)
        await super()._initiate_server_close()

    def _request_waiting(self) -> bool:
        if getattr(self.reader, "_buffer", b""):  # read from the socket, not yet handed to h11
            return True
        sock = self.writer.get_extra_info("socket")
        try:
            return bool(sock is not None and select.select([sock.fileno()], [], [], 0)[0])
        except (OSError, ValueError):
            return False


class _Lifespan(Lifespan):
    """hypercorn's lifespan runner, recording whether the app completed its start-up (hypercorn
    sets ``startup`` also when the lifespan task ends without it)."""

    completed = False

    async def asgi_send(self, message: Any) -> None:
        if message["type"] == "lifespan.startup.complete":
            self.completed = True
        await super().asgi_send(message)


def _check_started(lifespan: _Lifespan, task: asyncio.Task[None]) -> None:
    """Raise what failed the app's start-up. A lifespan task that ended after the start-up
    completed (cancelled under load) is logged, not raised: the server started."""
    if not task.done():
        return
    if task.cancelled():
        if not lifespan.completed:
            raise RuntimeError("the app's lifespan was cancelled before its start-up completed")
        logger.warning("lifespan_ended", reason="the lifespan task was cancelled after start-up")
        return
    exc = task.exception()
    if exc is not None:
        raise exc


async def _send_json_error(protocol: H11Protocol, config: HypercornConfig, status_code: int) -> None:
    """hypercorn's answer to a request h11 cannot parse, with an OpenAI-shaped body."""
    message = _PROTOCOL_ERRORS.get(status_code, "the request cannot be parsed as HTTP/1.1")
    if status_code == 431:
        message += f" (more than {config.h11_max_incomplete_size} bytes before the body)"
    body = json.dumps(error_body(status_code, message)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        *config.response_headers("h11"),
    ]
    await protocol._send_h11_event(h11.Response(status_code=status_code, headers=headers))
    await protocol._send_h11_event(h11.Data(data=body))
    await protocol._send_h11_event(h11.EndOfMessage())
