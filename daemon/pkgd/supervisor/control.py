"""The control socket: ``RUNTIME_DIR/control.sock``, used by ``pkgd status`` and ``pkgd reload``.

Protocol: the client sends one JSON object on one line, ``{"command": NAME}``; the supervisor
answers one JSON object on one line and closes. ``ok`` is false when the command failed, with
``error`` saying why. Access control is the runtime directory's mode (0700, owned by the
daemon's user) and the socket's (0600); root may always connect.

Commands (the supervisor registers the handlers):

* ``status`` → ``{"ok": true, "status": {...}}`` (children, PIDs, uptime, config hash, mode);
* ``reload`` → the outcome of a reload, as for SIGHUP, once it finished.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from pkgd import log

logger = log.get_logger(__name__)

Handler = Callable[[], Awaitable[dict[str, Any]]]
MAX_REQUEST_BYTES = 4096


class ControlError(Exception):
    """The daemon could not be reached, or answered with an error."""


class ControlServer:
    """Serves the control protocol on a Unix socket with the given command handlers."""

    def __init__(self, path: Path, handlers: dict[str, Handler]) -> None:
        self.path = path
        self.handlers = handlers
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self.path.unlink(missing_ok=True)
        old = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        finally:
            os.umask(old)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        self.path.unlink(missing_ok=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5.0)
            if not line:  # a probe (``pkgd status`` finding the live daemon) that sent nothing
                return
            reply = await self._dispatch(line)
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _dispatch(self, line: bytes) -> dict[str, Any]:
        try:
            request = json.loads(line[:MAX_REQUEST_BYTES])
            command = request["command"]
        except (ValueError, KeyError, TypeError):
            return {"ok": False, "error": 'expected one JSON line {"command": NAME}'}
        handler = self.handlers.get(command) if isinstance(command, str) else None
        if handler is None:
            return {"ok": False, "error": f"unknown command {command!r}; known: {', '.join(sorted(self.handlers))}"}
        (logger.debug if command == "status" else logger.info)("control_command", command=command)
        return await handler()


def send_command(path: Path, command: str, timeout: float = 600.0) -> dict[str, Any]:
    """Send one command to the daemon listening on ``path``; its JSON reply.

    Raises `ControlError` when no daemon listens there or the reply is not JSON.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise ControlError(f"no pkgd daemon is listening on {path} ({exc.strerror})") from exc
        except PermissionError as exc:
            raise ControlError(f"permission denied on {path}: run as the daemon's user or root") from exc
        sock.sendall(json.dumps({"command": command}).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    try:
        return json.loads(data)
    except ValueError as exc:
        raise ControlError(f"the daemon on {path} sent no valid reply") from exc
