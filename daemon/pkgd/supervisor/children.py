"""One child process (engine core or API server) as the supervisor sees it.

A child is started with `subprocess.Popen` (never multiprocessing: the child is a fresh
interpreter running ``python -m <entry>``, which keeps the API servers free of torch) in its own
process group, so a terminal's Ctrl-C reaches only the supervisor, which then stops the children
in order (API servers drain before the engine cores go). Children die with the supervisor by
``PR_SET_PDEATHSIG``, which they set themselves.

The configuration goes to the child on another private pipe (``--config-fd C``,
`pkgd.ipc.config_channel`): the frame of the child's generation at spawn, and a new frame for
every live reload (`Child.send_config`), so no file with secrets is written and a child
restarted after a crash gets its own generation's configuration.

Start-up is reported on a private pipe (``--ready-fd R``): the child writes exactly one msgpack
frame from `pkgd.ipc.messages` and closes it: `Handshake` (engine core) or `ApiServerReady`
(API server) once serving, `ChildFailed` when start-up failed. Exit is observed through a
``pidfd`` (Linux ≥ 5.3), so the event loop learns of a death at once, without polling or
SIGCHLD handlers. Both are asyncio readers: everything here runs on the supervisor's loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from typing import Literal

import msgspec

from pkgd.ipc import messages

Role = Literal["engine-core", "api-server"]
_SIGTERM = signal.SIGTERM  # `Child.signal` shadows the module inside the class
_EXPECTED_FRAME = {"engine-core": messages.Handshake, "api-server": messages.ApiServerReady}


class ChildStartError(Exception):
    """A child failed before it reported ready (its own message, or how it died).

    ``usage``: the child said its configuration is at fault (the daemon exits 2).
    """

    def __init__(self, message: str, *, usage: bool = False) -> None:
        super().__init__(message)
        self.usage = usage


@dataclasses.dataclass(frozen=True)
class ChildSpec:
    """How to start one child; a crashed child is restarted from the same spec.

    ``index`` is the DP rank of an engine core or the server index of an API server;
    ``generation`` is the id of the generation that first started it. ``argv`` lacks
    ``--ready-fd`` and ``--config-fd``, which `Child.spawn` appends; ``pass_fds`` are
    inherited as they are.
    """

    role: Role
    index: int
    generation: int
    argv: tuple[str, ...]
    env: Mapping[str, str]
    pass_fds: tuple[int, ...] = ()
    address: str = ""  # engine core: its ZeroMQ address; API server: its listener URL

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


def describe_exit(returncode: int) -> str:
    """``"exit code 1"`` or ``"signal SIGKILL"`` for a Popen return code."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


class Child:
    """A running child: its ready frame and exit as futures on the supervisor's loop.

    ``state`` is ``starting`` → ``ready`` → (``stopping``) → ``exited``. ``retiring`` is set
    when the supervisor stops the child on purpose, so its exit is not a crash.
    """

    def __init__(
        self, spec: ChildSpec, popen: subprocess.Popen[bytes], ready_fd: int, restarts: int, config_fd: int
    ) -> None:
        self.spec = spec
        self.generation: object = None  # the `Generation` it serves (set by the fleet)
        self.popen = popen
        self.pid = popen.pid
        self.restarts = restarts
        self.started_at = time.monotonic()
        self.state: Literal["starting", "ready", "stopping", "exited"] = "starting"
        self.retiring = False
        self.returncode: int | None = None
        self.on_exit: Callable[[Child], None] | None = None
        loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[messages.ReadyMessage] = loop.create_future()
        self.ready.add_done_callback(self._ready_done)
        self.exited: asyncio.Future[int] = loop.create_future()
        self._loop = loop
        self._ready_fd: int | None = ready_fd
        self._buf = b""
        os.set_blocking(ready_fd, False)
        loop.add_reader(ready_fd, self._read_ready)
        self._pidfd: int | None = os.pidfd_open(self.pid)
        loop.add_reader(self._pidfd, self._on_exit)
        self._config_fd: int | None = config_fd
        self._config_out = b""
        os.set_blocking(config_fd, False)

    @classmethod
    def spawn(cls, spec: ChildSpec, config_frame: bytes, restarts: int = 0) -> Child:
        """Start the process and send it ``config_frame`` (call from the loop's thread:
        PDEATHSIG follows the forking thread)."""
        r, w = os.pipe()
        config_r, config_w = os.pipe()
        try:
            popen = subprocess.Popen(
                [*spec.argv, "--ready-fd", str(w), "--config-fd", str(config_r)],
                pass_fds=(w, config_r, *spec.pass_fds),
                env=dict(spec.env),
                process_group=0,
                stdin=subprocess.DEVNULL,
            )
        except OSError:
            os.close(r)
            os.close(config_w)
            raise
        finally:
            os.close(w)
            os.close(config_r)
        child = cls(spec, popen, r, restarts, config_w)
        child.send_config(config_frame)
        return child

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def alive(self) -> bool:
        return self.returncode is None

    def uptime(self) -> float:
        return time.monotonic() - self.started_at

    # ---- ready pipe ------------------------------------------------------------------

    def _read_ready(self) -> bool:
        """Read what the pipe holds; False when it would block (nothing more for now)."""
        assert self._ready_fd is not None
        try:
            chunk = os.read(self._ready_fd, 65536)
        except BlockingIOError:
            return False
        self._buf += chunk
        if not self.ready.done() and self._buf:
            try:
                frame = messages.decode_ready(self._buf)
            except msgspec.DecodeError:
                frame = None  # truncated so far, or garbage (judged at EOF)
            if frame is not None:
                self._resolve(frame)
        if not chunk:
            self._close_ready_pipe()
            if self._buf and not self.ready.done():
                self.ready.set_exception(ChildStartError(f"{self.name} wrote an invalid ready frame"))
        return True

    def _resolve(self, frame: messages.ReadyMessage) -> None:
        if isinstance(frame, messages.ChildFailed):
            self.ready.set_exception(
                ChildStartError(f"{self.name} failed to start: {frame.message}", usage=frame.usage)
            )
        elif not isinstance(frame, _EXPECTED_FRAME[self.spec.role]):
            self.ready.set_exception(ChildStartError(f"{self.name} sent {type(frame).__name__} as its ready frame"))
        else:
            self.ready.set_result(frame)

    def _ready_done(self, fut: asyncio.Future[messages.ReadyMessage]) -> None:
        # Calling exception() also marks a failure as seen, so a child that dies before
        # anyone awaits `ready` logs no "exception never retrieved".
        if not fut.cancelled() and fut.exception() is None and self.state == "starting":
            self.state = "ready"

    def _close_ready_pipe(self) -> None:
        if self._ready_fd is not None:
            self._loop.remove_reader(self._ready_fd)
            os.close(self._ready_fd)
            self._ready_fd = None

    # ---- configuration pipe ------------------------------------------------------------

    def send_config(self, frame: bytes) -> None:
        """Queue one configuration frame for the child (written as the pipe takes it)."""
        if self._config_fd is None:
            return
        self._config_out += frame
        self._write_config()

    def _write_config(self) -> None:
        assert self._config_fd is not None
        try:
            while self._config_out:
                self._config_out = self._config_out[os.write(self._config_fd, self._config_out) :]
        except BlockingIOError:
            self._loop.add_writer(self._config_fd, self._write_config)
            return
        except BrokenPipeError:  # the child exited; its exit is handled through the pidfd
            self._config_out = b""
        self._loop.remove_writer(self._config_fd)

    def _close_config_pipe(self) -> None:
        if self._config_fd is not None:
            self._loop.remove_writer(self._config_fd)
            os.close(self._config_fd)
            self._config_fd = None

    # ---- exit ------------------------------------------------------------------------

    def _on_exit(self) -> None:
        assert self._pidfd is not None
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = None
        self.returncode = self.popen.wait()
        # A ChildFailed frame may still sit in the pipe. Stop at "would block": a grandchild
        # forked by the child may hold the write end open.
        while self._ready_fd is not None and self._read_ready():
            pass
        self._close_ready_pipe()
        self._close_config_pipe()
        self.state = "exited"
        if not self.ready.done():
            self.ready.set_exception(
                ChildStartError(
                    f"{self.name} (pid {self.pid}) exited with {describe_exit(self.returncode)} before it was ready"
                )
            )
        self.exited.set_result(self.returncode)
        if self.on_exit is not None:
            self.on_exit(self)

    def signal(self, signum: int) -> None:
        """Send ``signum`` unless the child is already reaped (no PID reuse race)."""
        if self.returncode is None:
            self.popen.send_signal(signum)

    async def stop(self, grace: float | None, signum: int = _SIGTERM) -> int:
        """Send ``signum`` (SIGTERM: stop; SIGUSR1: an API server retires, `pkgd.api.server`),
        wait up to ``grace`` seconds (None: as long as it takes), then SIGKILL; returns the exit
        status."""
        self.retiring = True
        if self.returncode is None:
            self.state = "stopping"
            self.signal(signum)
            try:
                return await asyncio.wait_for(asyncio.shield(self.exited), grace)
            except asyncio.TimeoutError:
                self.signal(signal.SIGKILL)
        return await self.exited

    async def flush_config(self, timeout: float = 5.0) -> None:
        """Wait until every queued configuration frame is in the pipe (a signal sent after this
        finds the frame readable in the child)."""
        deadline = time.monotonic() + timeout
        while self._config_out and self._config_fd is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
