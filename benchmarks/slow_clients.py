"""How long a normal request waits while slow clients hold an API server's connections.

One `pkgd.api.http_server.HttpServer` (a trivial app answering 200, the default timeouts, its
``frontend.max_connections``) serves a socket in a child process. ``--slow`` connections are
opened: half send half a request head and then one byte of it a second, half send a whole
head of a POST and then one byte of its body a second; each connects again when the server
closes its connection. Once they are all open and ``--settle`` seconds have passed,
``--requests`` normal requests (a whole GET on a new connection, one after the other,
``--interval`` seconds apart) are timed, each given up after ``--give-up`` seconds. Then the
server's counts of accepted and shed connections are printed. Run:

    .venv/bin/python benchmarks/slow_clients.py
    .venv/bin/python benchmarks/slow_clients.py --slow 300 --max-connections 256
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import resource
import socket
import statistics
import time
from typing import Any

from hypercorn.config import Config as HypercornConfig

from pkgd import log
from pkgd.api.http_server import HttpServer
from pkgd.config.vllm_config import VllmConfig

GET = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            await send({"type": msg["type"] + ".complete"})
            if msg["type"] == "lifespan.shutdown":
                return
    while (msg := await receive())["type"] == "http.request" and msg.get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def _serve(sock: socket.socket, max_connections: int, report: Any) -> None:
    log.configure(role="bench")
    log.set_level("warning")  # not a line per timeout or shed connection
    cfg = VllmConfig.model_validate({"frontend": {"max_connections": max_connections}}).frontend
    hc = HypercornConfig()
    hc.accesslog = None
    hc.keep_alive_timeout = cfg.keep_alive_timeout

    async def main() -> None:
        stop = asyncio.Event()
        server = HttpServer(_app, hc, sock, lambda: cfg)
        asyncio.get_running_loop().add_reader(report.fileno(), stop.set)
        await server.serve(stop, drain_timeout=lambda: 0.5)
        report.send((server.accepted, getattr(server, "shed", None)))

    asyncio.run(main())


async def _slow(port: int, body: bool, stop: asyncio.Event) -> None:
    """One slow client, connecting again whenever the server closes its connection."""
    while not stop.is_set():
        with contextlib.suppress(OSError):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            if body:
                writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\nx")
            else:
                writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n")
            while not stop.is_set() and not reader.at_eof():
                writer.write(b"x")
                await writer.drain()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(stop.wait()), 1.0)
                with contextlib.suppress(TimeoutError):  # notice a close (EOF)
                    await asyncio.wait_for(reader.read(1), 0.001)
            writer.close()


async def _normal(port: int, give_up: float) -> float:
    start = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(GET)
        data = await asyncio.wait_for(reader.readuntil(b"ok"), give_up)
        writer.close()
    except (TimeoutError, OSError, asyncio.IncompleteReadError):
        return float("inf")
    return time.perf_counter() - start if data.startswith(b"HTTP/1.1 200") else float("inf")


async def attack(port: int, args: argparse.Namespace) -> list[float]:
    stop = asyncio.Event()
    tasks = [asyncio.ensure_future(_slow(port, bool(i % 2), stop)) for i in range(args.slow)]
    await asyncio.sleep(args.settle)
    times = []
    for i in range(args.requests):
        if i:
            await asyncio.sleep(args.interval)
        times.append(await _normal(port, args.give_up))
    stop.set()
    await asyncio.gather(*tasks)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slow", type=int, default=1100, help="slow connections (default 1100)")
    parser.add_argument("--max-connections", type=int, default=1024, help="frontend.max_connections (1024)")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds between the attack and the timing")
    parser.add_argument("--requests", type=int, default=10, help="normal requests timed (10)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between normal requests (1)")
    parser.add_argument("--give-up", type=float, default=40.0, help="seconds a normal request may take (40)")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(4096)
    port = sock.getsockname()[1]
    ours, theirs = multiprocessing.Pipe()
    child = multiprocessing.get_context("fork").Process(target=_serve, args=(sock, args.max_connections, theirs))
    child.start()
    sock.close()
    time.sleep(1.0)
    times = asyncio.run(attack(port, args))
    ours.send("stop")
    accepted, shed = ours.recv()
    child.join(30)
    done = [t for t in times if t != float("inf")]
    print(f"slow connections {args.slow}, max_connections {args.max_connections}, pid {os.getpid()}")
    print("normal request seconds: " + ", ".join("gave up" if t == float("inf") else f"{t:.3f}" for t in times))
    if done:
        print(f"median {statistics.median(done):.3f} s, max {max(done):.3f} s, {len(times) - len(done)} gave up")
    print(f"server: accepted {accepted}, shed {shed}")


if __name__ == "__main__":
    main()
