"""The engine-core process: a ZeroMQ ROUTER loop around `EngineCore`.

Started by the supervisor as::

    python -m pkgd.engine.core_proc --config-fd C --ready-fd R --engine-index I --address ADDR

(``--config-file PATH`` instead of ``--config-fd`` for a core started by hand.)

Loop (vLLM v1's ``EngineCoreProc`` busy loop, one thread): take every frame waiting on the
socket (dispatched by type through a table), run one ``EngineCore.step()`` while requests
are unfinished, send each client the outputs of its own requests, broadcast the scheduler
stats when they change. With nothing to do it blocks in ``poll`` on the socket and the
signal wake-up pipe: no busy spin.

Clients (API servers, DEALER sockets) begin with `Hello` and get `Handshake`; a request's
outputs go back to the client that added it. A client that vanished (send fails with
``EHOSTUNREACH``) has its requests aborted. SIGTERM/SIGINT or a `Shutdown` frame: abort every
request, tell each client (`EngineError` naming its requests), exit 0. SIGTERM while the
model is still loading exits at once (the load runs in a helper thread the main thread
abandons). A new configuration on the config pipe (or SIGHUP with ``--config-file``) applies
its live fields (log level).
"""

from __future__ import annotations

import argparse
import contextvars
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from pkgd import host, log, phases
from pkgd.config.errors import ModelConfigMismatch
from pkgd.engine.errors import EngineBusyError, EngineSleepingError, LoRANotFoundError
from pkgd.ipc import child, transport
from pkgd.ipc.messages import (
    PROTOCOL_VERSION,
    AbortRequests,
    AddRequest,
    EngineCoreOutput,
    EngineError,
    EngineOutputs,
    Handshake,
    Hello,
    Message,
    SchedulerStats,
    Shutdown,
    UtilityRequest,
    UtilityResult,
    decode_client,
    encode,
)

ROLE = "engine-core"
IDLE_POLL_MS = 1000  # idle wake-ups only re-check signals; frames and signals wake at once
STATS_INTERVAL_S = 0.1  # at most this often a stats-only broadcast while stats keep changing

logger = log.get_logger("pkgd.engine.core_proc")  # also when run as __main__


class EngineCoreProc:
    """Serves one `EngineCore` to any number of clients over a bound ROUTER socket.

    ``core`` needs ``add_request``, ``abort_requests``, ``step``,
    ``has_unfinished_requests``, ``stats`` and ``handshake_info`` (`pkgd.engine.core`).
    """

    def __init__(self, core: Any, sock: zmq.Socket, engine_index: int) -> None:
        self.core = core
        self.sock = sock
        self.engine_index = engine_index
        self.clients: dict[bytes, set[str]] = {}  # identity -> its unfinished request ids
        self.owner: dict[str, bytes] = {}  # request id -> client identity
        self.stopping = False
        self._last_stats: SchedulerStats | None = None
        self._last_stats_time = 0.0
        self._stepped = False  # a step ran since the last stats broadcast
        self._handlers: dict[type[Message], Callable[[bytes, Any], None]] = {
            Hello: self._on_hello,
            AddRequest: self._on_add,
            AbortRequests: self._on_abort,
            UtilityRequest: self._on_utility,
            Shutdown: self._on_shutdown,
        }

    # ---- the loop ------------------------------------------------------------------------

    def handshake(self) -> Handshake:
        """The `Handshake` this core answers `Hello` with (and writes on its ready pipe)."""
        info = self.core.handshake_info()
        if isinstance(info, Handshake):
            return info
        fields = info if isinstance(info, dict) else msgspec.structs.asdict(info)
        fields = {"version": PROTOCOL_VERSION, "pid": os.getpid(), "engine_index": self.engine_index, **fields}
        return Handshake(**fields)

    def run(
        self,
        signals: child.SignalState,
        on_reload: Callable[[], None] = lambda: None,
        config: child.ConfigSource | None = None,
    ) -> None:
        """Serve until SIGTERM/SIGINT or a `Shutdown` frame; then abort what is left.

        ``on_reload`` runs after SIGHUP and whenever ``config``'s pipe is readable.
        Raises whatever ``EngineCore.step`` raises, after telling every client
        (their requests get an `EngineError`).
        """
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(signals.wakeup_fd, zmq.POLLIN)
        config_fd = config.fd if config is not None else None
        if config_fd is not None:
            poller.register(config_fd, zmq.POLLIN)
        while not (self.stopping or signals.stop):
            busy = self.core.has_unfinished_requests()
            events = dict(poller.poll(0 if busy else IDLE_POLL_MS))
            if signals.wakeup_fd in events:
                signals.drain()
            if config_fd is not None and config_fd in events:
                signals.reload = True
            if signals.reload:
                signals.reload = False
                on_reload()
                if config_fd is not None and config is not None and config.closed:
                    poller.unregister(config_fd)  # the supervisor is gone; PDEATHSIG follows
                    config_fd = None
            self._receive_all()
            if self.stopping or signals.stop:
                break
            if self.core.has_unfinished_requests():
                self._step()
            self._maybe_broadcast_stats()
        self.abort_all("engine core is shutting down")

    def _step(self) -> None:
        self._stepped = True
        try:
            outputs = self.core.step()
        except Exception as exc:
            logger.exception("engine_step_failed")
            self.abort_all(f"engine core {self.engine_index} failed: {type(exc).__name__}: {exc}", abort=False)
            raise
        if outputs:
            self._send_outputs(outputs)
        pop_failed = getattr(self.core, "pop_failed_requests", None)
        for rid, message in pop_failed() if pop_failed is not None else ():
            identity = self.owner.get(rid)
            if identity is not None:
                self._forget([rid])
                self._reject(identity, rid, message)

    def _receive_all(self) -> None:
        while True:
            try:
                identity, frame = self.sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            except ValueError:
                continue  # a frame count other than [identity, frame]: not one of ours
            try:
                msg = decode_client(frame)
            except msgspec.DecodeError as exc:
                logger.warning("bad_frame", error=str(exc))
                continue
            self._handlers[type(msg)](identity, msg)

    # ---- handlers (dispatched by frame type) ---------------------------------------------

    def _on_hello(self, identity: bytes, msg: Hello) -> None:
        if msg.version != PROTOCOL_VERSION:
            self._send(
                identity,
                EngineError(
                    engine_index=self.engine_index,
                    message=f"protocol version {msg.version} is not supported; this engine core speaks version "
                    f"{PROTOCOL_VERSION}",
                ),
            )
            return
        self.clients.setdefault(identity, set())
        logger.debug("client_connected", client_id=msg.client_id)
        self._send(identity, self.handshake())

    def _on_add(self, identity: bytes, msg: AddRequest) -> None:
        req = msg.request
        if identity not in self.clients:
            self._reject(identity, req.request_id, "unknown client: send Hello first", rejected=False)
            return
        if req.request_id in self.owner:
            self._reject(identity, req.request_id, f"request id {req.request_id!r} is already running")
            return
        try:
            self.core.add_request(req)
        except ValueError as exc:
            self._reject(identity, req.request_id, str(exc))
            return
        except EngineSleepingError as exc:  # not the caller's fault: a 503
            self._reject(identity, req.request_id, str(exc), rejected=False)
            return
        self.owner[req.request_id] = identity
        self.clients[identity].add(req.request_id)

    def _on_abort(self, identity: bytes, msg: AbortRequests) -> None:
        mine = [rid for rid in msg.request_ids if self.owner.get(rid) == identity]
        if mine:
            self.core.abort_requests(mine)
            self._forget(mine)

    def _on_utility(self, identity: bytes, msg: UtilityRequest) -> None:
        """Run one `EngineCore` utility method between steps and answer the caller."""
        answer = UtilityResult(call_id=msg.call_id, engine_index=self.engine_index)
        method = getattr(self.core, msg.method, None)
        if method is None:
            answer.error, answer.error_status = f"engine core {self.engine_index} has no {msg.method}", 400
        else:
            try:
                answer.result = method(**msg.args)
            except (ValueError, TypeError) as exc:
                status = 409 if isinstance(exc, EngineBusyError) else 404 if isinstance(exc, LoRANotFoundError) else 400
                answer.error, answer.error_status = str(exc), status
            else:
                logger.info("utility_call", method=msg.method, args=msg.args, result=answer.result)
        self._send(identity, answer)

    def _on_shutdown(self, identity: bytes, msg: Shutdown) -> None:
        logger.info("shutdown_requested")
        self.stopping = True

    # ---- sending -------------------------------------------------------------------------

    def _send_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        by_client: dict[bytes, list[EngineCoreOutput]] = {}
        for out in outputs:
            identity = self.owner.get(out.request_id)
            if identity is None:
                continue  # aborted by its client while the step ran
            by_client.setdefault(identity, []).append(out)
            if out.finish_reason is not None:
                self._forget([out.request_id])
        stats = self.core.stats()
        now = time.time()
        for identity, outs in by_client.items():
            self._send(
                identity,
                EngineOutputs(engine_index=self.engine_index, outputs=outs, scheduler_stats=stats, timestamp=now),
            )

    def _maybe_broadcast_stats(self) -> None:
        """Send changed stats to every client (also those without outputs this step), at
        most every ``STATS_INTERVAL_S`` while busy and always once the engine goes idle."""
        stats = self.core.stats()
        now = time.monotonic()
        idle = not self.core.has_unfinished_requests()
        if stats == self._last_stats and not (idle and self._stepped):
            return
        if not idle and now - self._last_stats_time < STATS_INTERVAL_S:
            return
        self._last_stats, self._last_stats_time, self._stepped = stats, now, False
        frame = EngineOutputs(engine_index=self.engine_index, outputs=[], scheduler_stats=stats, timestamp=time.time())
        for identity in list(self.clients):
            self._send(identity, frame)

    def _send(self, identity: bytes, msg: Message) -> None:
        try:
            self.sock.send_multipart([identity, encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise
            self._drop_client(identity)

    def _reject(self, identity: bytes, request_id: str, message: str, *, rejected: bool = True) -> None:
        self._send(
            identity,
            EngineError(engine_index=self.engine_index, message=message, request_ids=[request_id], rejected=rejected),
        )

    def _drop_client(self, identity: bytes) -> None:
        """The client is gone: abort its requests so they stop using the engine."""
        ids = list(self.clients.pop(identity, ()))
        if ids:
            logger.info("client_gone", num_aborted=len(ids))
            self.core.abort_requests(ids)
            for rid in ids:
                self.owner.pop(rid, None)

    def _forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            identity = self.owner.pop(rid, None)
            if identity is not None:
                self.clients.get(identity, set()).discard(rid)

    def abort_all(self, message: str, *, abort: bool = True) -> None:
        """Abort every unfinished request and tell each client which of its requests failed."""
        for identity, ids in list(self.clients.items()):
            if not ids:
                continue
            id_list = list(ids)
            if abort:
                self.core.abort_requests(id_list)
            self._forget(id_list)
            self._send(identity, EngineError(engine_index=self.engine_index, message=message, request_ids=id_list))


# ---- process entry -------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pkgd.engine.core_proc", description="pkgd engine-core process")
    child.add_config_args(p)
    p.add_argument("--ready-fd", type=int, default=None, help="pipe for the one ready/failed frame")
    p.add_argument("--engine-index", type=int, default=0, help="data-parallel rank of this core")
    p.add_argument("--address", required=True, help="ipc://PATH or tcp://HOST:PORT to bind")
    p.add_argument("--parent-pid", type=int, default=None, help="exit at once if this is no longer the parent")
    return p.parse_args(argv)


def _default_core_factory(config: Any, engine_index: int) -> Any:
    from pkgd.engine.core import EngineCore

    return EngineCore(config, engine_index=engine_index)


def _load_interruptibly(factory: Callable[[], Any], signals: child.SignalState) -> tuple[Any, BaseException | None]:
    """Run ``factory`` in a helper thread; return (core, None), (None, error), or (None, None)
    when SIGTERM arrived first (the thread is abandoned; the caller exits with ``os._exit``)."""
    result: dict[str, Any] = {}
    done = threading.Event()

    def load() -> None:
        try:
            result["core"] = factory()
        except BaseException as exc:  # reported to the supervisor, never swallowed
            result["error"] = exc
        finally:
            done.set()

    # In a copy of this context: the loader's log lines carry the process's pid, role, dp_rank.
    threading.Thread(target=contextvars.copy_context().run, args=(load,), name="engine-load", daemon=True).start()
    while not done.wait(0.05):
        if signals.stop:
            return None, None
    return result.get("core"), result.get("error")


def main(argv: list[str] | None = None, *, core_factory: Callable[[Any, int], Any] | None = None) -> int:
    """Entry of the engine-core process; returns the exit status.

    ``core_factory(config, engine_index)`` builds the core (default: `EngineCore`); tests
    pass a small deterministic one.
    """
    args = parse_args(argv)
    child.die_with_parent(args.parent_pid)
    child.set_process_name(f"pkgd-engine{args.engine_index}")
    ready = child.ReadyPipe(args.ready_fd)
    signals = child.SignalState().install()
    source = child.ConfigSource(args.config_fd, args.config_file)
    try:
        config = source.initial()
    except (OSError, ValueError, EOFError, TimeoutError) as exc:
        ready.failed(ROLE, f"cannot read config {source.describe()}: {exc}")
        return 1
    log.configure(config.logging, role=ROLE, dp_rank=args.engine_index)
    host.set_torch_huge_pages(config.parallel.cpu_huge_pages)  # before torch's first allocation
    # one progress bar per terminal: the first engine core of this node draws it
    phases.allow_bars(args.engine_index == config.serve_plan().dp_start_rank)
    ctx = zmq.Context()
    try:
        sock = transport.bind_router(ctx, args.address)
    except (ValueError, zmq.ZMQError) as exc:
        logger.error("bind_failed", address=args.address, error=str(exc))
        ready.failed(ROLE, f"engine core {args.engine_index} cannot bind {args.address}: {exc}")
        return 1
    factory = core_factory or _default_core_factory
    logger.info("engine_loading", address=args.address)
    t0 = time.monotonic()
    core, error = _load_interruptibly(lambda: factory(config, args.engine_index), signals)
    if core is None:
        sock.close(linger=0)
        if error is None:
            logger.info("engine_load_cancelled")
            os._exit(0)  # the loader thread may sit in C code; do not wait for it
        logger.error("engine_load_failed", error=f"{type(error).__name__}: {error}")
        if isinstance(error, ModelConfigMismatch):
            ready.failed(ROLE, f"engine core {args.engine_index}: invalid config for this model: {error}", usage=True)
        else:
            ready.failed(ROLE, f"engine core {args.engine_index} failed to load: {type(error).__name__}: {error}")
        return 1
    proc = EngineCoreProc(core, sock, args.engine_index)
    hs = proc.handshake()
    ready.send(hs)
    logger.info(
        "engine_ready",
        seconds=round(time.monotonic() - t0, 2),
        num_kv_blocks=hs.num_kv_blocks,
        max_model_len=hs.max_model_len,
    )

    def reload() -> None:
        try:
            configs = source.updates()
        except (OSError, ValueError) as exc:
            logger.error("reload_failed", error=str(exc))
            return
        if configs:
            log.set_level(configs[-1].logging.level)

    status = 0
    try:
        proc.run(signals, on_reload=reload, config=source)
    except Exception:
        status = 1
    finally:
        sock.close()
        ctx.term()
        shutdown = getattr(core, "shutdown", None)
        if shutdown is not None:
            shutdown()
    logger.info("engine_stopped", status=status)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
