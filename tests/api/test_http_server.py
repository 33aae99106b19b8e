"""`HttpServer` on a real listening socket, in this process: slow clients, the connection
cap, protocol errors as JSON, drain without resets, and the spread of connections over API
servers sharing one socket."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import pytest
from hypercorn.config import Config as HypercornConfig

from pkgd.api.http_server import SHED_AFTER_S, HttpServer
from pkgd.config.vllm_config import VllmConfig

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def frontend(**values):
    cfg = VllmConfig.model_validate({"frontend": values}).frontend
    return lambda: cfg


async def _lifespan(receive, send) -> None:
    """ASGI lifespan: complete each event until shutdown."""
    while True:
        msg = await receive()
        await send({"type": msg["type"] + ".complete"})
        if msg["type"] == "lifespan.shutdown":
            return


class App:
    """ASGI app: ``/hold`` waits until released, ``/big`` sends 64 MiB, anything else 200."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.disconnected = 0
        self.draining = False

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        while (msg := await receive())["type"] == "http.request" and msg.get("more_body"):
            pass
        if scope["path"] == "/hold":
            await self.release.wait()
        # as pkgd's app: Connection: close on a response that starts while draining
        headers = [(b"content-type", b"text/plain")] + ([(b"connection", b"close")] if self.draining else [])
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if scope["path"] == "/big":  # like Starlette's StreamingResponse: stop on disconnect

            async def watch():
                while (await receive())["type"] != "http.disconnect":
                    pass
                self.disconnected += 1

            watcher = asyncio.ensure_future(watch())
            for _ in range(1024):
                if watcher.done():
                    return
                await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})
                await asyncio.sleep(0)  # a generator waiting for its next item
            watcher.cancel()
        await send({"type": "http.response.body", "body": b"ok"})


def listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


@contextlib.asynccontextmanager
async def running(app, sock, fe, **kw):
    hc = HypercornConfig()
    hc.accesslog = None
    stop = asyncio.Event()
    server = HttpServer(app, hc, sock, fe, **kw)
    task = asyncio.ensure_future(server.serve(stop, drain_timeout=lambda: 5.0))
    await asyncio.sleep(0.05)
    try:
        yield server, stop
    finally:
        stop.set()
        app_release = getattr(app, "release", None)
        if app_release is not None:
            app_release.set()
        await asyncio.wait_for(task, 15)


async def request(
    port: int, raw: bytes, *, read: bool = True
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    data = await read_response(reader) if read else b""
    return reader, writer, data


GET = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"


async def read_response(reader: asyncio.StreamReader) -> bytes:
    """One whole response of `App` (chunked: up to the last chunk)."""
    data = b""
    while not data.endswith(b"0\r\n\r\n"):
        chunk = await asyncio.wait_for(reader.read(65536), 5)
        if not chunk:
            break
        data += chunk
    return data


async def test_a_request_head_that_trickles_is_cut_at_header_timeout():
    sock = listener()
    port = sock.getsockname()[1]
    async with running(App(), sock, frontend(header_timeout=0.3, keep_alive_timeout=30)) as (server, _):
        reader, writer, _ = await request(port, b"GET / HTTP/1.1\r\nhost: x\r\n", read=False)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server
        writer.close()
        assert not server.connections or await asyncio.sleep(0.1) is None


async def test_a_client_that_stops_reading_is_cut_at_write_timeout():
    sock = listener()
    port = sock.getsockname()[1]
    app = App()
    async with running(app, sock, frontend(write_timeout=0.3)) as (server, _):
        _reader, writer, _ = await request(port, b"GET /big HTTP/1.1\r\nhost: x\r\n\r\n", read=False)
        for _ in range(100):  # the app hears the disconnect a moment before the task ends
            if app.disconnected and not server.connections:
                break
            await asyncio.sleep(0.05)
        assert app.disconnected == 1 and not server.connections
        writer.close()


async def test_connections_beyond_the_cap_wait_in_the_backlog():
    sock = listener()
    port = sock.getsockname()[1]
    app = App()
    async with running(app, sock, frontend(max_connections=2)) as (server, _):
        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        for _, w in conns:
            w.write(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
        await asyncio.sleep(0.3)
        assert server.accepted == 2 and len(server.connections) == 2
        app.release.set()
        for r, w in conns[:2]:  # keep-alive connections count until they close
            assert b" 200 " in await read_response(r)
            w.close()
        assert b" 200 " in await read_response(conns[2][0])
        assert server.accepted == 3
        conns[2][1].close()


@pytest.mark.parametrize(
    ("parts", "status"),
    [
        ([b"NOT HTTP AT ALL\r\n\r\n"], 400),
        ([b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 20000, b"\r\n\r\n"], 431),  # a head over 16 KiB
    ],
)
async def test_protocol_errors_answer_an_openai_shaped_body(parts, status):
    sock = listener()
    port = sock.getsockname()[1]
    async with running(App(), sock, frontend()):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.1)
        data = await asyncio.wait_for(reader.read(), 5)  # then the server closes
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(f"HTTP/1.1 {status} ".encode()) and b"application/json" in head
        err = json.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        writer.close()


async def test_drain_closes_the_listener_at_once_and_serves_open_connections_until_they_close():
    sock = listener()
    port = sock.getsockname()[1]
    app = App()
    async with running(app, sock, frontend()) as (server, stop):
        reader, writer, first = await request(port, GET)  # a keep-alive connection, idle now
        assert b" 200 " in first and b"connection: close" not in first.lower()
        app.draining = True
        stop.set()
        await asyncio.sleep(0.05)
        with pytest.raises(ConnectionRefusedError):  # new connections: refused, not reset
            await asyncio.open_connection("127.0.0.1", port)
        writer.write(GET)  # the open connection is still served, and told to close
        second = await read_response(reader)
        assert b" 200 " in second and b"connection: close" in second.lower()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()


async def test_connections_queued_when_the_drain_starts_are_served_not_reset():
    sock = listener()
    port = sock.getsockname()[1]
    app = App()
    async with running(app, sock, frontend()) as (server, stop):
        server._pause()  # as if the loop were busy: connections queue in the backlog
        queued = [await request(port, GET, read=False) for _ in range(5)]
        server.close_listener()
        stop.set()
        for reader, writer, _ in queued:
            assert b" 200 " in await read_response(reader)
            writer.close()


async def test_servers_sharing_a_socket_split_connections_evenly():
    """Two servers on one socket (as two API servers are): 32 held connections split about
    evenly, where asyncio's own accept loop gave almost all to one."""
    sock = listener()
    port = sock.getsockname()[1]
    twin = socket.socket(fileno=socket.dup(sock.fileno()))
    app = App()
    fe = frontend()
    async with running(app, sock, fe, shared=True) as (a, _), running(app, twin, fe, shared=True) as (b, _):
        conns = []
        for _ in range(32):
            conns.append(await asyncio.open_connection("127.0.0.1", port))
            conns[-1][1].write(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
        for _ in range(100):
            if a.accepted + b.accepted == 32:
                break
            await asyncio.sleep(0.02)
        assert a.accepted + b.accepted == 32
        assert abs(a.accepted - b.accepted) <= 4, (a.accepted, b.accepted)
        app.release.set()
        for r, w in conns:
            await read_response(r)
            w.close()


async def _refuse_unread(scope, receive, send):
    """ASGI app answering 413 without reading the body (as the body-size guard does)."""
    if scope["type"] == "lifespan":
        await _lifespan(receive, send)
        return
    headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": b'{"error": "too big"}'})


@pytest.mark.parametrize("body_mib", [2, 64], ids=["sent whole", "never finished"])
async def test_an_answer_before_the_body_reaches_the_client_and_the_connection_ends(body_mib):
    sock = listener()
    port = sock.getsockname()[1]
    async with running(_refuse_unread, sock, frontend()) as (server, _):
        size = body_mib << 20
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % size)

        async def upload() -> None:  # the whole body first, as httpx and requests send it
            with contextlib.suppress(ConnectionError):
                for _ in range(size // 65536):
                    writer.write(b"x" * 65536)
                    await writer.drain()
                    if body_mib > 2:
                        await asyncio.sleep(0.01)  # a slow client that outlasts the linger

        sending = asyncio.ensure_future(upload())
        if body_mib == 2:
            await asyncio.wait_for(sending, 10)
        data = b""
        with contextlib.suppress(ConnectionError):
            while chunk := await asyncio.wait_for(reader.read(65536), 15):
                data += chunk
        assert data.startswith(b"HTTP/1.1 413") and b'{"error": "too big"}' in data
        for _ in range(200):  # the server's side ends too (it counted against max_connections)
            if not server.connections:
                break
            await asyncio.sleep(0.05)
        assert not server.connections
        sending.cancel()
        writer.close()


async def _answer_time(port: int, raw: bytes = GET) -> float:
    """Seconds from connecting to a whole 200 answer to ``raw``, on a new connection."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    _, writer, data = await asyncio.wait_for(request(port, raw), 5)
    writer.close()
    assert b" 200 " in data
    return loop.time() - start


async def _ended_by_server(reader: asyncio.StreamReader) -> bool:
    """Whether the server has closed (or reset) this connection, looking for 0.1 s."""
    try:
        return await asyncio.wait_for(reader.read(65536), 0.1) == b""
    except ConnectionError:
        return True
    except TimeoutError:
        return False


async def test_at_the_cap_slow_connections_are_shed_so_a_prompt_request_gets_in():
    """``max_connections`` 20 filled by 5 requests in progress and 30 slow connections (half a
    request head; or a head and the start of a body): a request sent whole is answered at once
    (it waited for header_timeout or body_timeout in the backlog), slow connections are shed for
    it and for the slow ones queued behind them, and no request in progress is."""
    sock = listener()
    port = sock.getsockname()[1]
    app = App()
    async with running(app, sock, frontend(max_connections=20, header_timeout=30)) as (server, _):
        held = [await request(port, b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n", read=False) for _ in range(5)]
        slow = []
        for i in range(30):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            if i % 2:
                writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n")
            else:
                writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n" + b"x" * 10)
            slow.append((reader, writer))
        await asyncio.sleep(SHED_AFTER_S + 0.2)  # they have all waited past the grace
        elapsed = await _answer_time(port)
        assert elapsed < 1.5, elapsed
        shed = await asyncio.gather(*(_ended_by_server(r) for r, _ in slow))
        assert sum(shed) >= 16, shed  # 15 to let the queued slow ones in, 1 for the request
        assert any(shed[1::2]) and any(shed[0::2]), shed  # half heads first, then slow bodies
        assert server.shed == sum(shed)
        # not one request in progress was shed
        assert not any(await asyncio.gather(*(_ended_by_server(r) for r, _, _ in held)))
        app.release.set()
        for reader, writer, _ in held:
            assert b" 200 " in await read_response(reader)
            writer.close()
        for _, writer in slow:
            writer.close()


async def test_at_the_cap_the_longest_idle_keep_alive_connection_is_closed_cleanly():
    sock = listener()
    port = sock.getsockname()[1]
    async with running(App(), sock, frontend(max_connections=3, keep_alive_timeout=30)) as (server, _):
        idle = []
        for _ in range(3):
            reader, writer, data = await request(port, GET)
            assert b" 200 " in data
            idle.append((reader, writer))
            await asyncio.sleep(0.05)
        await asyncio.sleep(SHED_AFTER_S)
        assert await _answer_time(port) < 1.5
        # The oldest is closed with a FIN, nothing of a request read or answered; the others serve on.
        assert await asyncio.wait_for(idle[0][0].read(), 1) == b""
        for reader, writer in idle[1:]:
            writer.write(GET)
            assert b" 200 " in await read_response(reader)
        for _, writer in idle:
            writer.close()


async def test_at_the_cap_connections_younger_than_the_grace_are_not_shed():
    """A burst over the cap: a connection is shed only once it has waited ``SHED_AFTER_S``
    without a whole request, so clients that send theirs at once are not cut."""
    sock = listener()
    port = sock.getsockname()[1]
    async with running(App(), sock, frontend(max_connections=2)) as (server, _):
        quiet = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        elapsed = await _answer_time(port)
        assert SHED_AFTER_S * 0.8 < elapsed < SHED_AFTER_S + 1.0, elapsed
        assert [await _ended_by_server(r) for r, _ in quiet] == [True, False]
        for _, writer in quiet:
            writer.close()
