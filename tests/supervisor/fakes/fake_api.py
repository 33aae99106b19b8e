"""A fake API server: hypercorn on the inherited socket, talking to engine cores over ZeroMQ.

Routes: ``/health`` (503 while draining), ``/whoami`` (pid, server index, engine addresses,
``model.name`` as last received on the config pipe), ``/generate`` (one AddRequest to the next engine
core, answered with the core's index and pid), ``/slow?s=S`` (answers after S seconds: an
in-flight request for drain tests; it answers with ``supervisor.reload_drain_timeout`` as last
received). SIGTERM drains for ``drain_timeout``; SIGUSR1 (retired by a reload) for
``reload_drain_timeout``. Behaviour from ``model.chat_template`` of its configuration:
``fake-api:fail=MSG`` reports ChildFailed, ``fake-api:load=S`` delays readiness.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import sys
import uuid
from urllib.parse import parse_qs

import zmq
import zmq.asyncio
from common import config_source, die_with_parent, fake_options, report
from hypercorn.asyncio import serve
from hypercorn.config import Config

from pkgd.ipc import messages
from pkgd.sampling_params import SamplingParams


class Engines:
    def __init__(self, addresses):
        self.ctx = zmq.asyncio.Context()
        self.socks = []
        for address in addresses:
            s = self.ctx.socket(zmq.DEALER)
            s.connect(address)
            self.socks.append(s)
        self.next = itertools.cycle(range(len(self.socks))) if self.socks else None
        self.pending: dict[str, asyncio.Future] = {}

    async def hello(self, timeout=10.0):
        for s in self.socks:
            await s.send(messages.encode(messages.Hello(version=messages.PROTOCOL_VERSION, client_id=str(os.getpid()))))
            if not await s.poll(int(timeout * 1000)):
                raise RuntimeError("engine core did not answer Hello")
            frame = messages.decode_engine(await s.recv())
            assert isinstance(frame, messages.Handshake)
        for s in self.socks:
            asyncio.ensure_future(self._read(s))

    async def _read(self, s):
        while True:
            frame = messages.decode_engine(await s.recv())
            if isinstance(frame, messages.EngineOutputs):
                for out in frame.outputs:
                    fut = self.pending.pop(out.request_id, None)
                    if fut and not fut.done():
                        fut.set_result(out.new_token_ids)

    async def generate(self, timeout=5.0):
        rid = uuid.uuid4().hex
        fut = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        req = messages.EngineCoreRequest(
            request_id=rid, prompt_token_ids=[1, 2], sampling_params=SamplingParams(max_tokens=1)
        )
        await self.socks[next(self.next)].send(messages.encode(messages.AddRequest(request=req)))
        return await asyncio.wait_for(fut, timeout)


async def amain(args) -> int:
    source = config_source(args)
    state = {"cfg": source.initial(), "draining": False}
    opts = fake_options(state["cfg"].model.chat_template, "fake-api:")
    if "fail" in opts:
        report(args.ready_fd, messages.ChildFailed(role="api-server", message=opts["fail"] or "fake failure"))
        return 1
    await asyncio.sleep(float(opts.get("load", 0)))
    engines = Engines(args.engine_address)
    await engines.hello(timeout=state["cfg"].supervisor.engine_ready_timeout)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_term():
        # Stop accepting first; answer with "Connection: close" for a moment, so keep-alive
        # clients and connections accepted a moment ago get their answer and go elsewhere;
        # only then let hypercorn close idle connections and drain. Hypercorn alone closes
        # a just-accepted or idle keep-alive connection at once, racing the client's request.
        state["draining"] = True
        loop.remove_reader(args.listen_fd)
        loop.call_later(0.5, stop.set)

    def on_config():
        for cfg in source.updates():
            state["cfg"] = cfg
        if source.closed:
            loop.remove_reader(source.fd)

    def on_retire():
        # Replaced by a reload: the new supervisor section came on the pipe just before; the
        # drain is bounded by its reload_drain_timeout (None: unbounded), not drain_timeout.
        on_config()
        limit = state["cfg"].supervisor.reload_drain_timeout
        config.graceful_timeout = 1e9 if limit is None else limit
        on_term()

    loop.add_signal_handler(signal.SIGTERM, on_term)
    loop.add_signal_handler(signal.SIGUSR1, on_retire)
    if source.fd is not None:
        loop.add_reader(source.fd, on_config)

    async def respond(send, status, body):
        data = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json")]
        if state["draining"]:  # keep-alive clients must not send another request on this connection
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                    report(args.ready_fd, messages.ApiServerReady(server_index=args.server_index, pid=os.getpid()))
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope["path"]
        if path == "/health":
            await respond(send, 503 if state["draining"] else 200, {"pid": os.getpid()})
        elif path == "/whoami":
            await respond(
                send,
                200,
                {
                    "pid": os.getpid(),
                    "server_index": args.server_index,
                    "engines": args.engine_address,
                    "model_name": state["cfg"].model.name,
                },
            )
        elif path == "/generate":
            try:
                index, pid = await engines.generate()
            except asyncio.TimeoutError:
                await respond(send, 503, {"error": "engine unavailable"})
                return
            await respond(send, 200, {"engine_index": index, "engine_pid": pid, "api_pid": os.getpid()})
        elif path == "/slow":
            seconds = float(parse_qs(scope["query_string"].decode()).get("s", ["1"])[0])
            await asyncio.sleep(seconds)
            limit = state["cfg"].supervisor.reload_drain_timeout
            await respond(send, 200, {"pid": os.getpid(), "slept": seconds, "reload_drain_timeout": limit})
        else:
            await respond(send, 404, {"error": "not found"})

    config = Config()
    config.bind = [f"fd://{args.listen_fd}"]
    config.graceful_timeout = state["cfg"].supervisor.drain_timeout
    config.accesslog = None
    config.errorlog = None
    await serve(app, config, shutdown_trigger=stop.wait)
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config-file")
    p.add_argument("--config-fd", type=int)
    p.add_argument("--parent-pid", type=int)
    p.add_argument("--ready-fd", type=int, required=True)
    p.add_argument("--listen-fd", type=int, required=True)
    p.add_argument("--server-index", type=int, required=True)
    p.add_argument("--engine-address", action="append", default=[])
    args = p.parse_args()
    die_with_parent(args.parent_pid)
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
