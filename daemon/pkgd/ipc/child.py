"""What every pkgd child process does first: die with its parent, name itself, read the
config, report ready (or why it failed) on the ready pipe, and turn signals into state.

The supervisor spawns children with ``subprocess.Popen([sys.executable, "-m", ...],
pass_fds=...)`` and reads exactly one msgpack frame from each child's ``--ready-fd`` pipe
(`pkgd.ipc.messages.Handshake`, `ApiServerReady` or `ChildFailed`). Entries stay short and
uniform; signal handlers only flip flags and wake the loop.
Torch-free: API servers import this.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pkgd.ipc.config_channel import ConfigReader
from pkgd.ipc.messages import ChildFailed, Message, encode

if TYPE_CHECKING:
    from pkgd.config.vllm_config import VllmConfig

# <linux/prctl.h>
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def _prctl(option: int, arg: int | bytes) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return libc.prctl(option, arg, 0, 0, 0) == 0


def die_with_parent(parent_pid: int | None = None) -> None:
    """Ask the kernel to SIGKILL this process when its parent exits (Linux prctl).

    SIGKILL rather than SIGTERM: a parent that died without stopping its children (kill -9)
    can no longer drain them, and nothing must outlive it. When the parent is already gone
    (``parent_pid`` given and no longer our parent) the process exits at once.
    """
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def set_process_name(name: str) -> None:
    """Set the name ``ps -o comm`` and ``top`` show (at most 15 bytes, Linux prctl)."""
    _prctl(_PR_SET_NAME, name.encode()[:15])


class ConfigSource:
    """Where a child's configuration comes from: the supervisor's config pipe (``--config-fd``,
    `pkgd.ipc.config_channel`: the first frame at start, one more per live reload) or a file
    (``--config-file``, for a child started by hand: re-read on SIGHUP).

    ``fd`` is the pipe to watch for updates (None for a file).
    """

    def __init__(self, config_fd: int | None, config_file: str | None) -> None:
        if (config_fd is None) == (config_file is None):
            raise ValueError("give exactly one of --config-fd and --config-file")
        self.config_file = config_file
        self._reader = ConfigReader(config_fd) if config_fd is not None else None

    @property
    def fd(self) -> int | None:
        return self._reader.fd if self._reader is not None else None

    def describe(self) -> str:
        return f"fd {self.fd}" if self._reader is not None else str(self.config_file)

    def initial(self, timeout: float = 30.0) -> VllmConfig:
        """The configuration to start with.

        Raises ``OSError`` / ``EOFError`` / ``TimeoutError`` (nothing to read) or
        ``ValueError`` (not a valid configuration).
        """
        if self._reader is not None:
            return self._reader.read_first(timeout)
        return load_config(self.config_file)  # type: ignore[arg-type]

    def updates(self) -> list[VllmConfig]:
        """New configurations: the frames that arrived (pipe), or the file read again (call
        it on SIGHUP). Raises ``OSError``/``ValueError`` like `initial`."""
        if self._reader is not None:
            return self._reader.read_available()
        return [load_config(self.config_file)]  # type: ignore[arg-type]

    @property
    def closed(self) -> bool:
        """The supervisor closed its end of the pipe (it is gone): stop watching ``fd``."""
        return self._reader is not None and self._reader.closed


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """``--config-fd N`` (from the supervisor) or ``--config-file PATH`` (by hand)."""
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--config-fd", type=int, help="pipe the supervisor writes the configuration to")
    group.add_argument("--config-file", help="config.json to read (a child started by hand; SIGHUP re-reads it)")


def load_config(path: str | os.PathLike[str]) -> VllmConfig:
    """Read and validate a ``config.json`` (a child started by hand).

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not JSON or not a valid `VllmConfig` (pydantic's ValidationError
            is a ValueError).
    """
    from pkgd.config.vllm_config import VllmConfig

    with Path(path).open("rb") as f:
        return VllmConfig.model_validate(json.load(f))


class ReadyPipe:
    """The write end of the ``--ready-fd`` pipe: one frame, then closed.

    ``fd`` None (a child started by hand, without a supervisor) makes every call a no-op.
    """

    def __init__(self, fd: int | None) -> None:
        self._fd = fd
        self.sent = False  # a frame went out (later ones are not sent)

    def send(self, msg: Message) -> None:
        """Write ``msg`` as one msgpack frame and close the pipe; later calls do nothing."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        self.sent = True
        data = encode(msg)
        try:
            while data:
                data = data[os.write(fd, data) :]
        except BrokenPipeError:
            pass  # the supervisor stopped listening; it will see our exit status instead
        finally:
            os.close(fd)

    def failed(self, role: str, message: str, *, usage: bool = False) -> None:
        """Report a start-up failure (`ChildFailed`; ``usage``: the config is at fault); the
        caller then exits 1."""
        self.send(ChildFailed(role=role, message=message, usage=usage))


class SignalState:
    """Flags set by SIGTERM/SIGINT (``stop``) and SIGHUP (``reload``).

    The handlers only set a flag and, through `signal.set_wakeup_fd`, write a byte to
    ``wakeup_fd``, so a loop blocked in ``poll`` on that fd returns at once and does the work
    itself. Install it in the main thread.
    """

    def __init__(self) -> None:
        self.stop = False
        self.reload = False
        self._read_fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    @property
    def wakeup_fd(self) -> int:
        """Readable when a signal arrived; `drain` it after waking."""
        return self._read_fd

    def install(self) -> SignalState:
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_reload)
        return self

    def _on_stop(self, signum: int, frame: object) -> None:
        self.stop = True

    def _on_reload(self, signum: int, frame: object) -> None:
        self.reload = True

    def request_stop(self) -> None:
        """Set ``stop`` and wake the loop, as SIGTERM does (for in-process owners and tests)."""
        self.stop = True
        try:
            os.write(self._write_fd, b"\0")
        except BlockingIOError:
            pass  # already awake

    def drain(self) -> None:
        """Empty the wake-up pipe."""
        try:
            while os.read(self._read_fd, 512):
                pass
        except BlockingIOError:
            pass
