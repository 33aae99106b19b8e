"""The API-server process: hypercorn serving the ASGI app on a socket the supervisor bound
(with ``frontend.grpc``, gRPC's ``VllmEngine`` service instead: `pkgd.api.grpc_server`).

Started by the supervisor as::

    python -m pkgd.api.server --config-fd C --ready-fd R --listen-fd F --server-index J \\
        --engine-address A [--engine-address A2 ...]

(``--config-file PATH`` instead of ``--config-fd`` for a server started by hand.)

The listening socket is inherited (``fd://F``), so restarting API servers never closes the
port and several API servers share it. Start-up: connect to the engine cores and handshake,
load the tokenizer, then write `ApiServerReady` on the ready pipe (or `ChildFailed` and exit
1).

Signals (handlers only set state; tasks do the work):
- SIGTERM/SIGINT: shutdown drain (`pkgd.api.http_server`). Accept what is queued on the
  socket, close this process's copy of it at once (new connections go to the other API servers
  sharing it, or are refused when none is left), answer ``/health`` with 503, close idle
  keep-alive connections, and finish the requests in progress, each answered with
  ``Connection: close``, for at most ``supervisor.drain_timeout`` seconds; requests still in
  flight then end with an error (a stream: an error event and ``[DONE]``) and no request starts
  any more; exit 0. SIGTERM before the server is ready exits at once.
- SIGUSR1: retire (the supervisor replaced this server's generation by a reload,
  `pkgd.supervisor.retire`). First the configuration frames waiting on the pipe are applied
  (the supervisor sends the new ``supervisor`` section first), then the same drain, except
  that the socket's queue is left to the new API servers and the bound is
  ``supervisor.reload_drain_timeout`` (null: none): a reload cuts no request. A SIGTERM
  during it moves the bound to ``drain_timeout`` from then, if that is sooner.
- A new configuration on the config pipe (or SIGHUP with ``--config-file``): apply its live
  fields (API keys, CORS, served model names, generation defaults, limits, log level).

Never imports torch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from hypercorn.config import Config as HypercornConfig

from pkgd import log
from pkgd.api.app import build_app
from pkgd.api.http_server import HttpServer
from pkgd.api.state import ServerState
from pkgd.config.vllm_config import VllmConfig
from pkgd.frontend.async_llm import AsyncLLM
from pkgd.frontend.metrics import EngineStatsCollector, Metrics, cache_config_labels
from pkgd.ipc import child
from pkgd.ipc.client import EngineUnavailableError
from pkgd.ipc.messages import ApiServerReady

if TYPE_CHECKING:
    from pkgd.api.grpc_server import GrpcServer

ROLE = "api-server"

logger = log.get_logger("pkgd.api.server")  # also when run as __main__


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pkgd.api.server", description="pkgd API-server process")
    child.add_config_args(p)
    p.add_argument("--ready-fd", type=int, default=None, help="pipe for the one ready/failed frame")
    p.add_argument("--listen-fd", type=int, required=True, help="inherited listening socket")
    p.add_argument("--server-index", type=int, default=0, help="index of this API server")
    p.add_argument("--engine-address", action="append", required=True, help="engine core address (repeat for DP)")
    p.add_argument("--parent-pid", type=int, default=None, help="exit at once if this is no longer the parent")
    return p.parse_args(argv)


class ApiServer:
    """One API-server process's life: start, serve, reload, drain."""

    def __init__(
        self, config: VllmConfig, args: argparse.Namespace, ready: child.ReadyPipe, source: child.ConfigSource
    ) -> None:
        self.args = args
        self.source = source
        self.ready = ready
        self.llm = AsyncLLM(config, args.engine_address, client_id=f"api{args.server_index}-{os.getpid()}")
        self.state = ServerState(config, self.llm, None, server_index=args.server_index)
        self.stop = asyncio.Event()
        self.reload = asyncio.Event()
        self.startup_error: BaseException | None = None  # hypercorn hides it in a string
        self.front: HttpServer | GrpcServer | None = None  # the protocol served on the socket

    @contextlib.asynccontextmanager
    async def lifespan(self, app: object) -> AsyncIterator[None]:
        cfg = self.state.config
        try:  # SIGTERM meanwhile: `exit_during_start` ends the process at once
            await self.llm.start(handshake_timeout=cfg.supervisor.engine_ready_timeout)
        except Exception as exc:  # TimeoutError, TokenizerError, ModelSourceError
            self.startup_error = exc
            raise
        try:
            await self.state.sync_loras()
        except EngineUnavailableError as exc:  # the engine went away meanwhile; it serves none then
            logger.warning("lora_sync_failed", error=str(exc))
        if cfg.logging.log_stats:
            hs = self.llm.handshake
            name = self.state.served_model_names()[0]
            metrics = Metrics(name, max_model_len=hs.max_model_len if hs else cfg.model.max_model_len or 131072)
            self.llm.metrics = self.state.metrics = metrics
            self.state.engine_collector = EngineStatsCollector(
                name, self.llm.client.engine_info, cache_config_labels(cfg)
            )
        tasks = [asyncio.create_task(self._reload_loop())]
        await self.state.preprocess.start()  # returns while the process imports
        # What start-up loaded (the tokenizer stack: millions of objects) lives as long as the
        # process: move it out of the cyclic collector's reach, or every full collection,
        # which a large request's garbage triggers, walks it and stalls the event loop for
        # hundreds of milliseconds (Python's gc.freeze, as servers pre-forking workers use it).
        gc.collect()
        gc.freeze()
        self._drain_on_signals()
        hs = self.llm.handshake
        logger.info(
            "api_server_ready",
            server_index=self.args.server_index,
            model=hs.model_name if hs else None,
            engines=len(self.args.engine_address),
        )  # before the frame: the supervisor's ready line comes last
        self.ready.send(ApiServerReady(server_index=self.args.server_index, pid=os.getpid()))
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            self.state.preprocess.shutdown()
            await self.llm.close()
            Metrics.mark_process_dead()

    def _abort_inflight(self, reason: str) -> None:
        sup = self.state.config.supervisor
        if reason == "reload_drain_timeout":
            message = (
                "this server was replaced by a reload and supervisor.reload_drain_timeout "
                f"({sup.reload_drain_timeout:g} s) passed; retry"
            )
        else:
            message = "the server is shutting down (supervisor.drain_timeout passed)"
        logger.warning("requests_cut", reason=reason, aborted=self.llm.num_inflight())
        self.llm.abort_all(message, reason=reason)

    async def _reload_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self.source.fd is not None:
            loop.add_reader(self.source.fd, self.reload.set)
        try:
            while True:
                await self.reload.wait()
                self.reload.clear()
                try:
                    configs = self.source.updates()
                except (OSError, ValueError) as exc:
                    logger.error("reload_failed", error=str(exc))
                    continue
                if self.source.closed and self.source.fd is not None:
                    loop.remove_reader(self.source.fd)  # the supervisor is gone; PDEATHSIG follows
                if configs:
                    self._apply(configs[-1])
        finally:
            if self.source.fd is not None and not self.source.closed:
                loop.remove_reader(self.source.fd)

    def _apply(self, new: VllmConfig) -> None:
        self.state.config = self.llm.config = new
        log.set_level(new.logging.level)
        logger.info("reloaded", config=new.digest())

    def on_stop_signal(self) -> None:
        """SIGTERM/SIGINT: drain for ``drain_timeout`` s (or less, when retiring already)."""
        self._begin_drain(self.state.config.supervisor.drain_timeout, "drain_timeout", retire=False)

    def on_retire_signal(self) -> None:
        """SIGUSR1: replaced by a reload; drain for ``reload_drain_timeout`` (module docstring)."""
        if not self.state.draining:
            self._reload_now()  # the new supervisor section came just before the signal
        self._begin_drain(self.state.config.supervisor.reload_drain_timeout, "reload_drain_timeout", retire=True)

    def _begin_drain(self, within: float | None, reason: str, *, retire: bool) -> None:
        first = not self.state.draining
        self.state.draining = True
        if self.front is not None:
            # at once: later connections are refused (or left queued for a newer generation)
            self.front.begin_drain(within, cut_reason=reason, retire=retire)
        if first:
            logger.info("draining", inflight=self.llm.num_inflight(), retire=retire, deadline_s=within)
        self.stop.set()

    def _reload_now(self) -> None:
        try:
            configs = self.source.updates()
        except (OSError, ValueError) as exc:
            logger.error("reload_failed", error=str(exc))
            return
        if configs:
            self._apply(configs[-1])

    def _drain_on_signals(self) -> None:
        """From ready on, SIGTERM/SIGINT drain (on the event loop) instead of exiting at once."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.on_stop_signal)
        loop.add_signal_handler(signal.SIGUSR1, self.on_retire_signal)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        if self.source.fd is None:
            loop.add_signal_handler(signal.SIGHUP, self.reload.set)
        else:
            loop.add_signal_handler(signal.SIGHUP, lambda: None)  # configurations come on the pipe
        cfg = self.state.config
        sock = socket.socket(fileno=self.args.listen_fd)
        drain_timeout = lambda: self.state.config.supervisor.drain_timeout  # noqa: E731
        if cfg.frontend.grpc:
            from pkgd.api.grpc_server import GrpcServer  # grpc's import only where it serves

            grpc_front = self.front = GrpcServer(self.state, sock, on_drain_timeout=self._abort_inflight)
            await grpc_front.serve(self.stop, self.lifespan(None), drain_timeout)
            return
        hc = HypercornConfig()
        hc.keep_alive_timeout = cfg.frontend.keep_alive_timeout
        hc.accesslog = None
        hc.errorlog = logging.getLogger("hypercorn.error")
        self.front = http = HttpServer(
            build_app(self.state, lifespan=self.lifespan),
            hc,
            sock,
            lambda: self.state.config.frontend,
            shared=cfg.serve_plan().api_server_count > 1,
            on_drain_timeout=self._abort_inflight,
        )
        await http.serve(self.stop, drain_timeout=drain_timeout)


def _root_cause(exc: BaseException) -> BaseException:
    """The original error under hypercorn's lifespan wrapping and exception groups."""
    while True:
        if isinstance(exc, BaseExceptionGroup) and exc.exceptions:
            exc = exc.exceptions[0]
        elif exc.__cause__ is not None:
            exc = exc.__cause__
        else:
            return exc


def raise_open_files_limit() -> None:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (as vLLM's API server does): each
    client connection holds a descriptor, and the common soft default of 1024 is below
    ``frontend.max_connections`` plus what the process itself needs."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass  # the connection cap and accept's EMFILE back-off still hold


def exit_during_start(signum: int, frame: object) -> None:
    """SIGTERM/SIGINT before the server is ready: nothing was served, so exit 0 at once.

    A plain signal handler runs in the main thread at its next bytecode, whatever the event
    loop is doing (building the app, starting the lifespan) and without joining the threads
    that import the tokenizer stack (interpreter shutdown would wait for them: seconds on a
    busy host). `ApiServer._drain_on_signals` replaces it once the server is ready.
    """
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    """Entry of the API-server process; returns the exit status."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, exit_during_start)
    args = parse_args(argv)
    raise_open_files_limit()
    child.die_with_parent(args.parent_pid)
    child.set_process_name(f"pkgd-api{args.server_index}")
    ready = child.ReadyPipe(args.ready_fd)
    source = child.ConfigSource(args.config_fd, args.config_file)
    try:
        config = source.initial()
    except (OSError, ValueError, EOFError, TimeoutError) as exc:
        ready.failed(ROLE, f"cannot read config {source.describe()}: {exc}")
        return 1
    log.configure(config.logging, role=ROLE)
    server: ApiServer | None = None
    try:
        server = ApiServer(config, args, ready, source)
        asyncio.run(server.serve())
    except (Exception, asyncio.CancelledError) as exc:
        cause = server.startup_error if server is not None and server.startup_error else _root_cause(exc)
        if ready.sent:  # it served: a failure now is a crash (restarted), not a failed start
            logger.error("api_server_failed", error=f"{type(cause).__name__}: {cause}", after_ready=True)
            return 1
        message = f"API server {args.server_index} failed to start: {type(cause).__name__}: {cause}"
        logger.error("api_server_failed", error=message)
        ready.failed(ROLE, message)
        return 1
    logger.info("api_server_stopped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
