"""The supervisor: the daemon's main process (docs/architecture.md, "Processes").

Life cycle, as a state machine (``state``): ``starting`` → ``running`` ⇄ ``reloading`` →
``stopping``.

* `Supervisor.prepare` (synchronous, before anything heavy): bind or adopt the listening
  sockets (a port in use fails here, exit 2), create and lock the runtime directory.
* ``starting``: generation 0 (`pkgd.supervisor.fleet.Generation`): engine cores and the API
  servers on the held sockets, each sent the configuration on its config pipe, spawned together
  (an API server loads its tokenizer while the cores load the model, and reports ready only
  once the cores answer); wait for every `Handshake` (``supervisor.engine_ready_timeout``),
  then every `ApiServerReady`; one ``ready`` log line with the URL; ``READY=1``.
* ``running``: the loop waits for work. Signal handlers only flip state:
  SIGHUP/``pkgd reload`` queue a reload (so does a changed config file under
  ``supervisor.watch_config``, `pkgd.supervisor.watch`), SIGTERM/SIGINT request the stop;
  crashes are handled by `Fleet`. ``WATCHDOG=1`` goes out every half ``WATCHDOG_USEC`` while the children are
  healthy; ``/health`` of each endpoint is probed for ``pkgd status`` and the watchdog.
* ``stopping``: ``STOPPING=1``; make the TCP listeners drop new connections' SYNs (a client
  retries and is refused once the socket is closed; none is reset in the accept queue) and
  close the supervisor's copies; SIGTERM the
  API servers, which stop accepting and drain for up to ``supervisor.drain_timeout`` s; then
  the engine cores; SIGKILL whatever outlives its grace (at once on a second signal); exit 0,
  or 1 after a crash loop or a failed start.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from pkgd import log
from pkgd.config.sources import ConfigSources
from pkgd.config.vllm_config import ServePlan, VllmConfig
from pkgd.supervisor import reload as reloading
from pkgd.supervisor.children import Child, ChildStartError
from pkgd.supervisor.control import ControlServer
from pkgd.supervisor.fleet import Fleet, Generation, StopRequested
from pkgd.supervisor.headline import ready_headline
from pkgd.supervisor.health import HealthMonitor
from pkgd.supervisor.notify import Notifier
from pkgd.supervisor.preflight import serve_problems
from pkgd.supervisor.restart import RestartPolicy
from pkgd.supervisor.retire import API_STOP_EXTRA, Retirements
from pkgd.supervisor.runtime import RuntimeDir, RuntimeDirError, resolve_runtime_dir
from pkgd.supervisor.sockets import BindError, Listener, listen_specs, open_listeners
from pkgd.supervisor.topology import Entrypoints, api_specs, child_env, engine_specs
from pkgd.supervisor.watch import ConfigWatcher

logger = log.get_logger(__name__)

ENGINE_STOP_GRACE = 10.0  # s an engine core gets to abort its requests and exit
LOADING_STOP_GRACE = 1.5  # s for a child still starting (SIGTERM during load exits within 2 s)

PROBE_INTERVAL = 5.0  # s between /health probes (shorter when the watchdog is faster)
EXIT_USAGE = 2  # bad config, port in use, runtime dir unusable
EXIT_FAILURE = 1  # children failed to start, crash loop


class Supervisor:
    """Runs one pkgd daemon for ``config``; ``recompose`` re-reads the config on reload.

    ``recompose`` returns a validated `VllmConfig` or raises (``ConfigError`` with
    ``.problems``, pydantic's ``ValidationError``, anything else: all reject the reload).
    ``sources``: the files ``recompose`` reads, watched while ``supervisor.watch_config`` is
    on (None: nothing to watch; turning the key on then logs ``config_watch_idle``).
    """

    def __init__(
        self,
        config: VllmConfig,
        recompose: Callable[[], VllmConfig],
        *,
        entrypoints: Entrypoints | None = None,
        environ: dict[str, str] | None = None,
        preflight: Callable[[VllmConfig], list[str]] = serve_problems,
        sources: ConfigSources | None = None,
    ) -> None:
        self.config = config
        # What this host cannot serve of a tree (one line each), checked before the first start
        # and before a reload starts a new generation (`pkgd.supervisor.reload`).
        self.preflight = preflight
        self.sources = sources
        self._watcher: ConfigWatcher | None = None
        self.plan = config.serve_plan()
        self.recompose = recompose
        self.entry = entrypoints or Entrypoints()
        self.environ = dict(os.environ if environ is None else environ)
        self.notifier = Notifier.from_env(self.environ)
        self.runtime = RuntimeDir(resolve_runtime_dir(config.supervisor.runtime_dir, self.environ))
        self.listeners: list[Listener] = []
        self.health = HealthMonitor()
        self.state = "starting"
        self.exit_code = 0
        self.started_at = time.monotonic()
        self.last_reload: dict[str, Any] | None = None
        self._reload_waiters: list[asyncio.Future[dict[str, Any]]] = []
        self._reload_requested = False
        self._loops: list[asyncio.Task[None]] = []  # watchdog, probes

    # ---- synchronous entry -------------------------------------------------------------

    def prepare(self) -> None:
        """Bind listeners, create and lock the runtime dir (raises BindError, RuntimeDirError)."""
        self.listeners = open_listeners(listen_specs(self.config, self.plan), self.environ)
        self.runtime.acquire()
        self.runtime.make_metrics_dir(0)

    def run(self) -> int:
        """Serve until stopped; the process exit status (0, 1, or 2 for start-up errors)."""
        try:
            if problems := self.preflight(self.config):
                for problem in problems:
                    logger.error("startup_failed", error=problem)
                return EXIT_USAGE
            try:
                self.prepare()
            except (BindError, RuntimeDirError) as exc:
                logger.error("startup_failed", error=str(exc))
                return EXIT_USAGE
            return asyncio.run(self._main())
        finally:
            for listener in self.listeners:
                listener.close()
            self.runtime.release()

    # ---- environment of children -----------------------------------------------------

    def engine_env(self) -> dict[str, str]:
        return child_env(self.environ)

    def api_env(self) -> dict[str, str]:
        return child_env(self.environ, PROMETHEUS_MULTIPROC_DIR=str(self.runtime.metrics_dir(0)))

    # ---- main loop ---------------------------------------------------------------------

    async def _main(self) -> int:
        loop = asyncio.get_running_loop()
        self.fleet = Fleet(RestartPolicy(self.config.supervisor), self._give_up, self._child_exited)
        self.fleet.ready_timeout = self.config.supervisor.engine_ready_timeout
        self.retirements = Retirements(self.fleet, self._tcp_ports, ENGINE_STOP_GRACE)
        self._wake = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_stop_signal, signum)
        loop.add_signal_handler(signal.SIGHUP, self._on_reload_signal)
        control = ControlServer(self.runtime.control_socket, {"status": self._cmd_status, "reload": self._cmd_reload})
        await control.start()
        try:
            await self._start()
            self.health.timeout = min(3.0, max(0.5, self._probe_interval()))
            self.state = "running"
            self._announce_ready()
            self._loops = [asyncio.ensure_future(self._watchdog_loop()), asyncio.ensure_future(self._probe_loop())]
            await self._sync_watcher()
            while not self.fleet.stop_event.is_set():
                await self._wake.wait()
                self._wake.clear()
                if self._reload_requested and not self.fleet.stop_event.is_set():
                    await self._reload()
        except StopRequested:
            pass
        except (ChildStartError, OSError) as exc:  # OSError: a child program cannot be executed
            logger.error("startup_failed", error=str(exc))
            self.exit_code = EXIT_USAGE if getattr(exc, "usage", False) else EXIT_FAILURE
        except reloading.RollbackFailed as exc:
            logger.error("reload_rollback_failed", error=str(exc))
            self.exit_code = EXIT_FAILURE
        finally:
            await self._shutdown()
            await control.close()
        return self.exit_code

    async def _start(self) -> None:
        gen = self.fleet.new_generation(self.config)
        await self.start_generation(gen, self.plan, self.listeners)
        self.fleet.install(gen)
        self.fleet.restarts_enabled = True

    async def start_generation(self, gen: Generation, plan: ServePlan, listeners: list[Listener]) -> None:
        """Start ``gen``'s children and wait until they are ready (`Fleet.start`): new engine
        cores unless it carries some, and API servers wired to its cores."""
        cores = (
            [] if gen.engines else engine_specs(gen.config, plan, self.runtime, gen.id, self.entry, self.engine_env())
        )
        addresses = {spec.index: spec.address for spec in cores} or {
            rank: c.spec.address for rank, c in gen.engines.items()
        }
        apis = api_specs(gen.config, plan, self.runtime, listeners, addresses, gen.id, self.entry, self.api_env())
        await self.fleet.start(gen, cores, apis)

    # ---- signals and requests (handlers only flip state) -------------------------------

    def _on_stop_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.fleet.stop_event.is_set():
            if not self.fleet.force_event.is_set():
                logger.warning("stop_forced", reason=f"second {name}: in-flight requests are cut")
            self.fleet.force_event.set()  # second signal: stop waiting, kill
        elif log.is_console():  # a person pressed Ctrl-C: say why it may take a while, and the way out
            print(
                f"pkgd: stopping - in-flight requests get up to {self.config.supervisor.drain_timeout:g} s "
                f"(supervisor.drain_timeout) to finish; press Ctrl-C again to stop now",
                file=sys.stderr,
                flush=True,
            )
        self._request_stop(f"received {name}")

    def _request_stop(self, reason: str) -> None:
        if not self.fleet.stop_event.is_set():
            logger.info("stop_requested", reason=reason)
        self.fleet.stop_event.set()
        self._wake.set()

    def _on_reload_signal(self) -> None:
        self._reload_requested = True
        self._wake.set()

    def _give_up(self, reason: str) -> None:
        logger.error("crash_loop", reason=reason)
        self.exit_code = EXIT_FAILURE
        self._request_stop(reason)

    def _child_exited(self, child: Child) -> None:
        if child.spec.role == "api-server":
            self._mark_metrics_dead(child.pid)

    def _mark_metrics_dead(self, pid: int) -> None:
        """prometheus_client multiprocess mode: drop a dead API server's live gauges."""
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, str(self.runtime.metrics_dir(0)))

    # ---- reload ------------------------------------------------------------------------

    async def _reload(self) -> None:
        self._reload_requested = False
        waiters, self._reload_waiters = self._reload_waiters, []
        self.state = "reloading"
        self.notifier.reloading()
        logger.info("reload_started", config_hash=self.config.digest())
        try:
            outcome = await reloading.reload(self)
        except BaseException:
            self._reload_waiters = waiters + self._reload_waiters  # _shutdown answers them
            raise
        self.state = "running"
        self.health.reset()
        self.last_reload = {**outcome, "at": time.time()}
        if outcome["ok"]:
            logger.info(
                "reload_" + outcome["result"], **{k: outcome[k] for k in ("reload_class", "changed", "duration_s")}
            )
        else:
            for problem in outcome["problems"]:
                logger.error("reload_" + outcome["result"], problem=problem)
        self.notifier.ready(self._status_line())
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(outcome)
        await self._sync_watcher()

    async def _sync_watcher(self) -> None:
        """Start, stop or restart the config watcher as ``supervisor.watch_config`` and
        ``watch_debounce`` now say (both live keys)."""
        cfg = self.config.supervisor
        want = cfg.watch_config and not self.fleet.stop_event.is_set()
        if self._watcher is not None and (not want or self._watcher.debounce != cfg.watch_debounce):
            watcher, self._watcher = self._watcher, None
            await watcher.stop()
            logger.info("config_watch_stopped", reason="supervisor.watch_config off" if not want else "new debounce")
        if want and self._watcher is None:
            if self.sources is None:
                logger.warning("config_watch_idle", reason="this supervisor was started without config files")
                return
            self._watcher = ConfigWatcher(self.sources, self._on_config_changed, cfg.watch_debounce)
            self._watcher.start()

    def _on_config_changed(self, files: list[str]) -> None:
        self._on_reload_signal()  # the SIGHUP path: same reload, same log lines

    def adopt_config(self, new: VllmConfig) -> None:
        """Make ``new`` current after it was applied (live supervisor settings included)."""
        self.config, self.plan = new, new.serve_plan()
        self.fleet.policy.config = new.supervisor
        self.fleet.ready_timeout = new.supervisor.engine_ready_timeout
        log.configure(new.logging, role="supervisor")

    def swap_listeners(self, listeners: list[Listener]) -> None:
        """Hold ``listeners`` from now on; close the held ones not among them."""
        for old in self.listeners:
            if old not in listeners:
                old.close()
        self.listeners = listeners

    def retire(self, children: list[Child], config: VllmConfig) -> None:
        """Drain replaced children in the background under ``config``'s supervisor section
        (`pkgd.supervisor.retire`): API servers keep their requests until each ends."""
        self.retirements.start(children, config)

    async def drain_replaced(self, children: list[Child], config: VllmConfig) -> None:
        """`retire`, awaited (a stop-first engine swap)."""
        await self.retirements.drain(children, config)

    def _tcp_ports(self) -> set[int]:
        return {lst.sock.getsockname()[1] for lst in self.listeners if lst.sock.family != socket.AF_UNIX}

    async def stop_in_order(self, children: list[Child]) -> None:
        apis = [c for c in children if c.spec.role == "api-server"]
        engines = [c for c in children if c.spec.role == "engine-core"]
        await self.fleet.stop_all(apis, self._stop_grace)
        await self.fleet.stop_all(engines, self._stop_grace)

    def _stop_grace(self, child: Child) -> float:
        if child.state == "starting":
            return LOADING_STOP_GRACE
        if child.spec.role == "api-server":
            return self.config.supervisor.drain_timeout + API_STOP_EXTRA
        return ENGINE_STOP_GRACE

    # ---- shutdown ----------------------------------------------------------------------

    async def _shutdown(self) -> None:
        self.state = "stopping"
        self.notifier.stopping()
        self.fleet.stop_event.set()
        self.fleet.cancel_restarts()
        for task in self._loops:
            task.cancel()
        if self._watcher is not None:  # ends within a debounce step, meanwhile the children stop
            self._loops.append(asyncio.ensure_future(self._watcher.stop()))
        for listener in self.listeners:
            # before the API servers' last accepts, so none of their closes resets a connection
            try:
                listener.refuse_new_connections()
            except OSError as exc:  # only the reset-free close is lost
                logger.warning("listener_filter_failed", url=listener.url, error=exc.strerror)
            listener.close()
        started = time.monotonic()
        await self.stop_in_order(self.fleet.alive())
        await asyncio.gather(*self._loops, self.retirements.wait(), return_exceptions=True)
        for waiter in self._reload_waiters:
            if not waiter.done():
                waiter.set_result({"ok": False, "result": "stopped", "problems": ["pkgd is stopping"]})
        logger.info("stopped", exit_code=self.exit_code, stop_s=round(time.monotonic() - started, 2))

    # ---- readiness, watchdog, health --------------------------------------------------

    def _announce_ready(self) -> None:
        urls = [lst.url for lst in self.listeners]
        engines = [c.spec.address for c in self.fleet.engines.values()]
        if log.is_console():  # a person is watching: the URL first, in words (JSON logs stay as they are)
            print(ready_headline(self.config, urls, list(self.fleet.engines.values())), file=sys.stderr, flush=True)
        logger.info(
            "ready",
            url=urls[0] if urls else None,
            urls=urls,
            mode=self.plan.mode,
            engines=engines,
            api_servers=len(self.fleet.apis),
            config_hash=self.config.digest(),
        )
        self.notifier.ready(self._status_line())

    def _status_line(self) -> str:
        where = ", ".join(lst.url for lst in self.listeners) or "engine cores " + ", ".join(
            c.spec.address for c in self.fleet.engines.values()
        )
        text = (
            f"{self.plan.mode}: {len(self.fleet.engines)} engine core(s), {len(self.fleet.apis)} API server(s) "
            f"on {where}"
        )
        if self.health.summary():
            text += f"; {self.health.summary()}"
        down = [f"{c['role']}-{c['index']}" for c in self.fleet.describe() if c["state"] != "ready"]
        if down and self.state == "running":
            text += f"; restarting {', '.join(down)}"
        if self.last_reload and not self.last_reload["ok"]:
            text += f"; last reload {self.last_reload['result']}: {'; '.join(self.last_reload['problems'])}"
        return text

    def _probe_interval(self) -> float:
        return min(PROBE_INTERVAL, self.notifier.watchdog_interval or PROBE_INTERVAL)

    def healthy(self) -> bool:
        """False only when something is stuck: an endpoint failing for 3 probe intervals while
        every child is ready (transitions are bounded by their own timeouts)."""
        if self.state != "running" or not self.fleet.steady():
            return True
        return not self.health.failing_longer_than(3 * self._probe_interval())

    async def _watchdog_loop(self) -> None:
        interval = self.notifier.watchdog_interval
        if interval is None:
            return
        warned = False
        while True:
            if not self.config.supervisor.watchdog:
                pass  # turned off (live field): systemd will act after WatchdogSec
            elif self.healthy():
                self.notifier.watchdog()
                warned = False
            elif not warned:
                logger.error("watchdog_withheld", failing=[e.as_dict() for e in self.health.failing_longer_than(0)])
                warned = True
            await asyncio.sleep(interval)

    async def _probe_loop(self) -> None:
        """Probe the endpoints; update ``STATUS=`` when the status line changes."""
        last = ""
        while True:
            await self.health.probe_all(self.listeners)
            line = self._status_line()
            if line != last and self.state == "running":
                self.notifier.status(line)
                last = line
            await asyncio.sleep(self._probe_interval())

    # ---- control socket ---------------------------------------------------------------

    async def _cmd_status(self) -> dict[str, Any]:
        return {"ok": True, "status": self.status()}

    async def _cmd_reload(self) -> dict[str, Any]:
        if self.state in ("starting", "stopping"):
            return {"ok": False, "result": "refused", "problems": [f"pkgd is {self.state}"]}
        waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._reload_waiters.append(waiter)
        self._on_reload_signal()
        return await waiter

    def status(self) -> dict[str, Any]:
        """What ``pkgd status`` shows."""
        return {
            "pid": os.getpid(),
            "state": self.state,
            "mode": self.plan.mode,
            "uptime_s": round(time.monotonic() - self.started_at, 1),
            "config_hash": self.config.digest(),
            "model": self.config.model.name or self.config.model.source,
            "urls": [lst.url for lst in self.listeners],
            "runtime_dir": str(self.runtime.path),
            "engine_generation": self.fleet.engine_generation,
            "api_generation": self.fleet.api_generation,
            "children": self.fleet.describe(),
            "generation": self.fleet.current.id if self.fleet.current is not None else None,
            "retiring": len(set(self.fleet.alive()) - set(self.fleet.current_children())),  # replaced, still draining
            "draining": self.retirements.describe(),
            "health": [e.as_dict() for e in self.health.endpoints.values()],
            "crashes_in_window": self.fleet.policy.crashes_in_window(time.monotonic()),
            "last_reload": self.last_reload,
        }
