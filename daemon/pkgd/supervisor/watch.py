"""``supervisor.watch_config``: reload when a file the config layers read changes.

The watcher only notices; the supervisor's loop reloads. `ConfigWatcher` watches the
directories of `pkgd.config.sources.ConfigSources` with watchfiles (inotify on Linux; every
entry, hidden ones included, so a ConfigMap's ``..data`` swap is seen), waits until the tree
has been quiet for ``supervisor.watch_debounce`` s (watchfiles' ``step``: a burst of events
is one batch), then compares a content snapshot of the files the layers read with the last
one. Only a real difference calls ``on_change(files)``, which queues the same reload as SIGHUP
(`Supervisor._on_reload_signal`): a tree that does not validate is logged ``reload_rejected``
there and the running config keeps serving. The snapshot moves on with every difference, so a
rejected tree is reported once and the next edit (the fix) reloads again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pkgd import log
from pkgd.config.sources import ConfigSources, changed_files

logger = log.get_logger(__name__)

MAX_BATCH_S = 10.0  # longest a continuous stream of events is grouped before it is compared
IDLE_TICK_S = 1.0  # an empty batch after this long without events (the first says the watch is set)


class ConfigWatcher:
    """Watches ``sources`` until `stop`; calls ``on_change(labels)`` for each real change.

    ``debounce``: seconds of quiet that end a batch of file events (> 0).
    """

    def __init__(self, sources: ConfigSources, on_change: Callable[[list[str]], None], debounce: float) -> None:
        self.sources = sources
        self.on_change = on_change
        self.debounce = debounce
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """End the watch (within one ``debounce`` step: watchfiles polls the event then)."""
        self._stop.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), self.debounce + 5.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._task.cancel()
            except Exception as exc:  # already logged by _run; stopping must not fail
                logger.warning("config_watch_stop_failed", error=str(exc))

    async def _run(self) -> None:
        from watchfiles import awatch

        paths = self.sources.watch_paths()
        if not paths:
            logger.warning("config_watch_idle", reason="no system config directory or --config file to watch")
            return
        # The snapshot is taken before the watches are set and compared once they are (the
        # first, possibly empty, batch), so an edit in between is not lost; config_watch_started
        # is logged only then, when an edit is sure to be seen.
        last = await asyncio.to_thread(self.sources.snapshot)  # before the watch: nothing slips between
        step_ms = max(1, round(self.debounce * 1000))
        watching = False
        try:
            async for events in awatch(
                *paths,
                watch_filter=None,  # hidden entries matter: the kubelet swaps ..data
                step=step_ms,
                debounce=max(step_ms, round(MAX_BATCH_S * 1000)),
                stop_event=self._stop,
                rust_timeout=round(IDLE_TICK_S * 1000),
                yield_on_timeout=True,  # an empty batch: the watches are in place
                recursive=True,
                ignore_permission_denied=True,
            ):
                if not events and watching:
                    continue
                if not watching:
                    watching = True
                    logger.info("config_watch_started", paths=[str(p) for p in paths], files=sorted(last))
                now = await asyncio.to_thread(self.sources.snapshot)
                changed = changed_files(last, now)
                if not changed:  # churn beside the config (editor files, other entries): nothing read changed
                    if events:
                        logger.debug("config_watch_unchanged", events=len(events))
                    continue
                last = now
                logger.info("config_changed", files=changed, action="reload")
                self.on_change(changed)
        except Exception as exc:  # a watch that fails leaves SIGHUP working; never the daemon down
            logger.error("config_watch_failed", error=f"{type(exc).__name__}: {exc}")
