"""Generations replaced by a reload, drained until their last request ends.

A reload never cuts a request (docs/operations.md, "Reload"): the generation it replaces keeps
every request its API servers accepted until that request ends, bounded only by
``supervisor.reload_drain_timeout`` (null: no bound) — never by ``supervisor.drain_timeout``,
which bounds a shutdown. `Retirements` runs each such drain:

1. every API server of the old generation is sent, on its config pipe, its own tree with the
   *new* ``supervisor`` section (a drain key changed by the same reload applies to the
   generation being drained), then SIGUSR1: it stops accepting (its copy of the listening
   socket closes; the queue stays for the new API servers), serves at most one more request
   per open connection, answers each with ``Connection: close``, and exits 0 when its last
   connection ends (`pkgd.api.server`);
2. the supervisor waits for them, at most ``reload_drain_timeout`` plus `API_STOP_EXTRA` s (the
   API server itself ends what is left at the deadline with an error event), then SIGKILL;
3. then the old engine cores that no generation keeps are stopped (SIGTERM): by then no API
   server sends them work.

A shutdown meanwhile sends SIGTERM to every child, the retiring ones included: an API server
that was retiring then ends what it still holds ``drain_timeout`` later at the latest.

While a generation drains, ``pkgd status`` lists it with the connections its API servers
still hold (each a request in progress, or a keep-alive connection until it closes after one
more request or at ``keep_alive_timeout``), and the log says so
every `PROGRESS_LOG_S` seconds (``generation_draining``), then ``generation_retired``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Callable, Iterable
from typing import Any

from pkgd import log
from pkgd.config.vllm_config import VllmConfig
from pkgd.ipc.config_channel import encode_config
from pkgd.supervisor.children import Child
from pkgd.supervisor.fleet import Fleet

logger = log.get_logger(__name__)

API_STOP_EXTRA = 5.0  # s past an API server's own deadline before it is killed
PROGRESS_LOG_S = 10.0  # s between generation_draining lines
RETIRE_SIGNAL = signal.SIGUSR1  # what an API server takes as "you were replaced: drain"


@dataclasses.dataclass(eq=False)
class Draining:
    """One replaced generation's children still draining."""

    generation: int
    children: list[Child]
    reload_drain_timeout: float | None
    started: float = dataclasses.field(default_factory=time.monotonic)

    def alive(self) -> list[Child]:
        return [c for c in self.children if c.alive]


class Retirements:
    """The drains of replaced generations (see module docstring); ``ports`` gives the TCP ports
    the API servers serve on (to count their connections), ``engine_grace`` how long an
    engine core may take to stop."""

    def __init__(self, fleet: Fleet, ports: Callable[[], set[int]], engine_grace: float) -> None:
        self.fleet = fleet
        self.ports = ports
        self.engine_grace = engine_grace
        self.draining: list[Draining] = []
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, children: list[Child], config: VllmConfig) -> None:
        """Drain ``children`` in the background under ``config``'s supervisor section."""
        task = asyncio.ensure_future(self.drain(children, config))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, children: list[Child], config: VllmConfig) -> None:
        """Drain ``children`` (API servers first, then engine cores) and return when all exited."""
        if not children:
            return
        timeout = config.supervisor.reload_drain_timeout
        gen = min(getattr(c.generation, "id", c.spec.generation) for c in children)
        entry = Draining(gen, list(children), timeout)
        self.draining.append(entry)
        apis = [c for c in children if c.spec.role == "api-server" and c.alive]
        engines = [c for c in children if c.spec.role == "engine-core"]
        for child in apis:
            own = getattr(child.generation, "config", None) or config
            child.send_config(encode_config(own.model_copy(update={"supervisor": config.supervisor})))
        await asyncio.gather(*(c.flush_config() for c in apis))
        self._log("generation_draining", entry)
        progress = asyncio.ensure_future(self._report(entry))
        try:
            grace = None if timeout is None else timeout + API_STOP_EXTRA
            await self.fleet.stop_all(apis, grace, RETIRE_SIGNAL)
            await self.fleet.stop_all(engines, self.engine_grace)
        finally:
            progress.cancel()
            self.draining.remove(entry)
        logger.info("generation_retired", generation=gen, duration_s=round(time.monotonic() - entry.started, 2))

    async def _report(self, entry: Draining) -> None:
        while True:
            await asyncio.sleep(PROGRESS_LOG_S)
            self._log("generation_draining", entry)

    def _log(self, event: str, entry: Draining) -> None:
        info = self.describe_one(entry)
        logger.info(event, **{k: info[k] for k in ("generation", "connections", "children", "draining_s")})

    def describe_one(self, entry: Draining) -> dict[str, Any]:
        ports = self.ports()
        children = [
            {
                "role": c.spec.role,
                "index": c.spec.index,
                "pid": c.pid,
                "connections": open_connections(c.pid, ports) if c.spec.role == "api-server" else None,
            }
            for c in entry.alive()
        ]
        counts = [c["connections"] for c in children if c["connections"] is not None]
        return {
            "generation": entry.generation,
            "connections": sum(counts),
            "children": children,
            "draining_s": round(time.monotonic() - entry.started, 1),
            "reload_drain_timeout": entry.reload_drain_timeout,
        }

    def describe(self) -> list[dict[str, Any]]:
        """One entry per generation still draining (``pkgd status``)."""
        return [self.describe_one(e) for e in self.draining]

    async def wait(self) -> None:
        """Until every drain running now has ended (shutdown)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)


def open_connections(pid: int, ports: Iterable[int]) -> int:
    """TCP connections process ``pid`` holds on one of ``ports`` (from /proc; 0 when it is gone).

    A connection of a retiring API server is a request in progress or a keep-alive connection
    that closes after at most one more.
    """
    wanted = set(ports)
    inodes: set[str] = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    if not inodes or not wanted:
        return 0
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if inode in inodes and state != "0A" and int(local.rsplit(":", 1)[1], 16) in wanted:  # 0A: LISTEN
                count += 1
    return count
