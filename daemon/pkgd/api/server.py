"""The API-server process: hypercorn serving the ASGI app on a socket the supervisor bound.

Started by the supervisor as::

    python -m pkgd.api.server --config-file PATH --ready-fd R --listen-fd F --server-index J \\
        --engine-address A [--engine-address A2 ...]

The listening socket is inherited (``fd://F``), so restarting API servers never closes the
port and several API servers share it. Start-up: connect to the engine cores and handshake,
load the tokenizer, then write `ApiServerReady` on the ready pipe (or `ChildFailed` and exit
1).

Signals (handlers only set state; tasks do the work):
- SIGTERM/SIGINT: drain. Stop accepting at once (new connections go to the other API
  servers sharing the socket), answer ``/health`` with 503, and for ``DRAIN_GRACE_S`` keep
  serving what still arrives on open keep-alive connections, with ``Connection: close`` (so
  a client racing the shutdown gets an answer, not a reset, and reconnects elsewhere); then
  hypercorn closes idle connections, requests in flight may finish for up to
  ``supervisor.drain_timeout`` seconds, and the rest fail with an error; exit 0.
- SIGHUP: re-read the config file and apply its live fields (API keys, CORS, served model
  names, generation defaults, log level).

Never imports torch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig

from pkgd import log
from pkgd.api.app import build_app
from pkgd.api.state import ServerState
from pkgd.config.vllm_config import VllmConfig
from pkgd.frontend.async_llm import AsyncLLM
from pkgd.frontend.metrics import EngineStatsCollector, Metrics, cache_config_labels
from pkgd.ipc import child
from pkgd.ipc.messages import ApiServerReady

ROLE = "api-server"
DRAIN_POLL_S = 0.05
DRAIN_GRACE_S = 0.5  # answer keep-alive stragglers before hypercorn closes idle connections
# hypercorn's own wait for connections beyond our drain: time for aborted requests to answer
GRACE_AFTER_DRAIN_S = 2.0

logger = log.get_logger("pkgd.api.server")  # also when run as __main__


class StartupCancelled(Exception):
    """SIGTERM arrived before the server was ready."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pkgd.api.server", description="pkgd API-server process")
    p.add_argument("--config-file", required=True, help="config.json written by the supervisor")
    p.add_argument("--ready-fd", type=int, default=None, help="pipe for the one ready/failed frame")
    p.add_argument("--listen-fd", type=int, required=True, help="inherited listening socket")
    p.add_argument("--server-index", type=int, default=0, help="index of this API server")
    p.add_argument("--engine-address", action="append", required=True, help="engine core address (repeat for DP)")
    p.add_argument("--parent-pid", type=int, default=None, help="exit at once if this is no longer the parent")
    return p.parse_args(argv)


class ApiServer:
    """One API-server process's life: start, serve, reload, drain."""

    def __init__(self, config: VllmConfig, args: argparse.Namespace, ready: child.ReadyPipe) -> None:
        self.args = args
        self.ready = ready
        self.llm = AsyncLLM(config, args.engine_address, client_id=f"api{args.server_index}-{os.getpid()}")
        self.state = ServerState(config, self.llm, None, server_index=args.server_index)
        self.stop = asyncio.Event()
        self.reload = asyncio.Event()
        self.start_cancelled = False
        self.startup_error: BaseException | None = None  # hypercorn hides it in a string

    @contextlib.asynccontextmanager
    async def lifespan(self, app: object) -> AsyncIterator[None]:
        cfg = self.state.config
        start = asyncio.ensure_future(self.llm.start(handshake_timeout=cfg.supervisor.engine_ready_timeout))
        stopped = asyncio.ensure_future(self.stop.wait())
        await asyncio.wait({start, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not start.done():
            start.cancel()
            self.start_cancelled = True
            raise StartupCancelled
        stopped.cancel()
        error = start.exception()
        if error is not None:  # TimeoutError, TokenizerError, ModelSourceError
            self.startup_error = error
            raise error
        if cfg.logging.log_stats:
            hs = self.llm.handshake
            name = self.state.served_model_names()[0]
            metrics = Metrics(name, max_model_len=hs.max_model_len if hs else cfg.model.max_model_len or 131072)
            self.llm.metrics = self.state.metrics = metrics
            self.state.engine_collector = EngineStatsCollector(name, self.llm.client.engine_info, cache_config_labels(cfg))
        tasks = [asyncio.create_task(self._drain_on_stop()), asyncio.create_task(self._reload_loop())]
        hs = self.llm.handshake
        logger.info("api_server_ready", server_index=self.args.server_index, model=hs.model_name if hs else None,
                    engines=len(self.args.engine_address))  # before the frame: the supervisor's ready line comes last
        self.ready.send(ApiServerReady(server_index=self.args.server_index, pid=os.getpid()))
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await self.llm.close()
            Metrics.mark_process_dead()

    async def _drain_on_stop(self) -> None:
        await self.stop.wait()
        deadline = time.monotonic() + self.state.config.supervisor.drain_timeout
        logger.info("draining", inflight=self.llm.num_inflight())
        while self.llm.num_inflight() and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if self.llm.num_inflight():
            logger.warning("drain_timeout", aborted=self.llm.num_inflight())
            self.llm.abort_all("the server is shutting down (supervisor.drain_timeout passed)")

    async def _reload_loop(self) -> None:
        while True:
            await self.reload.wait()
            self.reload.clear()
            try:
                new = child.load_config(self.args.config_file)
            except (OSError, ValueError) as exc:
                logger.error("reload_failed", error=str(exc))
                continue
            self.state.config = self.llm.config = new
            log.set_level(new.logging.level)
            logger.info("reloaded", config=new.digest())

    def on_stop_signal(self) -> None:
        if self.state.draining:
            return
        self.state.draining = True
        loop = asyncio.get_running_loop()
        # Stop accepting now: hypercorn's server reads the inherited listener's fd number.
        loop.remove_reader(self.args.listen_fd)
        if self.llm.input_processor is None:  # still starting: nothing to drain
            self.stop.set()
        else:
            loop.call_later(DRAIN_GRACE_S, self.stop.set)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.on_stop_signal)
        loop.add_signal_handler(signal.SIGHUP, self.reload.set)
        cfg = self.state.config
        hc = HypercornConfig()
        hc.bind = [f"fd://{self.args.listen_fd}"]
        hc.keep_alive_timeout = cfg.frontend.keep_alive_timeout
        hc.graceful_timeout = cfg.supervisor.drain_timeout + GRACE_AFTER_DRAIN_S
        hc.accesslog = None
        hc.errorlog = logging.getLogger("hypercorn.error")
        hc.backlog = 2048
        app = build_app(self.state, lifespan=self.lifespan)
        # hypercorn's ASGIFramework wants its own TypedDict scopes; Starlette's app takes the
        # MutableMapping form of the same ASGI 3 interface
        await hypercorn_serve(app, hc, shutdown_trigger=self.stop.wait)  # type: ignore[arg-type]


def _root_cause(exc: BaseException) -> BaseException:
    """The original error under hypercorn's lifespan wrapping and exception groups."""
    while True:
        if isinstance(exc, BaseExceptionGroup) and exc.exceptions:
            exc = exc.exceptions[0]
        elif exc.__cause__ is not None:
            exc = exc.__cause__
        else:
            return exc


def main(argv: list[str] | None = None) -> int:
    """Entry of the API-server process; returns the exit status."""
    args = parse_args(argv)
    child.die_with_parent(args.parent_pid)
    child.set_process_name(f"pkgd-api{args.server_index}")
    ready = child.ReadyPipe(args.ready_fd)
    try:
        config = child.load_config(args.config_file)
    except (OSError, ValueError) as exc:
        ready.failed(ROLE, f"cannot read config {args.config_file}: {exc}")
        return 1
    log.configure(config.logging, role=ROLE)
    server: ApiServer | None = None
    try:
        server = ApiServer(config, args, ready)
        asyncio.run(server.serve())
    except Exception as exc:
        if server is not None and server.start_cancelled:  # hypercorn wraps the lifespan's error
            logger.info("start_cancelled")
            # Nothing was served; don't let the interpreter join a tokenizer load still running
            # in an executor thread (seconds on a busy host): SIGTERM during start exits now.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        cause = server.startup_error if server is not None and server.startup_error else _root_cause(exc)
        message = f"API server {args.server_index} failed to start: {type(cause).__name__}: {cause}"
        logger.error("api_server_failed", error=message)
        ready.failed(ROLE, message)
        return 1
    logger.info("api_server_stopped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
