"""The children the supervisor runs, as generations: start-up of whole sets, orderly stops,
and crash restarts with backoff.

A `Generation` is one configuration in force: the validated tree (sent to each of its children
over its config pipe), and the engine cores and API servers serving it. A reload that
restarts API servers starts a new generation that carries the engine cores over (same
processes, sent the new tree for its live fields); an engine reload starts a generation of
new children only. The new generation is started beside the current one, waits until every
child is ready, and then `Fleet.install` makes it current and marks the children it does not
keep ``retiring`` (their exits are not crashes) before anyone stops them.

Invariants:

* ``current`` is the generation in force; ``engines`` and ``apis`` are its children by DP rank
  and server index.
* Every child ever spawned and not yet reaped is in ``_alive``, whatever its generation, so
  shutdown leaves no process behind.
* A child of the current generation that exits unexpectedly is a crash: `RestartPolicy` gives
  the delay, the restart spawns the same `ChildSpec` (same address: clients reconnect) with
  the configuration of the child's own generation, and waits for its ready frame. A restart
  is dropped if its child left the current generation meanwhile (a reload replaced it); too
  many crashes call ``on_give_up``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from pkgd import log
from pkgd.ipc.config_channel import encode_config
from pkgd.supervisor.children import Child, ChildSpec, ChildStartError, describe_exit
from pkgd.supervisor.restart import RestartPolicy

if TYPE_CHECKING:
    from pkgd.config.vllm_config import VllmConfig

logger = log.get_logger(__name__)


class StopRequested(Exception):
    """Shutdown began while waiting for children; the waiter gives up."""


@dataclasses.dataclass(eq=False)
class Generation:
    """One configuration in force and its children (see module docstring)."""

    id: int
    config: VllmConfig
    engines: dict[int, Child] = dataclasses.field(default_factory=dict)
    apis: dict[int, Child] = dataclasses.field(default_factory=dict)

    def frame(self) -> bytes:
        """The config-pipe frame of ``config`` (`pkgd.ipc.config_channel`)."""
        return encode_config(self.config)

    def children(self) -> list[Child]:
        return [*self.engines.values(), *self.apis.values()]

    def set_config(self, config: VllmConfig) -> None:
        """Apply a live change: ``config`` becomes this generation's, and every child of it
        gets the new frame on its config pipe."""
        self.config = config
        frame = self.frame()
        for child in self.children():
            child.send_config(frame)


class Fleet:
    """The current generation plus the mechanics to start, stop and restart children."""

    def __init__(
        self, policy: RestartPolicy, on_give_up: Callable[[str], None], on_exit: Callable[[Child], None] | None = None
    ) -> None:
        self.policy = policy
        self.on_give_up = on_give_up
        self.on_exit = on_exit
        self.current: Generation | None = None
        self._next_id = 0
        self.restarts_enabled = False
        self.ready_timeout = 900.0
        self.stop_event = asyncio.Event()
        self.force_event = asyncio.Event()
        self._alive: set[Child] = set()
        self._restarts: dict[Child, asyncio.Task[None]] = {}

    # ---- queries ---------------------------------------------------------------------

    def new_generation(self, config: VllmConfig, engines: dict[int, Child] | None = None) -> Generation:
        """A generation with the next id for ``config`` (``engines``: cores carried over)."""
        gen = Generation(self._next_id, config, dict(engines or {}))
        self._next_id += 1
        return gen

    @property
    def engines(self) -> dict[int, Child]:
        return self.current.engines if self.current is not None else {}

    @property
    def apis(self) -> dict[int, Child]:
        return self.current.apis if self.current is not None else {}

    @property
    def engine_generation(self) -> int:
        """Generation id that started the current engine cores."""
        return max((c.spec.generation for c in self.engines.values()), default=0)

    @property
    def api_generation(self) -> int:
        """Generation id that started the current API servers."""
        return max((c.spec.generation for c in self.apis.values()), default=0)

    def current_children(self) -> list[Child]:
        return self.current.children() if self.current is not None else []

    def alive(self) -> list[Child]:
        return list(self._alive)

    def steady(self) -> bool:
        """Every current child is ready and no restart is pending."""
        return not self._restarts and all(c.state == "ready" for c in self.current_children())

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
            for c in self.current_children()
        ]

    # ---- spawning and waiting --------------------------------------------------------

    def spawn(self, spec: ChildSpec, generation: Generation, restarts: int = 0) -> Child:
        """Start ``spec`` as a child of ``generation`` (it gets that generation's config)."""
        child = Child.spawn(spec, generation.frame(), restarts)
        child.generation = generation
        child.on_exit = self._exited
        self._alive.add(child)
        logger.info(
            "child_started", child=child.name, generation=spec.generation, child_pid=child.pid, address=spec.address
        )
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
        ready.add_done_callback(_retrieve)  # or asyncio logs "exception was never retrieved"
        if stop in done:
            raise StopRequested
        late = ", ".join(c.name for c in children if not c.ready.done())
        raise ChildStartError(f"{late} not ready within {timeout:g} s (supervisor.engine_ready_timeout)")

    async def start(self, generation: Generation, engine_specs: list[ChildSpec], api_specs: list[ChildSpec]) -> None:
        """Start the engine cores and API servers of ``generation`` (besides the cores it
        carries) and wait until all are ready.

        Both sets are spawned at once: an API server loads its tokenizer while the cores load
        the model, then waits for their `Handshake` before it reports ready, so start-up takes
        the longer of the two instead of their sum. On any failure (a child failing, a core
        dying before the API servers are ready, shutdown) every child started here is stopped
        and the error re-raised; carried cores are left alone.
        """
        engines = {spec.index: self.spawn(spec, generation) for spec in engine_specs}
        apis = {spec.index: self.spawn(spec, generation) for spec in api_specs}
        generation.engines.update(engines)
        generation.apis.update(apis)
        started = [*engines.values(), *apis.values()]
        try:
            await self.wait_ready(engines.values(), self.ready_timeout)
            await self.wait_ready(apis.values(), self.ready_timeout)
            dead = [c.name for c in generation.children() if not c.alive]
            if dead:
                raise ChildStartError(f"{', '.join(dead)} died during start-up")
        except BaseException:
            await self.stop_all(started, grace=2.0)
            raise

    def install(self, generation: Generation) -> list[Child]:
        """Make ``generation`` current; returns the children of the previous one it does not
        keep, marked retiring. Carried children now belong to ``generation``."""
        old = [c for c in self.current_children() if c not in set(generation.children())]
        for child in generation.children():
            child.generation = generation
        self.current = generation
        for child in old:
            child.retiring = True
            self._cancel_restart(child)
        return old

    async def stop_all(
        self,
        children: Iterable[Child],
        grace: float | None | Callable[[Child], float | None],
        signum: int = signal.SIGTERM,
    ) -> None:
        """Stop children concurrently (``signum``, ``grace`` s or None = no limit, SIGKILL);
        SIGKILL all at once when ``force_event`` is set (a second SIGTERM/SIGINT)."""
        children = [c for c in children if c.alive]
        if not children:
            return
        stops = asyncio.gather(*(c.stop(grace(c) if callable(grace) else grace, signum) for c in children))
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
        gen = child.generation
        if (
            child.retiring
            or not self.restarts_enabled
            or gen is not self.current
            or _slot(gen, child).get(child.spec.index) is not child
        ):
            return
        assert child.returncode is not None
        logger.warning(
            "child_died",
            child=child.name,
            child_pid=child.pid,
            how=describe_exit(child.returncode),
            uptime_s=round(child.uptime(), 1),
        )
        delay = self.policy.record_crash(time.monotonic())
        if delay is None:
            cfg = self.policy.config
            self.on_give_up(
                f"{cfg.max_restarts + 1} crashes within {cfg.restart_window:g} s (supervisor.max_restarts); giving up"
            )
            return
        logger.info("child_restart_scheduled", child=child.name, delay_s=delay)
        self._restarts[child] = asyncio.ensure_future(self._restart(child, delay))

    async def _restart(self, dead: Child, delay: float) -> None:
        gen = dead.generation
        assert isinstance(gen, Generation)
        slot = _slot(gen, dead)
        try:
            await asyncio.sleep(delay)
            if gen is not self.current or slot.get(dead.spec.index) is not dead or self.stop_event.is_set():
                return
            new = self.spawn(dead.spec, gen, dead.restarts + 1)  # its own generation's config
            slot[dead.spec.index] = new
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


def _slot(gen: object, child: Child) -> dict[int, Child]:
    """The dict of ``gen`` that holds ``child``'s role."""
    assert isinstance(gen, Generation)
    return gen.engines if child.spec.role == "engine-core" else gen.apis


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()
