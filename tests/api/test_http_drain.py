"""`HttpServer`'s drain on a real socket: a retire (reload) has no deadline of its own and
leaves the socket's queue to the next generation; a later shutdown moves the deadline closer;
what is cut is reported with its reason; a lifespan that ends after start-up is not a failed
start."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from hypercorn.config import Config as HypercornConfig

from pkgd.api.http_server import HttpServer

from .test_http_server import GET, App, frontend, listener, read_response, request

pytestmark = pytest.mark.anyio

HOLD = b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n"


@pytest.fixture
def anyio_backend():
    return "asyncio"


@contextlib.asynccontextmanager
async def serving(app, sock):
    hc = HypercornConfig()
    hc.accesslog = None
    cuts: list[str] = []
    server = HttpServer(app, hc, sock, frontend(), on_drain_timeout=cuts.append)
    stop = asyncio.Event()
    task = asyncio.ensure_future(server.serve(stop, drain_timeout=lambda: 30.0))
    await asyncio.sleep(0.05)
    try:
        yield server, stop, task, cuts
    finally:
        stop.set()
        app.release.set()
        await asyncio.wait_for(task, 15)


async def test_a_retire_finishes_requests_past_any_deadline_and_leaves_the_queue_to_others():
    sock = listener()
    port = sock.getsockname()[1]
    app = App()
    async with serving(app, sock) as (server, stop, task, cuts):
        busy_reader, busy_writer, _ = await request(port, HOLD, read=False)
        await asyncio.sleep(0.05)
        server._pause()  # connections made now stay queued on the socket
        twin = listener_twin(sock)
        app.draining = True
        server.begin_drain(None, cut_reason="reload_drain_timeout", retire=True)
        stop.set()
        queued_reader, queued_writer, _ = await request(port, GET, read=False)
        await asyncio.sleep(0.5)  # past nothing: a retire has no deadline
        assert not task.done() and not cuts
        app.release.set()
        assert b" 200 " in await read_response(busy_reader)
        await asyncio.wait_for(task, 5)  # its last connection ended: the drain is over
        assert server.accepted == 1
        conn, _ = twin.accept()  # the queued connection is still there for the next generation
        conn.close()
        busy_writer.close()
        queued_writer.close()
        twin.close()


def listener_twin(sock):
    """Another process's copy of the listening socket (as the supervisor holds one)."""
    import socket

    twin = socket.socket(fileno=socket.dup(sock.fileno()))
    twin.setblocking(True)
    twin.settimeout(5)
    return twin


async def test_a_shutdown_during_a_retire_moves_the_deadline_and_cuts_with_its_reason():
    sock = listener()
    port = sock.getsockname()[1]
    app = App()
    async with serving(app, sock) as (server, stop, task, cuts):
        _, writer, _ = await request(port, HOLD, read=False)
        await asyncio.sleep(0.05)
        server.begin_drain(None, cut_reason="reload_drain_timeout", retire=True)
        stop.set()
        await asyncio.sleep(0.2)
        assert not cuts
        server.begin_drain(0.2, cut_reason="drain_timeout")  # SIGTERM: drain_timeout from now
        server.begin_drain(60, cut_reason="reload_drain_timeout")  # a later, farther one changes nothing
        for _ in range(100):
            if cuts:
                break
            await asyncio.sleep(0.02)
        assert cuts == ["drain_timeout"]
        writer.close()


async def test_the_reload_deadline_cuts_with_its_own_reason():
    sock = listener()
    port = sock.getsockname()[1]
    app = App()
    async with serving(app, sock) as (server, stop, task, cuts):
        _, writer, _ = await request(port, HOLD, read=False)
        await asyncio.sleep(0.05)
        server.begin_drain(0.1, cut_reason="reload_drain_timeout", retire=True)
        stop.set()
        for _ in range(100):
            if cuts:
                break
            await asyncio.sleep(0.02)
        assert cuts == ["reload_drain_timeout"]
        writer.close()


class CancelledLifespanApp(App):
    """Completes its start-up, then its lifespan task ends cancelled (as seen under load)."""

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            await receive()
            await send({"type": "lifespan.startup.complete"})
            raise asyncio.CancelledError
        await super().__call__(scope, receive, send)


async def test_a_lifespan_cancelled_after_start_up_does_not_fail_the_started_server():
    sock = listener()
    port = sock.getsockname()[1]
    app = CancelledLifespanApp()
    async with serving(app, sock) as (server, stop, task, cuts):
        await asyncio.sleep(0.05)
        assert not task.done(), task.exception() if task.done() else None
        _, writer, answer = await request(port, GET)
        assert b" 200 " in answer
        writer.close()


async def test_a_retire_serves_one_more_request_per_open_connection_then_closes_it():
    """A keep-alive client of a replaced generation may be sending its next request just as the
    drain begins: that request is served (never cut unanswered), with Connection: close, and the
    connection closed after it, so the client's next one goes to the new generation. A request
    in progress is answered, and its connection closed after it."""
    sock = listener()
    port = sock.getsockname()[1]
    app = App()
    async with serving(app, sock) as (server, stop, task, cuts):
        reader, writer, first = await request(port, GET)  # keep-alive, idle now
        assert b" 200 " in first
        busy_reader, busy_writer, _ = await request(port, HOLD, read=False)
        await asyncio.sleep(0.05)
        twin = listener_twin(sock)
        app.draining = True
        server.begin_drain(None, cut_reason="reload_drain_timeout", retire=True)
        stop.set()
        await asyncio.sleep(0.05)
        writer.write(GET)
        second = await read_response(reader)
        assert b" 200 " in second and b"connection: close" in second.lower()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        app.release.set()
        assert b" 200 " in await read_response(busy_reader)
        assert await asyncio.wait_for(busy_reader.read(), 5) == b""  # answered with Connection: close
        await asyncio.wait_for(task, 5)
        assert not cuts
        writer.close()
        busy_writer.close()
        twin.close()
