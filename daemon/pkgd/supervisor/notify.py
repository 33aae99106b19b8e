"""systemd's readiness protocol (``sd_notify``), written with the standard ``socket`` module.

The protocol (systemd's ``sd_notify(3)`` and ``systemd.service(5)``): when systemd starts a
``Type=notify`` service it sets ``NOTIFY_SOCKET`` to a Unix datagram socket, either a path or,
when it starts with ``@``, an abstract-namespace name (the ``@`` stands for a leading NUL byte).
The service sends newline-separated ``KEY=VALUE`` assignments in one datagram:

* ``READY=1`` once serving (start-up done, or a reload finished);
* ``RELOADING=1`` with ``MONOTONIC_USEC=<CLOCK_MONOTONIC in µs>`` when a reload begins;
* ``STOPPING=1`` when shutdown begins;
* ``STATUS=<text>`` a one-line status shown by ``systemctl status``;
* ``WATCHDOG=1`` a keep-alive, due at least every ``WATCHDOG_USEC`` µs (systemd sets it from
  ``WatchdogSec=``; ``WATCHDOG_PID``, when set, names the process that must send it).

Without ``NOTIFY_SOCKET`` every call is a no-op, so the daemon runs the same outside systemd.
A failed send is logged once and never stops the daemon.
"""

from __future__ import annotations

import os
import socket
import time

from pkgd import log

logger = log.get_logger(__name__)

#: Variables systemd sets for the main process only; children must not inherit them (a child
#: sending READY=1 or adopting the listening fds would confuse systemd and the supervisor).
SYSTEMD_ONLY_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")


def _address(value: str) -> str | bytes:
    """The ``sockaddr_un`` for a ``NOTIFY_SOCKET`` value; ``@name`` is abstract (leading NUL)."""
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    return value


class Notifier:
    """Sends ``sd_notify`` datagrams to the socket named by ``NOTIFY_SOCKET`` (if any).

    ``watchdog_interval`` is the ping period in seconds, half of ``WATCHDOG_USEC`` as
    ``sd_watchdog_enabled(3)`` recommends, or None when systemd asked for no watchdog (or
    asked another process, per ``WATCHDOG_PID``).
    """

    def __init__(self, notify_socket: str | None, watchdog_usec: int | None = None) -> None:
        self.address = _address(notify_socket) if notify_socket else None
        self.watchdog_interval = watchdog_usec / 2e6 if watchdog_usec else None
        self._warned = False

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Notifier:
        """Read ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and ``WATCHDOG_PID`` (not modified)."""
        env = os.environ if environ is None else environ
        usec: int | None = None
        raw = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        if raw.isdigit() and int(raw) > 0 and (not pid or pid == str(os.getpid())):
            usec = int(raw)
        return cls(env.get("NOTIFY_SOCKET") or None, usec)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, **fields: object) -> bool:
        """Send one datagram of ``KEY=VALUE`` lines (keyword names are the keys).

        Returns whether it was sent. Newlines in values are replaced by spaces, since each
        line is one assignment.
        """
        if self.address is None:
            return False
        text = "\n".join(f"{k}={str(v).replace(chr(10), ' ')}" for k, v in fields.items())
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(text.encode(), self.address)
        except OSError as exc:
            if not self._warned:
                logger.warning("sd_notify_failed", error=str(exc), notify_socket=str(self.address))
                self._warned = True
            return False
        return True

    def ready(self, status: str) -> bool:
        """``READY=1`` with a ``STATUS=`` line (start-up or reload finished)."""
        return self.send(READY=1, STATUS=status)

    def reloading(self, status: str = "reloading configuration") -> bool:
        """``RELOADING=1`` stamped with ``MONOTONIC_USEC`` (CLOCK_MONOTONIC, µs)."""
        return self.send(RELOADING=1, MONOTONIC_USEC=time.monotonic_ns() // 1000, STATUS=status)

    def stopping(self, status: str = "stopping") -> bool:
        """``STOPPING=1``: shutdown began."""
        return self.send(STOPPING=1, STATUS=status)

    def status(self, status: str) -> bool:
        """Only a ``STATUS=`` line."""
        return self.send(STATUS=status)

    def watchdog(self) -> bool:
        """One ``WATCHDOG=1`` keep-alive."""
        return self.send(WATCHDOG=1)
