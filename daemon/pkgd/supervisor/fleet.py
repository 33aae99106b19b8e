"""The children the supervisor runs: the current engine cores and API servers, start-up of
whole sets, orderly stops, and crash restarts with backoff.

Invariants:

* ``engines`` and ``apis`` hold the *current* set, by DP rank and server index. A reload
  builds a new set beside it and installs it with `Fleet.install`, which marks the old set
  ``retiring`` (its exits are not crashes) before anyone stops it.
* Every child ever spawned and not yet reaped is in ``_alive``, whatever its set, so shutdown
  leaves no process behind.
* A current child that exits unexpectedly is a crash: `RestartPolicy` gives the delay, the
  restart spawns the same `ChildSpec` (same address: clients reconnect) and waits for its ready
  frame. A restart is dropped if its child left the current set meanwhile (a reload replaced
  it); too many crashes call ``on_give_up``.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Iterable
from typing import Any

from pkgd import log
from pkgd.supervisor.children import Child, ChildSpec, ChildStartError, describe_exit
from pkgd.supervisor.restart import RestartPolicy

logger = log.get_logger(__name__)


class StopRequested(Exception):
    """Shutdown began while waiting for children; the waiter gives up."""


class Fleet:
    """Current children plus the mechanics to start, stop and restart them."""

    def __init__(self, policy: RestartPolicy, on_give_up: Callable[[str], None], on_exit: Callable[[Child], None] | None = None) -> None:
        self.policy = policy
        self.on_give_up = on_give_up
        self.on_exit = on_exit
        self.engines: dict[int, Child] = {}
        self.apis: dict[int, Child] = {}
        self.engine_generation = 0
        self.api_generation = 0
        self.restarts_enabled = False
        self.ready_timeout = 900.0
        self.stop_event = asyncio.Event()
        self.force_event = asyncio.Event()
        self._alive: set[Child] = set()
        self._restarts: dict[Child, asyncio.Task[None]] = {}

    # ---- queries ---------------------------------------------------------------------

    def current(self) -> list[Child]:
        return [*self.engines.values(), *self.apis.values()]

    def alive(self) -> list[Child]:
        return list(self._alive)

    def steady(self) -> bool:
        """Every current child is ready and no restart is pending."""
        return not self._restarts and all(c.state == "ready" for c in self.current())

    def describe(self) -> list[dict[str, object]]:
        """One entry per current child (``pkgd status``)."""
        return [
            {
                "role": c.spec.role,
                "index": c.spec.index,
                "generation": c.spec.generation,
                "pid": c.pid,
                "state": "restarting" if c in self._restarts else c.state,
                "uptime_s": round(c.uptime(), 1),
                "restarts": c.restarts,
                "address": c.spec.address,
            }
            for c in self.current()
        ]

    # ---- spawning and waiting --------------------------------------------------------

    def spawn(self, spec: ChildSpec, restarts: int = 0) -> Child:
        child = Child.spawn(spec, restarts)
        child.on_exit = self._exited
        self._alive.add(child)
        logger.info("child_started", child=child.name, generation=spec.generation, child_pid=child.pid, address=spec.address)
        return child

    async def wait_ready(self, children: Iterable[Child], timeout: float) -> None:
        """Wait for every child's ready frame.

        Raises `ChildStartError` (the first failure, or a timeout naming
        ``supervisor.engine_ready_timeout``) or `StopRequested` when shutdown begins.
        """
        children = list(children)
        if not children:
            return
        ready = asyncio.gather(*(asyncio.shield(c.ready) for c in children))
        stop = asyncio.ensure_future(self.stop_event.wait())
        try:
            waiters: set[asyncio.Future[Any]] = {ready, stop}
            done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if ready in done:
            ready.result()
            return
        ready.cancel()
        if stop in done:
            raise StopRequested
        late = ", ".join(c.name for c in children if not c.ready.done())
        raise ChildStartError(f"{late} not ready within {timeout:g} s (supervisor.engine_ready_timeout)")

    async def start_set(self, specs: list[ChildSpec]) -> dict[int, Child]:
        """Spawn ``specs`` and wait until all are ready; on failure stop them and re-raise."""
        engines, _ = await self.start_pair(specs, [])
        return engines

    async def start_pair(self, engine_specs: list[ChildSpec], api_specs: list[ChildSpec]) -> tuple[dict[int, Child], dict[int, Child]]:
        """Start engine cores and the API servers wired to them, and wait until all are ready.

        Both sets are spawned at once: an API server loads its tokenizer while the cores load
        the model, then waits for their `Handshake` before it reports ready, so start-up takes
        the longer of the two instead of their sum. On any failure (a child failing, a core
        dying before the API servers are ready, shutdown) every child of both sets is stopped
        and the error re-raised.
        """
        engines = {spec.index: self.spawn(spec) for spec in engine_specs}
        apis = {spec.index: self.spawn(spec) for spec in api_specs}
        started = [*engines.values(), *apis.values()]
        try:
            await self.wait_ready(engines.values(), self.ready_timeout)
            await self.wait_ready(apis.values(), self.ready_timeout)
            dead = [c.name for c in started if not c.alive]
            if dead:
                raise ChildStartError(f"{', '.join(dead)} died during start-up")
        except BaseException:
            await self.stop_all(started, grace=2.0)
            raise
        return engines, apis

    def install(self, engines: dict[int, Child] | None = None, apis: dict[int, Child] | None = None) -> list[Child]:
        """Make new sets current; returns the replaced children, marked retiring."""
        old: list[Child] = []
        if engines is not None:
            old += self.engines.values()
            self.engines = engines
            self.engine_generation = max((c.spec.generation for c in engines.values()), default=self.engine_generation)
        if apis is not None:
            old += self.apis.values()
            self.apis = apis
            self.api_generation = max((c.spec.generation for c in apis.values()), default=self.api_generation)
        for child in old:
            child.retiring = True
            self._cancel_restart(child)
        return old

    async def stop_all(self, children: Iterable[Child], grace: float | Callable[[Child], float]) -> None:
        """Stop children concurrently (SIGTERM, ``grace`` s, SIGKILL); SIGKILL all at once
        when ``force_event`` is set (a second SIGTERM/SIGINT)."""
        children = [c for c in children if c.alive]
        if not children:
            return
        stops = asyncio.gather(*(c.stop(grace(c) if callable(grace) else grace) for c in children))
        force = asyncio.ensure_future(self.force_event.wait())
        try:
            waiters: set[asyncio.Future[Any]] = {stops, force}
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            if not stops.done():
                for child in children:
                    child.signal(signal.SIGKILL)
            await stops
        finally:
            force.cancel()

    # ---- crashes ---------------------------------------------------------------------

    def _exited(self, child: Child) -> None:
        self._alive.discard(child)
        if self.on_exit is not None:
            self.on_exit(child)
        current = self.engines if child.spec.role == "engine-core" else self.apis
        if child.retiring or not self.restarts_enabled or current.get(child.spec.index) is not child:
            return
        assert child.returncode is not None
        logger.warning("child_died", child=child.name, child_pid=child.pid, how=describe_exit(child.returncode), uptime_s=round(child.uptime(), 1))
        delay = self.policy.record_crash(time.monotonic())
        if delay is None:
            cfg = self.policy.config
            self.on_give_up(f"{cfg.max_restarts + 1} crashes within {cfg.restart_window:g} s (supervisor.max_restarts); giving up")
            return
        logger.info("child_restart_scheduled", child=child.name, delay_s=delay)
        self._restarts[child] = asyncio.ensure_future(self._restart(child, delay))

    async def _restart(self, dead: Child, delay: float) -> None:
        current = self.engines if dead.spec.role == "engine-core" else self.apis
        try:
            await asyncio.sleep(delay)
            if current.get(dead.spec.index) is not dead or self.stop_event.is_set():
                return
            new = self.spawn(dead.spec, dead.restarts + 1)
            current[dead.spec.index] = new
        finally:
            self._restarts.pop(dead, None)
        try:
            await self.wait_ready([new], self.ready_timeout)
        except ChildStartError as exc:
            logger.error("child_restart_failed", child=new.name, error=str(exc))
            new.signal(signal.SIGKILL)  # if still alive (timeout); its exit counts as the next crash
            return
        except StopRequested:
            return
        logger.info("child_restarted", child=new.name, child_pid=new.pid, restarts=new.restarts)

    def _cancel_restart(self, child: Child) -> None:
        task = self._restarts.pop(child, None)
        if task is not None:
            task.cancel()

    def cancel_restarts(self) -> None:
        self.restarts_enabled = False
        for child in list(self._restarts):
            self._cancel_restart(child)
