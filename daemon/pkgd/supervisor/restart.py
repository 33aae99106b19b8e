"""When to restart a crashed child, and when to give up.

Exponential backoff as systemd's ``RestartSec=``/``RestartMaxDelaySec=`` and Kubernetes'
CrashLoopBackOff do it: the n-th crash inside the window waits ``restart_backoff * 2**(n-1)``
seconds, at most ``restart_backoff_max``. More than ``max_restarts`` crashes (of any child)
within ``restart_window`` seconds means the fault will not heal by restarting, so the
supervisor exits non-zero and leaves the decision to systemd's ``Restart=`` and
``StartLimitBurst=`` (the same shape as systemd's own start-rate limiting).
"""

from __future__ import annotations

import collections

from pkgd.config.sections import SupervisorConfig


class RestartPolicy:
    """Crash bookkeeping; times are ``time.monotonic()`` seconds."""

    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        self._crashes: collections.deque[float] = collections.deque()

    def crashes_in_window(self, now: float) -> int:
        """Crashes recorded within ``restart_window`` seconds before ``now``."""
        while self._crashes and now - self._crashes[0] > self.config.restart_window:
            self._crashes.popleft()
        return len(self._crashes)

    def record_crash(self, now: float) -> float | None:
        """Record a crash at ``now``; the delay before restarting, or None to give up."""
        self._crashes.append(now)
        n = self.crashes_in_window(now)
        if n > self.config.max_restarts:
            return None
        return min(self.config.restart_backoff * 2 ** (n - 1), self.config.restart_backoff_max)
