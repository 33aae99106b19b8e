"""SIGHUP reload: re-compose, validate, and apply the difference with the least disruption.

A reload never leaves the daemon worse off. An invalid config changes nothing (each problem
is logged with its dotted path). A valid one is applied by the most disruptive reload class
among its changed fields (``x-reload`` in the schema, `pkgd.config.fields.ReloadClass`):

The plan is `pkgd.config.reload.plan_reload` (the same one ``pkgd config diff`` shows):

Every change that restarts children is a swap of whole generations
(`pkgd.supervisor.fleet.Generation`): the new generation, with its own configuration, is
started beside the current one, becomes current once every child is ready (traffic moves:
new connections go to its API servers), and the old one drains in the background (its API
servers close their copy of the listener, answer with ``Connection: close`` and serve their
open connections until those close). A child of either generation that crashes meanwhile is
restarted with its own generation's configuration.

* ``live`` — the current generation takes the new tree and sends it on every child's config
  pipe (log level, API keys, CORS, served names, limits); the supervisor applies it too (its
  own log level, restart policy).
* ``api`` — a new generation that carries the engine cores over (sent the new tree) and
  starts new API servers on the held socket(s). The listening socket never closes, so no
  connection is refused.
* ``engine`` — ``overlap``: a new generation of engine cores (new IPC addresses) and API
  servers wired to them. ``stop_first`` (when memory cannot hold both, or headless cores whose
  TCP addresses are fixed): drain and stop the current generation, then start the new one
  while connections wait in the listen backlog; if it fails, the old configuration is started
  again as a generation of its own.
* ``restart`` — cannot be applied in place (``frontend.headless``, ``supervisor.runtime_dir``):
  the reload is refused and says so.

A new set that fails to start is stopped and the old config stays in force.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

from pydantic import ValidationError

from pkgd import host, log
from pkgd.config.fields import ReloadClass
from pkgd.config.reload import plan_reload
from pkgd.config.vllm_config import ServePlan, VllmConfig
from pkgd.supervisor.children import Child, ChildStartError
from pkgd.supervisor.fleet import Fleet, Generation
from pkgd.supervisor.sockets import BindError, Listener, bind, listen_specs

logger = log.get_logger(__name__)

OVERLAP_MEMORY_FACTOR = 1.25  # headroom over the current engine cores' RSS to start a second set


class ReloadFailed(Exception):
    """The new config was valid but its children could not start; the old config still serves."""


class RollbackFailed(Exception):
    """A stop-first swap failed and the old config could not be started again either."""


class Supervisor(Protocol):
    """What a reload reads and drives of the running supervisor
    (`pkgd.supervisor.supervisor.Supervisor` implements it)."""

    config: VllmConfig
    plan: ServePlan
    listeners: list[Listener]
    fleet: Fleet
    recompose: Callable[[], VllmConfig]
    preflight: Callable[[VllmConfig], list[str]]

    def adopt_config(self, new: VllmConfig) -> None: ...

    def swap_listeners(self, listeners: list[Listener]) -> None: ...

    def retire(self, children: list[Child], config: VllmConfig) -> None: ...

    async def drain_replaced(self, children: list[Child], config: VllmConfig) -> None: ...

    async def start_generation(self, gen: Generation, plan: ServePlan, listeners: list[Listener]) -> None: ...


def config_problems(exc: BaseException) -> list[str]:
    """One line per problem of a failed re-compose (ConfigError, pydantic, or anything else)."""
    problems = getattr(exc, "problems", None)
    if problems:
        return [str(p) for p in problems]
    if isinstance(exc, ValidationError):
        return [f"{'.'.join(str(x) for x in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors()]
    return [f"{type(exc).__name__}: {exc}"]


async def reload(sup: Supervisor) -> dict[str, Any]:
    """Run one reload; the outcome as reported to ``pkgd reload`` and the log."""
    started = time.monotonic()
    try:
        new = await asyncio.to_thread(sup.recompose)
    except Exception as exc:  # any failure to compose is a rejected reload, never a crash
        return _outcome("rejected", started, problems=config_problems(exc))
    plan = plan_reload(sup.config, new)
    if plan.is_noop:
        return _outcome("unchanged", started)
    cls, changed = plan.reload_class, list(plan.changed)
    if cls is ReloadClass.RESTART:
        fields = ", ".join(c.key for c in plan.changes if c.reload is ReloadClass.RESTART)
        return _outcome(
            "rejected",
            started,
            cls,
            changed,
            [f"{fields}: cannot change by reload; restart pkgd (systemctl restart pkgd)"],
        )
    if cls is not ReloadClass.LIVE and (problems := await asyncio.to_thread(sup.preflight, new)):
        # Before anything stops: a stop_first swap would otherwise drain the serving generation
        # for a model that cannot load.
        return _outcome("rejected", started, cls, changed, problems)
    apply = {ReloadClass.LIVE: _apply_live, ReloadClass.API: _apply_api, ReloadClass.ENGINE: _apply_engine}[cls]
    try:
        await apply(sup, new)
    except (ReloadFailed, BindError, ChildStartError) as exc:
        return _outcome("failed", started, cls, changed, [str(exc)])
    sup.adopt_config(new)
    return _outcome("applied", started, cls, changed)


def _outcome(
    result: str,
    started: float,
    cls: ReloadClass | None = None,
    changed: list[str] | None = None,
    problems: list[str] | None = None,
) -> dict[str, Any]:
    return {
        "ok": result in ("applied", "unchanged"),
        "result": result,
        "reload_class": cls.value if cls else None,
        "changed": changed or [],
        "problems": problems or [],
        "duration_s": round(time.monotonic() - started, 3),
    }


async def _apply_live(sup: Supervisor, new: VllmConfig) -> None:
    assert sup.fleet.current is not None
    sup.fleet.current.set_config(new)


async def _apply_api(sup: Supervisor, new: VllmConfig) -> None:
    plan = new.serve_plan()
    listeners, fresh = _listeners_for(sup, new, plan)
    fleet = sup.fleet
    gen = fleet.new_generation(new, engines=fleet.engines)
    try:
        await sup.start_generation(gen, plan, listeners)
    except BaseException:
        _close(fresh)
        raise
    old = fleet.install(gen)
    frame = gen.frame()
    for child in gen.engines.values():
        child.send_config(frame)  # the carried cores: live fields that changed alongside
    sup.swap_listeners(listeners)
    sup.retire(old, new)


async def _apply_engine(sup: Supervisor, new: VllmConfig) -> None:
    plan = new.serve_plan()
    listeners, fresh = _listeners_for(sup, new, plan)
    overlap, why = can_overlap(sup, new, plan)
    logger.info("engine_swap", strategy="overlap" if overlap else "stop_first", reason=why)
    try:
        if overlap:
            await _swap_overlap(sup, new, plan, listeners)
        else:
            await _swap_stop_first(sup, new, plan, listeners)
    except BaseException:
        _close(fresh)
        raise
    sup.swap_listeners(listeners)


async def _swap_overlap(sup: Supervisor, new: VllmConfig, plan: ServePlan, listeners: list[Listener]) -> None:
    gen = sup.fleet.new_generation(new)
    await sup.start_generation(gen, plan, listeners)
    sup.retire(sup.fleet.install(gen), new)


async def _swap_stop_first(sup: Supervisor, new: VllmConfig, plan: ServePlan, listeners: list[Listener]) -> None:
    fleet = sup.fleet
    previous = fleet.current
    assert previous is not None
    old = fleet.install(Generation(previous.id, previous.config))  # the same generation, stopped
    # Its requests end first (nothing cut); meanwhile new connections wait in the listen backlog.
    await sup.drain_replaced(old, new)
    gen = fleet.new_generation(new)
    try:
        await sup.start_generation(gen, plan, listeners)
    except ChildStartError as exc:
        logger.error("engine_swap_failed", error=str(exc), action="starting the previous configuration again")
        again = fleet.new_generation(previous.config)
        try:
            await sup.start_generation(again, previous.config.serve_plan(), sup.listeners)
        except ChildStartError as exc2:
            raise RollbackFailed(f"new config failed ({exc}) and the previous one too ({exc2})") from exc2
        fleet.install(again)
        raise ReloadFailed(str(exc)) from exc
    fleet.install(gen)


def can_overlap(sup: Supervisor, new: VllmConfig, plan: ServePlan) -> tuple[bool, str]:
    """Whether old and new engine cores may run side by side, and why."""
    if plan.mode == "headless" or sup.plan.mode == "headless":
        return False, "headless engine cores keep their TCP addresses"
    choice = new.supervisor.engine_swap
    if choice != "auto":
        return choice == "overlap", f"supervisor.engine_swap: {choice}"
    if new.parallel.device == "cuda" or (new.parallel.device == "auto" and os.path.exists("/dev/nvidiactl")):
        return False, "engine cores hold most of the GPU memory"
    rss = sum(_tree_rss(c.pid) for c in sup.fleet.engines.values())
    need = rss * OVERLAP_MEMORY_FACTOR * plan.dp_local / max(1, len(sup.fleet.engines))
    available = host.mem_available_bytes() or 0
    return available > need, f"{available / 2**30:.1f} GiB available, a second set needs ~{need / 2**30:.1f} GiB"


def _tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants (tensor-parallel workers), from /proc."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def _listeners_for(sup: Supervisor, new: VllmConfig, plan: ServePlan) -> tuple[list[Listener], list[Listener]]:
    """Listeners the new config needs (held ones reused) and which of them are freshly bound."""
    specs = listen_specs(new, plan)
    if any(lst.from_systemd for lst in sup.listeners):
        if specs != [lst.spec for lst in sup.listeners]:
            if len(specs) != len(sup.listeners):
                raise BindError(
                    f"this change needs {len(specs)} listening socket(s) but systemd passed "
                    f"{len(sup.listeners)}; restart pkgd with pkgd.socket changed"
                )
            logger.warning(
                "frontend_address_ignored",
                reason="listening sockets come from systemd (pkgd.socket); change them there",
            )
        return sup.listeners, []
    held = {lst.spec: lst for lst in sup.listeners}
    out: list[Listener] = []
    fresh: list[Listener] = []
    try:
        for spec in specs:
            if spec in held:
                out.append(held[spec])
            else:
                fresh.append(bind(spec))
                out.append(fresh[-1])
    except BindError:
        _close(fresh)
        raise
    return out, fresh


def _close(listeners: list[Listener]) -> None:
    for listener in listeners:
        listener.close()
